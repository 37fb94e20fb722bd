"""Synthetic packs for `vlmcp bench`: random text samples with images of mixed sizes, or
preference pairs whose halves show the same prompt images (`synthetic_pairs`).

Every rank builds the same pack from the same seed, so no data moves between ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.data.formats import Sample
from vlmcp.data.pack import build_batch
from vlmcp.data.positions import mrope_positions

#: (h, w) patch grids the `--images` images cycle through: mixed sizes and aspect ratios, from 4 to
#: 192 image tokens each after the 2 x 2 merge.
IMAGE_GRIDS = [(16, 16), (32, 24), (8, 8), (24, 32), (16, 48), (8, 24), (32, 32), (12, 12)]

#: Text tokens before a sample's first image (after it, random text fills the sample).
_TEXT_BEFORE_IMAGES = 4


def image_grids(count: int) -> list[tuple[int, int, int]]:
    """(t, h, w) patch grids of `count` images of mixed sizes, the same for every run."""
    return [(1, *IMAGE_GRIDS[i % len(IMAGE_GRIDS)]) for i in range(count)]


def synthetic_pack(seq_len: int, samples: int, config: Any, images: int = 0, seed: int = 0) -> PackedBatch:
    """A pack of `samples` near-equal random samples totalling `seq_len` tokens, identical on every
    rank for the same seed. `config`: the model's (VLM) config. Image i (grids from `image_grids`)
    goes into sample i % samples, after a few text tokens, framed by vision start/end tokens, with
    random pixels. Every token whose successor is text is a target (not a sample's last)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config().vocab_size
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    base, extra = divmod(seq_len, samples)
    lens = [base + (1 if i < extra else 0) for i in range(samples)]
    grids = image_grids(images)
    per_sample: list[list[tuple[int, int, int]]] = [grids[s::samples] for s in range(samples)]
    ids, types, targets, positions = [], [], [], []
    for index, (length, sample_grids) in enumerate(zip(lens, per_sample)):
        sample = torch.randint(8, vocab, (length,), generator=generator)
        kind = torch.zeros(length, dtype=torch.long)
        at = _TEXT_BEFORE_IMAGES
        for t, h, w in sample_grids:
            n = t * h * w // merge**2
            if at + n + 3 > length:
                raise ValueError(f"--images {images} do not fit into sample {index} of {length} tokens "
                                 f"(--seq-lens {seq_len}, --samples-per-pack {samples}); use longer packs")
            sample[at] = config.vision_start_token_id
            sample[at + 1 : at + 1 + n] = config.image_token_id
            kind[at + 1 : at + 1 + n] = 1
            sample[at + 1 + n] = config.vision_end_token_id
            at += n + 2
        grid_rows = torch.tensor(sample_grids, dtype=torch.long).reshape(-1, 3) if sample_grids else None
        target = torch.cat([sample[1:], torch.tensor([IGNORE_INDEX])])
        target[torch.cat([kind[1:], torch.zeros(1, dtype=torch.long)]) == 1] = IGNORE_INDEX
        ids.append(sample)
        types.append(kind)
        targets.append(target)
        positions.append(mrope_positions(sample, kind, grid_rows, merge))
    pixel_values = image_grid_thw = None
    if grids:
        image_grid_thw = torch.tensor([g for sample_grids in per_sample for g in sample_grids])
        patches = int(image_grid_thw.prod(dim=1).sum())
        pixel_values = torch.randn(patches, patch_dim, generator=generator)
    return PackedBatch(input_ids=torch.cat(ids), targets=torch.cat(targets),
                       position_ids=torch.cat(positions, dim=1), mm_token_type_ids=torch.cat(types),
                       seq_lens=lens, pixel_values=pixel_values, image_grid_thw=image_grid_thw)


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
