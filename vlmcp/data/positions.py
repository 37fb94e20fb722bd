"""MRoPE (t, h, w) position ids of one sample, as Qwen3.5 computes them.

Text tokens advance all three rows together. A run of image placeholders gets its image's merged
grid positions (t, h, w), each offset by the position reached so far; after the image the running
position advances by max(h, w) // merge (grid h, w in patches). Same result as
`Qwen3_5Model.get_rope_index` on that sample alone, without a model.
"""

from __future__ import annotations

import torch

TEXT = 0
IMAGE = 1


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values: (value, start, end)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((types[start], start, i))
            start = i
    return runs


def mrope_positions(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
) -> torch.Tensor:
    """Position ids [3, L] of one sample.

    input_ids: [L]; mm_token_type_ids: [L], 1 on image placeholders, 0 on text;
    image_grid_thw: [I, 3] patch grids of the sample's images in placeholder order, or None.
    Each maximal run of image tokens is one image and must hold t*h*w // merge**2 tokens.
    """
    length = int(input_ids.shape[0])
    types = [int(x) for x in mm_token_type_ids.tolist()]
    if len(types) != length:
        raise ValueError(f"mm_token_type_ids has {len(types)} entries for {length} tokens")
    grids = [] if image_grid_thw is None else [[int(x) for x in row] for row in image_grid_thw]
    out = torch.empty(3, length, dtype=torch.long)
    pos = 0
    image_index = 0
    for kind, start, end in _runs(types):
        if kind == TEXT:
            out[:, start:end] = torch.arange(pos, pos + end - start)
            pos += end - start
            continue
        if kind != IMAGE:
            raise ValueError(f"mm_token_type_ids value {kind} is not supported (images only)")
        if image_index >= len(grids):
            raise ValueError(f"image run at token {start} has no image_grid_thw row")
        t, h, w = grids[image_index]
        image_index += 1
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if end - start != t * gh * gw:
            raise ValueError(
                f"image run at token {start} has {end - start} tokens, grid {[t, h, w]} needs "
                f"{t * gh * gw}"
            )
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        )
        out[:, start:end] = grid.reshape(3, -1) + pos
        pos += max(h, w) // spatial_merge_size
    if image_index != len(grids):
        raise ValueError(f"{len(grids)} image grids for {image_index} image runs")
    return out
