"""A weighted mixture of data files -> the samples one epoch draws, in order.

Weight w of a file with n samples is the per-epoch multiplier of that file's samples: each epoch
draws k = floor(w * n + 1/2) of them (w * n rounded half up): k // n whole copies of the file
(every sample, in file order) plus a remainder of k % n distinct samples chosen at random (seeded
by the run seed, the epoch and the file's index, so it changes from epoch to epoch and is the same
on every rank and on a resumed run), kept in file order. Weight 1 draws each sample once; 0.5 a
random half; 2.5 every sample twice plus a random half.

Order: without shuffle the draws of file 0 come first, then those of file 1, and so on (one file
of weight 1 is its samples in file order). With shuffle the whole draw list is permuted by
`torch.randperm` seeded by (seed, epoch), the same permutation `PackedDataset` has always used,
so a single file of weight 1 keeps the order of earlier versions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def draws_per_epoch(counts: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Samples each file contributes to an epoch: floor(w * n + 1/2) per file."""
    if len(counts) != len(weights):
        raise ValueError(f"{len(counts)} file sample counts for {len(weights)} weights")
    return [int(w * n + 0.5) for n, w in zip(counts, weights)]


def _generator(*parts: int) -> torch.Generator:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def epoch_draws(
    counts: Sequence[int], weights: Sequence[float], seed: int, epoch: int, shuffle: bool,
) -> list[tuple[int, int]]:
    """The (file index, sample index in that file) pairs epoch `epoch` trains on, in order.

    counts:  samples of each file (every count > 0).
    weights: per-epoch multiplier of each file (every weight > 0); see the module docstring.
    A pure function of its arguments: every rank computes the same list.
    """
    if any(n <= 0 for n in counts) or any(not w > 0 for w in weights):
        raise ValueError(f"every file needs samples and a weight > 0 (counts {list(counts)}, "
                         f"weights {list(weights)})")
    draws: list[tuple[int, int]] = []
    for file, (n, k) in enumerate(zip(counts, draws_per_epoch(counts, weights))):
        copies, remainder = divmod(k, n)
        draws += [(file, i) for _ in range(copies) for i in range(n)]
        if remainder:
            chosen = torch.randperm(n, generator=_generator(seed, epoch, file))[:remainder]
            draws += [(file, i) for i in sorted(chosen.tolist())]
    if not shuffle:
        return draws
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return [draws[i] for i in torch.randperm(len(draws), generator=generator).tolist()]
