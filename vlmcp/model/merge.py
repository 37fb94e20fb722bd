"""Pre-shard merge: token embeddings and image features for the whole pack, on every SP rank.

Runs before sharding, with replicated weights, so every rank holds the same [S, hidden] input
embeddings; the vision tower runs here with its own sdpa attention and never sees the Ulysses path.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmcp.data.batch import PackedBatch


def image_features(vision: nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Merged vision features of every image in the pack, in placeholder order.

    pixel_values: [N_patch, C*T*P*P]; image_grid_thw: [I, 3]. Returns [N_image_tokens, hidden].
    """
    out = vision(pixel_values.to(vision.dtype), grid_thw=image_grid_thw)
    return out.pooler_output


def dummy_image_features(vision: nn.Module, device: torch.device) -> torch.Tensor:
    """Features of one blank image of the smallest grid: [1, hidden]. A pack without images runs
    this so that a trainable (DeepSpeed-managed) tower issues the same parameter collectives on
    every rank."""
    config = vision.config
    merge = config.spatial_merge_size
    grid = torch.tensor([[1, merge, merge]], device=device)
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.zeros(merge * merge, patch_dim, device=device)
    return image_features(vision, pixels, grid)


def merge_embeddings(
    embed_tokens: nn.Module,
    vision: nn.Module,
    batch: PackedBatch,
    image_token_id: int,
    vision_trainable: bool,
) -> torch.Tensor:
    """Input embeddings of the whole pack with image features scattered into the placeholders.

    Returns [S, hidden] (S = batch.num_tokens, unpadded). The vision tower runs without autograd
    when frozen.
    """
    input_ids = batch.input_ids.to(embed_tokens.weight.device)
    embeds = embed_tokens(input_ids)
    device = embeds.device
    with torch.set_grad_enabled(vision_trainable and torch.is_grad_enabled()):
        if batch.pixel_values is not None:
            feats = image_features(vision, batch.pixel_values.to(device), batch.image_grid_thw.to(device))
        elif vision_trainable:
            feats = dummy_image_features(vision, device)
        else:
            return embeds
    if batch.pixel_values is None:
        return embeds + 0.0 * feats.sum().to(embeds.dtype)
    mask = input_ids == image_token_id
    if int(mask.sum()) != feats.shape[0]:
        raise ValueError(
            f"pack of samples {batch.sample_ids} has {int(mask.sum())} image placeholder tokens but its "
            f"images give {feats.shape[0]} features"
        )
    return embeds.masked_scatter(mask.unsqueeze(-1), feats.to(embeds.dtype))
