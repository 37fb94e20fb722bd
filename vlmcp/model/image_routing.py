"""Shard-first merge plan: which SP rank encodes which image, and where each feature row goes.

Legend: P = SP size, I = distinct images in the pack, I_use = placeholder runs (image uses; a
preference pair's halves show the prompt's images twice, `PackedBatch.image_index`), S_local =
tokens per rank's shard (rank r holds pack tokens [r*S_local, (r+1)*S_local)), N_feat = image
feature rows of the whole pack's uses = image placeholder tokens of the pack (an image gives
t*h*w / merge**2 rows, merge = spatial merge size).

Use u's feature rows fill the placeholders numbered [c_u, c_u + n_u) in pack order, where c_u is
the number of rows of the uses before it (the rule transformers' masked_scatter applies). Each
distinct image is encoded once, by its owner; a row goes to the rank whose shard holds its
placeholder, so one image's rows may go to several ranks when its placeholders straddle a shard
edge or when it is shown twice.

Everything here is pure (no processes, no modules) and built once per micro-batch; every rank
computes the same owners from the same image grids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def assign_images(patch_counts: Sequence[int], size: int) -> tuple[int, ...]:
    """Owner rank of each image, balancing patches over `size` ranks: whole images, largest first,
    each to the rank with the fewest patches so far (ties: lower image index first, then the
    lower rank). Deterministic, so every rank computes the same owners."""
    if size < 1:
        raise ValueError(f"cannot assign images to {size} ranks")
    loads = [0] * size
    owners = [0] * len(patch_counts)
    for image in sorted(range(len(patch_counts)), key=lambda i: (-patch_counts[i], i)):
        owner = min(range(size), key=lambda r: (loads[r], r))
        owners[image] = owner
        loads[owner] += patch_counts[image]
    return tuple(owners)


@dataclass(frozen=True)
class ImageRouting:
    """This rank's part of the shard-first merge of one pack.

    owners:        [I] rank that encodes each distinct image.
    images:        indices of the images this rank encodes, ascending.
    patch_ranges:  (start, stop) rows of `pixel_values` of each image in `images`.
    send_counts:   [P] feature rows this rank sends to each rank, ordered by destination rank
                   (its rows in placeholder order, whose positions ascend).
    send_index:    [N_send] long, the row of this rank's encoded features (its images' rows,
                   image after image) each sent row is; None when that is every row once, in
                   order (no image of this rank is shown twice).
    recv_counts:   [P] feature rows this rank receives from each rank (its shard's placeholders).
    recv_order:    [N_recv] long tensor; received rows (ordered by source rank, then pack order)
                   indexed by `recv_order` are in this shard's placeholder order.
    """

    owners: tuple[int, ...]
    images: tuple[int, ...]
    patch_ranges: tuple[tuple[int, int], ...]
    send_counts: tuple[int, ...]
    send_index: torch.Tensor | None
    recv_counts: tuple[int, ...]
    recv_order: torch.Tensor

    @classmethod
    def build(
        cls,
        image_grid_thw: torch.Tensor,
        placeholder_positions: torch.Tensor,
        local_len: int,
        size: int,
        rank: int,
        merge_size: int,
        image_index: torch.Tensor | None = None,
    ) -> ImageRouting:
        """image_grid_thw: [I, 3] patch grid per distinct image; image_index: [I_use] the
        distinct image of each placeholder run (None: each image once, in order).
        placeholder_positions: [N_feat] ascending pack positions of the image placeholder tokens.
        local_len: S_local. Raises ValueError when the placeholders and the images' rows disagree, or
        a placeholder lies beyond the P shards.
        """
        grid = image_grid_thw.detach().to("cpu", torch.long)
        positions = placeholder_positions.detach().to("cpu", torch.long)
        patches = grid.prod(-1)
        image_of_row, within = use_rows(grid, image_index, merge_size)
        if image_of_row.numel() != positions.numel():
            raise ValueError(f"{positions.numel()} image placeholder tokens but the images give "
                             f"{image_of_row.numel()} features")
        if positions.numel() and int(positions[-1]) >= local_len * size:
            raise ValueError(f"image placeholder at position {int(positions[-1])} lies beyond the "
                             f"{size} shards of {local_len} tokens")
        owners = assign_images(patches.tolist(), size)
        owner_of_row = torch.tensor(owners, dtype=torch.long)[image_of_row]
        dest_of_row = positions // local_len
        mine = owner_of_row == rank
        send_counts = torch.bincount(dest_of_row[mine], minlength=size)
        source_of_local = owner_of_row[dest_of_row == rank]
        recv_counts = torch.bincount(source_of_local, minlength=size)
        arrival = torch.argsort(source_of_local, stable=True)
        starts = [0, *torch.cumsum(patches, 0).tolist()]
        images = tuple(i for i, owner in enumerate(owners) if owner == rank)
        rows = patches // merge_size**2
        encoded_start = torch.zeros(len(owners), dtype=torch.long)
        encoded_start[list(images)] = torch.cumsum(rows[list(images)], 0) - rows[list(images)]
        send_index = encoded_start[image_of_row[mine]] + within[mine]
        identity = torch.equal(send_index, torch.arange(send_index.numel()))
        return cls(
            owners=owners,
            images=images,
            patch_ranges=tuple((starts[i], starts[i + 1]) for i in images),
            send_counts=tuple(send_counts.tolist()),
            send_index=None if identity else send_index,
            recv_counts=tuple(recv_counts.tolist()),
            recv_order=torch.argsort(arrival),
        )


def use_rows(image_grid_thw: torch.Tensor, image_index: torch.Tensor | None, merge_size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """For every feature row of the pack's image uses, in placeholder order: (its distinct image
    [N_feat] long, its row inside that image's features [N_feat] long).

    image_grid_thw: [I, 3] distinct images; image_index: [I_use] (None: each image once)."""
    grid = image_grid_thw.detach().to("cpu", torch.long)
    rows = grid.prod(-1) // merge_size**2
    uses = torch.arange(len(rows)) if image_index is None else image_index.to("cpu", torch.long)
    use_counts = rows[uses]
    image_of_row = torch.repeat_interleave(uses, use_counts)
    starts = torch.repeat_interleave(torch.cumsum(use_counts, 0) - use_counts, use_counts)
    return image_of_row, torch.arange(image_of_row.numel()) - starts


def distinct_feature_rows(image_grid_thw: torch.Tensor, image_index: torch.Tensor,
                          merge_size: int) -> torch.Tensor:
    """[N_feat] long: the row of the distinct images' features (image after image) that each
    placeholder-order feature row of the uses is."""
    image_of_row, within = use_rows(image_grid_thw, image_index, merge_size)
    rows = image_grid_thw.detach().to("cpu", torch.long).prod(-1) // merge_size**2
    return (torch.cumsum(rows, 0) - rows)[image_of_row] + within
