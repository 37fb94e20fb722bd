"""Shard-first merge plan: which SP rank encodes which image, and where each feature row goes.

Legend: P = SP size, I = images in the pack, S_local = tokens per rank's shard (rank r holds pack
tokens [r*S_local, (r+1)*S_local)), N_feat = image feature rows of the whole pack = image
placeholder tokens of the pack (image i gives t*h*w / merge**2 rows, merge = spatial merge size).

Image i's feature rows fill the placeholders numbered [c_i, c_i + n_i) in pack order, where c_i is
the number of rows of the images before it (the rule transformers' masked_scatter applies). A
row goes to the rank whose shard holds its placeholder, so one image's rows may go to several
ranks when its placeholders straddle a shard edge.

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

    owners:        [I] rank that encodes each image.
    images:        indices of the images this rank encodes, ascending.
    patch_ranges:  (start, stop) rows of `pixel_values` of each image in `images`.
    send_counts:   [P] feature rows this rank sends to each rank. Its encoded rows, image after
                   image, are in pack order, so the rows for each rank are contiguous and ordered
                   by destination rank.
    recv_counts:   [P] feature rows this rank receives from each rank (its shard's placeholders).
    recv_order:    [N_recv] long tensor; received rows (ordered by source rank, then pack order)
                   indexed by `recv_order` are in this shard's placeholder order.
    """

    owners: tuple[int, ...]
    images: tuple[int, ...]
    patch_ranges: tuple[tuple[int, int], ...]
    send_counts: tuple[int, ...]
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
    ) -> ImageRouting:
        """image_grid_thw: [I, 3] patch grid per image, in placeholder order.
        placeholder_positions: [N_feat] ascending pack positions of the image placeholder tokens.
        local_len: S_local. Raises ValueError when the placeholders and the images' rows disagree, or
        a placeholder lies beyond the P shards.
        """
        grid = image_grid_thw.detach().to("cpu", torch.long)
        positions = placeholder_positions.detach().to("cpu", torch.long)
        patches = grid.prod(-1)
        rows = patches // merge_size**2
        if int(rows.sum()) != positions.numel():
            raise ValueError(f"{positions.numel()} image placeholder tokens but the images give "
                             f"{int(rows.sum())} features")
        if positions.numel() and int(positions[-1]) >= local_len * size:
            raise ValueError(f"image placeholder at position {int(positions[-1])} lies beyond the "
                             f"{size} shards of {local_len} tokens")
        owners = assign_images(patches.tolist(), size)
        image_of_row = torch.repeat_interleave(torch.arange(len(owners)), rows)
        owner_of_row = torch.tensor(owners, dtype=torch.long)[image_of_row]
        dest_of_row = positions // local_len
        send_counts = torch.bincount(dest_of_row[owner_of_row == rank], minlength=size)
        source_of_local = owner_of_row[dest_of_row == rank]
        recv_counts = torch.bincount(source_of_local, minlength=size)
        arrival = torch.argsort(source_of_local, stable=True)
        starts = [0, *torch.cumsum(patches, 0).tolist()]
        images = tuple(i for i, owner in enumerate(owners) if owner == rank)
        return cls(
            owners=owners,
            images=images,
            patch_ranges=tuple((starts[i], starts[i + 1]) for i in images),
            send_counts=tuple(send_counts.tolist()),
            recv_counts=tuple(recv_counts.tolist()),
            recv_order=torch.argsort(arrival),
        )
