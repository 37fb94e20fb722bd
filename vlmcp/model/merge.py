"""Where image features meet token embeddings, in one of two modes (`parallel.vision`):

    "split"       shard-first: each SP rank embeds only its shard's tokens [S_local, hidden],
                  encodes its balanced share of the pack's images (model.image_routing) and
                  receives, through one variable-size all-to-all, the feature rows of the
                  placeholders its shard holds. No rank holds [S, hidden].
    "replicated"  every rank embeds the whole pack and encodes every image: [S, hidden], sharded
                  afterwards.

In both, each distinct image of the pack is encoded once, also when it is shown twice (the
halves of a preference pair show their prompt's images: `PackedBatch.image_index`); its feature
rows serve every placeholder run that shows it, and the gradients of all its uses add up.

The vision tower always runs here with its own sdpa attention and never sees the Ulysses path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmcp.data.batch import PackedBatch
from vlmcp.model.image_routing import ImageRouting, distinct_feature_rows
from vlmcp.parallel import comm
from vlmcp.parallel.shard import ShardPlan


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
            if batch.image_index is not None:
                rows = distinct_feature_rows(batch.image_grid_thw, batch.image_index,
                                             vision.config.spatial_merge_size)
                feats = feats.index_select(0, rows.to(device))
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


def shard_first_embeddings(
    embed_tokens: nn.Module,
    vision: nn.Module,
    batch: PackedBatch,
    plan: ShardPlan,
    image_token_id: int,
    vision_trainable: bool,
) -> torch.Tensor:
    """This rank's shard of the input embeddings with image features in its placeholders:
    [S_local, hidden], padding rows zero (as `plan.shard` pads). Every rank of the SP group must
    call it with the same batch.

    Each rank runs the vision tower at most once, on the images `ImageRouting` assigns it, and the
    feature rows travel to the ranks holding their placeholders (`comm.all_to_all_rows_autograd`,
    whose backward returns each row's gradient to the rank that encoded it). A frozen tower runs
    without autograd and is skipped by a rank with no image. A trainable tower runs on every rank,
    so that a ZeRO-3 tower issues the same parameter collectives everywhere: a rank with no image
    encodes the dummy image and sends its empty slice, which ties the dummy into the graph with
    weight zero (its backward runs too). A pack without images issues no routing collective.
    """
    device = embed_tokens.weight.device
    real_len = plan.total_len - plan.pad_len
    n_local = min(max(real_len - plan.local_start, 0), plan.local_len)
    local_ids = batch.input_ids[plan.local_start : plan.local_start + n_local].to(device)
    embeds = F.pad(embed_tokens(local_ids), (0, 0, 0, plan.local_len - n_local))
    grad = vision_trainable and torch.is_grad_enabled()
    if batch.pixel_values is None:
        if not vision_trainable:
            return embeds
        with torch.set_grad_enabled(grad):
            dummy = dummy_image_features(vision, device)
        return comm.keep_in_graph(embeds, dummy)
    positions = (batch.input_ids == image_token_id).nonzero().squeeze(1)
    try:
        routing = ImageRouting.build(batch.image_grid_thw, positions, plan.local_len, plan.size, plan.rank,
                                     vision.config.spatial_merge_size, batch.image_index)
    except ValueError as exc:
        raise ValueError(f"pack of samples {batch.sample_ids}: {exc}") from exc
    with torch.set_grad_enabled(grad):
        feats = _encode_share(vision, batch, routing, vision_trainable, embeds)
        if routing.send_index is not None:
            feats = feats.index_select(0, routing.send_index.to(device))
    rows = comm.all_to_all_rows_autograd(feats, list(routing.send_counts), list(routing.recv_counts), plan.group)
    rows = rows.index_select(0, routing.recv_order.to(device))
    mask = F.pad(local_ids == image_token_id, (0, plan.local_len - n_local))
    return embeds.masked_scatter(mask.unsqueeze(-1), rows)


def _encode_share(
    vision: nn.Module, batch: PackedBatch, routing: ImageRouting, vision_trainable: bool, embeds: torch.Tensor
) -> torch.Tensor:
    """Features of the images this rank encodes, in pack order: [N_send, hidden] in the dtype and
    on the device of `embeds`. A rank with no image gets [0, hidden]: for a trainable tower the
    empty slice of the dummy image's features (which keeps the dummy in the graph), else zeros."""
    device = embeds.device
    if routing.images:
        pixels = torch.cat([batch.pixel_values[a:b] for a, b in routing.patch_ranges])
        grids = batch.image_grid_thw[list(routing.images)]
        feats = image_features(vision, pixels.to(device), grids.to(device))
    elif vision_trainable:
        feats = dummy_image_features(vision, device)[:0]
    else:
        feats = embeds.new_zeros((0, embeds.shape[1]))
    return feats.to(embeds.dtype)
