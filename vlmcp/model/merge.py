"""Where image and video features meet token embeddings, in one of two modes (`parallel.vision`):

    "split"       shard-first: each SP rank embeds only its shard's tokens [S_local, hidden],
                  encodes its cost-balanced share of the pack's vision units (whole images and
                  single video temporal groups, model.vision_routing) and receives, through one
                  variable-size all-to-all, the feature rows of the placeholders its shard
                  holds. No rank holds [S, hidden].
    "replicated"  every rank embeds the whole pack and encodes every image and video:
                  [S, hidden], sharded afterwards.

Image feature rows fill the image placeholders in order, video feature rows the video
placeholders in order, as transformers' Qwen3.5 does. Each distinct image of the pack is encoded
once, also when it is shown twice (the halves of a preference pair show their prompt's images:
`PackedBatch.image_index`); its feature rows serve every placeholder run that shows it, and the
gradients of all its uses add up. The vision tower always runs here with its own sdpa attention
and never sees the Ulysses path; each rank calls it at most once per micro-batch, images and
videos together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmcp.data.batch import PackedBatch
from vlmcp.model.vision_routing import (
    IMAGE_PIXELS,
    VIDEO_PIXELS,
    UnitRouting,
    VisionUnits,
    cost_alpha,
    distinct_feature_rows,
)
from vlmcp.parallel import comm
from vlmcp.parallel.shard import ShardPlan


def vision_features(vision: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                    ) -> torch.Tensor:
    """Merged vision features of images and videos, in grid order.

    pixel_values: [N_patch, C*T*P*P]; grid_thw: [G, 3]. Returns [sum(t*h*w) / merge**2, hidden].
    """
    out = vision(pixel_values.to(vision.dtype), grid_thw=grid_thw)
    return out.pooler_output


def dummy_image_features(vision: nn.Module, device: torch.device) -> torch.Tensor:
    """Features of one blank image of the smallest grid: [1, hidden]. A pack without images or
    videos runs this so that a trainable (DeepSpeed-managed) tower issues the same parameter
    collectives on every rank."""
    config = vision.config
    merge = config.spatial_merge_size
    grid = torch.tensor([[1, merge, merge]], device=device)
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.zeros(merge * merge, patch_dim, device=device)
    return vision_features(vision, pixels, grid)


def _has_vision(batch: PackedBatch) -> bool:
    return batch.pixel_values is not None or batch.pixel_values_videos is not None


def _scatter(embeds: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor, what: str,
             batch: PackedBatch) -> torch.Tensor:
    """embeds [S, hidden] with feats [N, hidden] written into the N positions of `mask` [S]."""
    if int(mask.sum()) != feats.shape[0]:
        raise ValueError(f"pack of samples {batch.sample_ids} has {int(mask.sum())} {what} "
                         f"placeholder tokens but its {what}s give {feats.shape[0]} features")
    return embeds.masked_scatter(mask.unsqueeze(-1), feats.to(embeds.dtype))


def merge_embeddings(
    embed_tokens: nn.Module,
    vision: nn.Module,
    batch: PackedBatch,
    image_token_id: int,
    video_token_id: int,
    vision_trainable: bool,
) -> torch.Tensor:
    """Input embeddings of the whole pack with image and video features scattered into their
    placeholders.

    Returns [S, hidden] (S = batch.num_tokens, unpadded). The vision tower runs once, on every
    image and video of the pack, and without autograd when frozen.
    """
    input_ids = batch.input_ids.to(embed_tokens.weight.device)
    embeds = embed_tokens(input_ids)
    device = embeds.device
    sources = [(batch.pixel_values, batch.image_grid_thw),
               (batch.pixel_values_videos, batch.video_grid_thw)]
    present = [(pixels, grid) for pixels, grid in sources if pixels is not None]
    with torch.set_grad_enabled(vision_trainable and torch.is_grad_enabled()):
        if present:
            feats = vision_features(vision, torch.cat([p for p, _ in present]).to(device),
                                    torch.cat([g for _, g in present]).to(device))
        elif vision_trainable:
            feats = dummy_image_features(vision, device)
        else:
            return embeds
    if not present:
        return comm.keep_in_graph(embeds, feats)
    merge = vision.config.spatial_merge_size
    image_rows = 0 if batch.image_grid_thw is None else \
        int(batch.image_grid_thw.prod(-1).sum()) // merge**2
    image_feats = feats[:image_rows]
    if batch.image_index is not None:
        uses = distinct_feature_rows(batch.image_grid_thw, batch.image_index, merge)
        image_feats = image_feats.index_select(0, uses.to(device))
    embeds = _scatter(embeds, input_ids == image_token_id, image_feats, "image", batch)
    return _scatter(embeds, input_ids == video_token_id, feats[image_rows:], "video", batch)


def shard_first_embeddings(
    embed_tokens: nn.Module,
    vision: nn.Module,
    batch: PackedBatch,
    plan: ShardPlan,
    image_token_id: int,
    video_token_id: int,
    vision_trainable: bool,
) -> torch.Tensor:
    """This rank's shard of the input embeddings with image and video features in its
    placeholders: [S_local, hidden], padding rows zero (as `plan.shard` pads). Every rank of the
    SP group must call it with the same batch.

    Each rank runs the vision tower at most once, on the vision units `UnitRouting` assigns it,
    and the feature rows travel to the ranks holding their placeholders
    (`comm.all_to_all_rows_autograd`, whose backward returns each row's gradient to the rank
    that encoded it). A frozen tower runs without autograd and is skipped by a rank with no
    unit. A trainable tower runs on every rank, so that a ZeRO-3 tower issues the same parameter
    collectives everywhere: a rank with no unit encodes the dummy image and sends its empty
    slice, which ties the dummy into the graph with weight zero (its backward runs too). A pack
    without images or videos issues no routing collective.
    """
    device = embed_tokens.weight.device
    real_len = plan.total_len - plan.pad_len
    n_local = min(max(real_len - plan.local_start, 0), plan.local_len)
    local_ids = batch.input_ids[plan.local_start : plan.local_start + n_local].to(device)
    embeds = F.pad(embed_tokens(local_ids), (0, 0, 0, plan.local_len - n_local))
    grad = vision_trainable and torch.is_grad_enabled()
    if not _has_vision(batch):
        if not vision_trainable:
            return embeds
        with torch.set_grad_enabled(grad):
            dummy = dummy_image_features(vision, device)
        return comm.keep_in_graph(embeds, dummy)
    config = vision.config
    try:
        units = VisionUnits.of_pack(
            batch.image_grid_thw, batch.video_grid_thw,
            (batch.input_ids == image_token_id).nonzero().squeeze(1),
            (batch.input_ids == video_token_id).nonzero().squeeze(1), config.spatial_merge_size,
            batch.image_index)
        routing = UnitRouting.build(units, plan.local_len, plan.size, plan.rank,
                                    cost_alpha(config))
    except ValueError as exc:
        raise ValueError(f"pack of samples {batch.sample_ids}: {exc}") from exc
    with torch.set_grad_enabled(grad):
        feats = _encode_share(vision, batch, units, routing, vision_trainable, embeds)
    feats = feats.index_select(0, routing.send_index.to(device))
    rows = comm.all_to_all_rows_autograd(feats, list(routing.send_counts),
                                         list(routing.recv_counts), plan.group)
    rows = rows.index_select(0, routing.recv_order.to(device))
    mask = (local_ids == image_token_id) | (local_ids == video_token_id)
    mask = F.pad(mask, (0, plan.local_len - n_local))
    return embeds.masked_scatter(mask.unsqueeze(-1), rows)


def _encode_share(
    vision: nn.Module, batch: PackedBatch, units: VisionUnits, routing: UnitRouting,
    vision_trainable: bool, embeds: torch.Tensor,
) -> torch.Tensor:
    """Features of the units this rank encodes, unit after unit: [N_send, hidden] in the dtype
    and on the device of `embeds`. A rank with no unit gets [0, hidden]: for a trainable tower
    the empty slice of the dummy image's features (which keeps the dummy in the graph), else
    zeros."""
    device = embeds.device
    if routing.units:
        sources = {IMAGE_PIXELS: batch.pixel_values, VIDEO_PIXELS: batch.pixel_values_videos}
        pixels = torch.cat([sources[kind][start:stop] for kind, start, stop in
                            (units.pixel_ranges[u] for u in routing.units)])
        grids = units.grids[list(routing.units)]
        feats = vision_features(vision, pixels.to(device), grids.to(device))
    elif vision_trainable:
        feats = dummy_image_features(vision, device)[:0]
    else:
        feats = embeds.new_zeros((0, embeds.shape[1]))
    return feats.to(embeds.dtype)
