"""MRoPE (t, h, w) position ids of one sample, as Qwen3.5 computes them.

Text tokens advance all three rows together. A run of image placeholders gets its image's merged
grid positions (t, h, w), each offset by the position reached so far; after the image the running
position advances by max(h, w) // merge (grid h, w in patches). A video counts as one image of
grid (1, h, w) per temporal group, each group being its own run of video placeholders (the
timestamp text between groups advances the position as text does), so its temporal axis is the
group's start position, not time. Same result as `Qwen3_5Model.get_rope_index` on that sample
alone, without a model.
"""

from __future__ import annotations

import torch

TEXT = 0
IMAGE = 1
VIDEO = 2


def _runs(types: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values: (value, start, end)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            runs.append((types[start], start, i))
            start = i
    return runs


def _grids(grid_thw: torch.Tensor | None, split_temporal: bool) -> list[list[int]]:
    """Grid rows as lists; with `split_temporal` a (t, h, w) row becomes t rows (1, h, w)."""
    rows = [] if grid_thw is None else [[int(x) for x in row] for row in grid_thw]
    if split_temporal:
        rows = [[1, h, w] for t, h, w in rows for _ in range(t)]
    return rows


def mrope_positions(
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    spatial_merge_size: int,
    video_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids [3, L] of one sample.

    input_ids: [L]; mm_token_type_ids: [L], 1 on image placeholders, 2 on video placeholders,
    0 on text; image_grid_thw: [I, 3] patch grids of the sample's images in placeholder order,
    or None; video_grid_thw: [V, 3] (groups, h, w) of its videos, or None. Each maximal run of
    image tokens is one image and must hold t*h*w // merge**2 tokens; each maximal run of video
    tokens is one temporal group and must hold h*w // merge**2.
    """
    length = int(input_ids.shape[0])
    types = [int(x) for x in mm_token_type_ids.tolist()]
    if len(types) != length:
        raise ValueError(f"mm_token_type_ids has {len(types)} entries for {length} tokens")
    grids = {IMAGE: _grids(image_grid_thw, False), VIDEO: _grids(video_grid_thw, True)}
    used = {IMAGE: 0, VIDEO: 0}
    names = {IMAGE: ("image", "image_grid_thw row"),
             VIDEO: ("video temporal group", "video_grid_thw group")}
    out = torch.empty(3, length, dtype=torch.long)
    pos = 0
    for kind, start, end in _runs(types):
        if kind == TEXT:
            out[:, start:end] = torch.arange(pos, pos + end - start)
            pos += end - start
            continue
        if kind not in grids:
            raise ValueError(f"mm_token_type_ids value {kind} is not supported (0 text, 1 image, "
                             "2 video)")
        what, row = names[kind]
        if used[kind] >= len(grids[kind]):
            raise ValueError(f"{what} run at token {start} has no {row}")
        t, h, w = grids[kind][used[kind]]
        used[kind] += 1
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if end - start != t * gh * gw:
            raise ValueError(
                f"{what} run at token {start} has {end - start} tokens, grid {[t, h, w]} needs "
                f"{t * gh * gw}"
            )
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        )
        out[:, start:end] = grid.reshape(3, -1) + pos
        pos += max(h, w) // spatial_merge_size
    for kind, (what, row) in names.items():
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {row}s for {used[kind]} {what} runs")
    return out
