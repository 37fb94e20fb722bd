"""Split vision under SP: a pack's vision units, what each costs, which rank encodes each, and
where every feature row goes.

Legend: P = SP size, U = vision units of the pack, S_local = tokens per rank's shard (rank r
holds pack tokens [r*S_local, (r+1)*S_local)), N_feat = feature rows of the pack = its image and
video placeholder tokens, merge = the spatial merge size, p = a unit's patches, I = distinct
images, I_use = image placeholder runs (a preference pair's halves show their prompt's images
twice: `PackedBatch.image_index` names the distinct image of each run).

A *vision unit* is the smallest piece the tower encodes on its own: one whole image (grid
(t, h, w)), or one temporal group of a video (grid (1, h, w): T frames the Conv3d patch embedding
fuses). The tower's attention never crosses a temporal group (its cu_seqlens are per group) and
its position embeddings are spatial, so encoding a video's groups as separate units, on separate
ranks, gives the rows transformers computes for the whole video. A unit of p patches gives
p / merge**2 feature rows.

Where rows go: the image uses' rows fill the image placeholders in pack order and the videos'
rows fill the video placeholders in pack order (transformers' two masked_scatters); so each of
unit u's rows belongs to known placeholder positions (one per use of the unit), and a row goes to
the rank whose shard holds its placeholder. Each distinct image is one unit, encoded once, also
when it is shown twice; its rows are sent to every placeholder that shows it, and the gradients
of all its uses add up on its encoding rank. One unit's rows may go to several ranks when its
placeholders straddle a shard edge or when it is shown twice.

Cost model (`unit_cost`): one vision block on p patches of width d with an MLP of width f costs
about 2p(4d^2 + 2df) multiply-adds in its projections and MLP (linear in p) and 4p^2 d in
attention (q k^T and the weighted sum over the unit's own patches: quadratic in p). Divided by
4d that is p * (p + alpha) with alpha = 2d + f (`cost_alpha`); the depth, the patch embedding
and the merger scale every unit alike or add a term linear in p that alpha's size dwarfs. For
Qwen3.5's tower (d 1152, f 4304) alpha = 6608: a unit's cost is nearly linear below a few
thousand patches and quadratic above.

Assignment (`assign_units`): longest processing time first: units by cost, largest first (ties:
lower unit index), each to the rank with the least cost so far (ties: the lower rank). A long
video's groups are equal units, so they spread over all P ranks.

Everything here is pure (no processes, no modules) and built once per micro-batch; every rank
computes the same owners from the same grids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Where a unit's pixel rows lie: in the pack's `pixel_values` or its `pixel_values_videos`.
IMAGE_PIXELS, VIDEO_PIXELS = 0, 1


def cost_alpha(vision_config: Any) -> int:
    """alpha of the cost model for a vision tower config: 2 * hidden_size + intermediate_size."""
    return 2 * int(vision_config.hidden_size) + int(vision_config.intermediate_size)


def unit_cost(patches: int, alpha: int) -> int:
    """Relative cost of encoding one unit of `patches` patches: patches * (patches + alpha)."""
    return patches * (patches + alpha)


def assign_units(costs: Sequence[int], size: int) -> tuple[int, ...]:
    """Owner rank of each unit, balancing the summed cost over `size` ranks, largest unit first
    (see the module docstring). Deterministic, so every rank computes the same owners."""
    if size < 1:
        raise ValueError(f"cannot assign vision units to {size} ranks")
    loads = [0] * size
    owners = [0] * len(costs)
    for unit in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        owner = min(range(size), key=lambda r: (loads[r], r))
        owners[unit] = owner
        loads[owner] += costs[unit]
    return tuple(owners)


def use_rows(image_grid_thw: torch.Tensor, image_index: torch.Tensor | None, merge_size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """For every feature row of the pack's image uses, in placeholder order: (its distinct image
    [N_img_feat] long, its row inside that image's features [N_img_feat] long).

    image_grid_thw: [I, 3] distinct images; image_index: [I_use] (None: each image once, in order)."""
    grid = image_grid_thw.detach().to("cpu", torch.long)
    rows = grid.prod(-1) // merge_size**2
    uses = torch.arange(len(rows)) if image_index is None else image_index.to("cpu", torch.long)
    use_counts = rows[uses]
    image_of_row = torch.repeat_interleave(uses, use_counts)
    starts = torch.repeat_interleave(torch.cumsum(use_counts, 0) - use_counts, use_counts)
    return image_of_row, torch.arange(image_of_row.numel()) - starts


def distinct_feature_rows(image_grid_thw: torch.Tensor, image_index: torch.Tensor,
                          merge_size: int) -> torch.Tensor:
    """[N_img_feat] long: the row of the distinct images' features (image after image) that each
    placeholder-order feature row of the uses is."""
    image_of_row, within = use_rows(image_grid_thw, image_index, merge_size)
    rows = image_grid_thw.detach().to("cpu", torch.long).prod(-1) // merge_size**2
    return (torch.cumsum(rows, 0) - rows)[image_of_row] + within


@dataclass(frozen=True)
class VisionUnits:
    """The vision units of one pack, the distinct images first, then every video's groups in order.

    grids:        [U, 3] (t, h, w) patch grid of each unit ((1, h, w) for a video group).
    rows:         [U] long, feature rows of each unit (its patches / merge**2).
    pixel_ranges: (IMAGE_PIXELS or VIDEO_PIXELS, start, stop) rows of the unit's patches.
    positions:    [N_feat] pack positions of the feature rows: the image uses' rows in
                  placeholder order, then the video groups' rows.
    row_unit:     [N_feat] long, the unit each of those rows is a feature row of.
    row_within:   [N_feat] long, its row inside that unit's features.
    """

    grids: torch.Tensor
    rows: torch.Tensor
    pixel_ranges: tuple[tuple[int, int, int], ...]
    positions: torch.Tensor
    row_unit: torch.Tensor
    row_within: torch.Tensor

    def __len__(self) -> int:
        return len(self.pixel_ranges)

    @property
    def patches(self) -> list[int]:
        """Patches of each unit."""
        return self.grids.prod(-1).tolist()

    @classmethod
    def of_pack(cls, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
                image_positions: torch.Tensor, video_positions: torch.Tensor, merge_size: int,
                image_index: torch.Tensor | None = None) -> VisionUnits:
        """image_grid_thw: [I, 3] distinct images; video_grid_thw: [V, 3] (groups, h, w);
        image_positions / video_positions: ascending pack positions of the image / video
        placeholder tokens; image_index: [I_use] the distinct image of each image placeholder run
        (None: each image once, in order). Raises ValueError when the placeholders and the grids'
        rows disagree."""
        images = [] if image_grid_thw is None else image_grid_thw.detach().cpu().tolist()
        videos = [] if video_grid_thw is None else video_grid_thw.detach().cpu().tolist()
        grids: list[list[int]] = []
        ranges: list[tuple[int, int, int]] = []
        start = 0
        for t, h, w in images:
            grids.append([t, h, w])
            ranges.append((IMAGE_PIXELS, start, start + t * h * w))
            start += t * h * w
        start = 0
        for groups, h, w in videos:
            for _ in range(groups):
                grids.append([1, h, w])
                ranges.append((VIDEO_PIXELS, start, start + h * w))
                start += h * w
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        if images:
            image_unit, image_within = use_rows(grid[:len(images)], image_index, merge_size)
        else:
            image_unit = image_within = torch.zeros(0, dtype=torch.long)
        group_rows = grid[len(images):].prod(-1) // merge_size**2
        video_unit = torch.repeat_interleave(torch.arange(len(images), len(grids)), group_rows)
        video_within = torch.arange(video_unit.numel()) - torch.repeat_interleave(
            torch.cumsum(group_rows, 0) - group_rows, group_rows)
        for kind, positions, kind_rows in (("image", image_positions, image_unit.numel()),
                                           ("video", video_positions, video_unit.numel())):
            if positions.numel() != kind_rows:
                raise ValueError(f"{positions.numel()} {kind} placeholder tokens but the "
                                 f"{kind}s give {kind_rows} features")
        positions = torch.cat([image_positions.detach().cpu(), video_positions.detach().cpu()])
        return cls(grid, grid.prod(-1) // merge_size**2, tuple(ranges), positions.long(),
                   torch.cat([image_unit, video_unit]), torch.cat([image_within, video_within]))


@dataclass(frozen=True)
class UnitRouting:
    """This rank's part of the shard-first merge of one pack.

    owners:      [U] rank that encodes each unit.
    units:       indices of the units this rank encodes, ascending; their rows come out of the
                 tower unit after unit (the encoded rows).
    send_index:  [N_send] long tensor: the encoded row each sent row is, in pack-position order
                 (hence grouped by destination rank in rank order); a row of a unit shown twice
                 is sent once per use.
    send_counts: [P] feature rows this rank sends to each rank.
    recv_counts: [P] feature rows this rank receives from each rank (its shard's placeholders).
    recv_order:  [N_recv] long tensor; received rows (by source rank, then position) indexed by
                 it are in this shard's placeholder order.
    """

    owners: tuple[int, ...]
    units: tuple[int, ...]
    send_index: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_order: torch.Tensor

    @classmethod
    def build(cls, units: VisionUnits, local_len: int, size: int, rank: int, alpha: int
              ) -> UnitRouting:
        """Owners by `assign_units` over `unit_cost(patches, alpha)`, and the rows' routes for
        shards of `local_len` tokens. Raises ValueError when a placeholder lies beyond the P
        shards."""
        positions = units.positions
        if positions.numel() and int(positions.max()) >= local_len * size:
            raise ValueError(f"vision placeholder at position {int(positions.max())} lies beyond "
                             f"the {size} shards of {local_len} tokens")
        owners = assign_units([unit_cost(p, alpha) for p in units.patches], size)
        owner_of_row = torch.tensor(owners, dtype=torch.long)[units.row_unit]
        dest_of_row = positions // local_len
        mine = owner_of_row == rank
        mine_units = [u for u, owner in enumerate(owners) if owner == rank]
        encoded_start = torch.zeros(len(owners), dtype=torch.long)
        if mine_units:
            counts = units.rows[mine_units]
            encoded_start[mine_units] = torch.cumsum(counts, 0) - counts
        by_position = torch.argsort(positions[mine], stable=True)
        send_index = (encoded_start[units.row_unit[mine]] + units.row_within[mine])[by_position]
        send_counts = torch.bincount(dest_of_row[mine], minlength=size)
        local = dest_of_row == rank
        local_positions = positions[local]
        arrival = torch.argsort(owner_of_row[local] * (local_len * size) + local_positions)
        recv_counts = torch.bincount(owner_of_row[local], minlength=size)
        return cls(
            owners=owners,
            units=tuple(mine_units),
            send_index=send_index,
            send_counts=tuple(send_counts.tolist()),
            recv_counts=tuple(recv_counts.tolist()),
            recv_order=torch.argsort(local_positions[arrival]),
        )
