"""Synthetic packs for `vlmcp bench`: random text samples with images of mixed sizes and videos,
or preference pairs whose halves show the same prompt images (`synthetic_pairs`), and MoE routes
for a pack: random (`synthetic_routes`) or the model's own (`recorded_routes`).

Every rank builds the same pack from the same seed, so no data moves between ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.data.formats import Sample
from vlmcp.data.pack import build_batch
from vlmcp.data.positions import IMAGE, VIDEO, mrope_positions
from vlmcp.data.routes import route_spec
from vlmcp.parallel import comm

if TYPE_CHECKING:
    from vlmcp.model.packed import PackedVLM

#: (h, w) patch grids the `--images` images cycle through: mixed sizes and aspect ratios, from 4 to
#: 192 image tokens each after the 2 x 2 merge.
IMAGE_GRIDS = [(16, 16), (32, 24), (8, 8), (24, 32), (16, 48), (8, 24), (32, 32), (12, 12)]

#: Text tokens before a sample's first image (after it, random text fills the sample).
_TEXT_BEFORE_IMAGES = 4
#: Text tokens standing for a video temporal group's timestamp ("<12.5 seconds>").
_TIMESTAMP_TOKENS = 6

def image_grids(count: int) -> list[tuple[int, int, int]]:
    """(t, h, w) patch grids of `count` images of mixed sizes, the same for every run."""
    return [(1, *IMAGE_GRIDS[i % len(IMAGE_GRIDS)]) for i in range(count)]


def video_grids(count: int, frames: int, group_hw: tuple[int, int]) -> list[tuple[int, int, int]]:
    """(groups, h, w) patch grids of `count` videos of `frames` frames each (a temporal group is
    two frames; an odd count is padded as the processor pads it)."""
    return [(-(-frames // 2), *group_hw)] * count


def _place(sample: torch.Tensor, kind: torch.Tensor, at: int, n: int, pad: int, kind_id: int,
           config: Any, what: str) -> int:
    """Write `<vision_start> n * pad <vision_end>` at `at`; the position after it."""
    if at + n + 3 > len(sample):
        raise ValueError(f"{what} do not fit into a sample of {len(sample)} tokens; use longer "
                         "packs (--seq-lens) or fewer samples per pack")
    sample[at] = config.vision_start_token_id
    sample[at + 1 : at + 1 + n] = pad
    kind[at + 1 : at + 1 + n] = kind_id
    sample[at + 1 + n] = config.vision_end_token_id
    return at + n + 2


def synthetic_pack(seq_len: int, samples: int, config: Any, images: int = 0, seed: int = 0,
                   videos: int = 0, frames: int = 0, video_group_hw: tuple[int, int] = (16, 16)
                   ) -> PackedBatch:
    """A pack of `samples` near-equal random samples totalling `seq_len` tokens, identical on every
    rank for the same seed. `config`: the model's (VLM) config. Image i (grids from `image_grids`)
    goes into sample i % samples, after a few text tokens, framed by vision start/end tokens, with
    random pixels; then video i (`frames` frames of `video_group_hw` patches) into sample
    i % samples, each temporal group a few timestamp text tokens and its framed placeholders.
    Every token whose successor is text is a target (not a sample's last)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config().vocab_size
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    base, extra = divmod(seq_len, samples)
    lens = [base + (1 if i < extra else 0) for i in range(samples)]
    grids = image_grids(images)
    clips = video_grids(videos, frames, video_group_hw)
    per_sample = [grids[s::samples] for s in range(samples)]
    clips_per_sample = [clips[s::samples] for s in range(samples)]
    ids, types, targets, positions = [], [], [], []
    for length, sample_grids, sample_clips in zip(lens, per_sample, clips_per_sample):
        sample = torch.randint(8, vocab, (length,), generator=generator)
        kind = torch.zeros(length, dtype=torch.long)
        at = _TEXT_BEFORE_IMAGES
        for t, h, w in sample_grids:
            at = _place(sample, kind, at, t * h * w // merge**2, config.image_token_id, IMAGE,
                        config, f"--images {images}")
        for groups, h, w in sample_clips:
            for _ in range(groups):
                at = _place(sample, kind, at + _TIMESTAMP_TOKENS, h * w // merge**2,
                            config.video_token_id, VIDEO, config,
                            f"--videos {videos} of --frames {frames}")
        grid_rows = torch.tensor(sample_grids, dtype=torch.long).reshape(-1, 3) if sample_grids else None
        clip_rows = torch.tensor(sample_clips, dtype=torch.long).reshape(-1, 3) if sample_clips else None
        target = torch.cat([sample[1:], torch.tensor([IGNORE_INDEX])])
        target[torch.cat([kind[1:], torch.zeros(1, dtype=torch.long)]) != 0] = IGNORE_INDEX
        ids.append(sample)
        types.append(kind)
        targets.append(target)
        positions.append(mrope_positions(sample, kind, grid_rows, merge, clip_rows))
    pixel_values = image_grid_thw = pixel_values_videos = video_grid_thw = None
    if grids:
        image_grid_thw = torch.tensor([g for sample_grids in per_sample for g in sample_grids])
        patches = int(image_grid_thw.prod(dim=1).sum())
        pixel_values = torch.randn(patches, patch_dim, generator=generator)
    if clips:
        video_grid_thw = torch.tensor([c for sample_clips in clips_per_sample for c in sample_clips])
        patches = int(video_grid_thw.prod(dim=1).sum())
        pixel_values_videos = torch.randn(patches, patch_dim, generator=generator)
    return PackedBatch(input_ids=torch.cat(ids), targets=torch.cat(targets),
                       position_ids=torch.cat(positions, dim=1), mm_token_type_ids=torch.cat(types),
                       seq_lens=lens, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                       pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)


def synthetic_pairs(seq_len: int, pairs: int, config: Any, images: int, shared: bool = True,
                    seed: int = 0) -> PackedBatch:
    """A pack of `pairs` preference pairs totalling about `seq_len` tokens: each pair's halves
    share a random prompt that shows its images (image i, grids from `image_grids`, in pair
    i % pairs) and end in different random completions (the targets).

    shared: the halves are marked as a pair (`vlmcp.data.pack.build_batch`), so the pack holds
    and the model encodes each image once, as vlmcp trains pairs; else they are two unrelated
    samples, each with its own copy of the images (a collator that encodes every half's images).
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config().vocab_size
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grids = image_grids(images)
    half = seq_len // (2 * pairs)
    samples = []
    for index in range(pairs):
        pair_grids = grids[index::pairs]
        prompt = [int(t) for t in torch.randint(8, vocab, (_TEXT_BEFORE_IMAGES,), generator=generator)]
        for t, h, w in pair_grids:
            prompt += [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // merge**2)
            prompt.append(config.vision_end_token_id)
        if len(prompt) + 2 > half:
            raise ValueError(f"--images {images} do not fit into pair {index} of {half} tokens a "
                             f"half (--seq-lens {seq_len}, --samples-per-pack {2 * pairs}); use "
                             "longer packs")
        grid = torch.tensor(pair_grids, dtype=torch.long) if pair_grids else None
        pixels = (torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=generator)
                  if pair_grids else None)
        for role in ("chosen", "rejected"):
            completion = torch.randint(8, vocab, (half - len(prompt),), generator=generator).tolist()
            ids = torch.tensor(prompt + completion)
            kind = (ids == config.image_token_id).long()
            samples.append(Sample(
                input_ids=ids.tolist(), labels=[IGNORE_INDEX] * len(prompt) + completion,
                image_paths=[], pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kind,
                position_ids=mrope_positions(ids, kind, grid, merge), source=f"pair{index}",
                pair=role if shared else None))
    return build_batch(samples)


def synthetic_routes(tokens: int, text_config: Any, seed: int = 0) -> torch.Tensor:
    """Host routes [tokens, L_moe, K] of a MoE text config: K distinct random experts for every
    (token, layer), the same on every rank."""
    spec = route_spec(text_config.to_dict())
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, spec.layers, spec.num_experts, generator=generator)
    return scores.argsort(dim=-1)[..., :spec.top_k].to(spec.dtype)


def recorded_routes(module: PackedVLM, batch: PackedBatch) -> torch.Tensor:
    """Host routes [S, L_moe, K] of `batch`: the experts `module` (a MoE model) selects on
    its own, recorded in one scoring pass (as `vlmcp score --routes` records them for R2) and
    gathered over the SP group, the same on every rank of it (each rank of the group calls this)."""
    spec = route_spec(module.hf_model.config.get_text_config().to_dict())
    _, _, local = module.token_scores(batch, routes=True)
    shards = comm.all_gather_autograd(local, module.sp.group)
    return shards.flatten(0, 1)[:batch.num_tokens].cpu().to(spec.dtype)
