"""Contiguous sharding of one packed sequence over an SP group, and the boundary metadata that
every sharded layer needs.

The plan is built once per batch from the *global* `seq_lens` and handed to every layer; layers
never recompute boundaries, and never infer them from positions.

Legend: S = padded packed length, P = SP size, S_local = S / P; rank r holds tokens
[r*S_local, (r+1)*S_local). Padding is appended at the end as its own segment (it never carries
loss and, being last, never influences a real token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from vlmcp.parallel.comm import ProcessGroup


@dataclass(frozen=True)
class Segment:
    """One sample's piece inside one rank's shard.

    start:     offset of the piece inside the shard (local index).
    length:    tokens in the piece.
    sample:    index of the sample in the pack (== number of samples for the padding segment).
    offset:    how many tokens of the same sample lie on earlier ranks (0: the piece starts its sample).
    """

    start: int
    length: int
    sample: int
    offset: int

    @property
    def continues(self) -> bool:
        return self.offset > 0

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ShardPlan:
    """Which rank holds which part of which sample.

    seq_lens:      global segment lengths after padding (the padding segment, if any, is last).
    num_samples:   real samples (the padding segment, if present, has index num_samples).
    size, rank:    SP size P and this rank.
    group:         the SP process group (None when P == 1).
    """

    seq_lens: tuple[int, ...]
    num_samples: int
    size: int
    rank: int
    group: ProcessGroup | None = None

    @classmethod
    def build(
        cls,
        seq_lens: list[int],
        size: int = 1,
        rank: int = 0,
        group: ProcessGroup | None = None,
        min_local_len: int = 1,
    ) -> ShardPlan:
        """Pad the pack to a multiple of P with at least `min_local_len` tokens per rank."""
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"seq_lens must be positive lengths, got {seq_lens}")
        total = sum(seq_lens)
        local = max(math.ceil(total / size), min_local_len)
        pad = local * size - total
        lens = tuple(seq_lens) + ((pad,) if pad else ())
        return cls(seq_lens=lens, num_samples=len(seq_lens), size=size, rank=rank, group=group)

    @property
    def total_len(self) -> int:
        return sum(self.seq_lens)

    @property
    def pad_len(self) -> int:
        return self.total_len - sum(self.seq_lens[: self.num_samples])

    @property
    def local_len(self) -> int:
        return self.total_len // self.size

    @property
    def local_start(self) -> int:
        return self.rank * self.local_len

    @cached_property
    def cu_seqlens(self) -> tuple[int, ...]:
        """[num_segments + 1] global segment starts, then S."""
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return tuple(out)

    def segments_of(self, rank: int) -> tuple[Segment, ...]:
        """The pieces of rank `rank`'s shard, in order."""
        lo, hi = rank * self.local_len, (rank + 1) * self.local_len
        pieces = []
        for i, (a, b) in enumerate(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                pieces.append(Segment(start=s - lo, length=e - s, sample=i, offset=s - a))
        return tuple(pieces)

    @cached_property
    def local_segments(self) -> tuple[Segment, ...]:
        return self.segments_of(self.rank)

    @cached_property
    def all_segments(self) -> tuple[tuple[Segment, ...], ...]:
        """segments_of(r) for every rank r."""
        return tuple(self.segments_of(r) for r in range(self.size))

    def shard(self, tensor: torch.Tensor, dim: int = 0, pad_value: float | int = 0) -> torch.Tensor:
        """This rank's contiguous slice of a global tensor: [..., S_unpadded, ...] -> [..., S_local, ...].

        The tensor is padded along `dim` with `pad_value` to the padded length first.
        """
        return self.pad(tensor, dim, pad_value).narrow(dim, self.local_start, self.local_len)

    def pad(self, tensor: torch.Tensor, dim: int = 0, pad_value: float | int = 0) -> torch.Tensor:
        """A global tensor padded along `dim` to S."""
        if tensor.shape[dim] == self.total_len:
            return tensor
        if tensor.shape[dim] != self.total_len - self.pad_len:
            raise ValueError(
                f"tensor has {tensor.shape[dim]} tokens along dim {dim}; the pack has "
                f"{self.total_len - self.pad_len}"
            )
        shape = list(tensor.shape)
        shape[dim] = self.pad_len
        filler = torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, filler], dim=dim)
