"""Samples -> packed micro-batches, and each data-parallel rank's share of them.

Packing is first-fit in sample order: each sample goes into the first pack (in creation order)
with room left, else opens a new pack; samples keep their order inside a pack and packs are
emitted in creation order. Every pack holds at most max_seq_len tokens and only whole samples.

Distribution over data parallelism: an epoch's micro-batch slots P_0..P_{n-1} (each pack spread
over the SP group, or with `sp_dynamic` the degree plan below) are dealt
round-robin, step s of DP rank r getting P_{(s * dp_size + r) mod n}. Every rank runs ceil(n / dp_size) steps (rounded up
to a multiple of `multiple_of`, e.g. the gradient-accumulation steps), so when n does not divide
evenly the last steps wrap around to the first packs of the same epoch. With shuffle, the sample
order of epoch e is a permutation seeded by (seed, e), identical on every rank, so every rank
computes the same packs and step count; the pack count (and so the step count) can differ between
epochs, see `PackedDataset.num_micro_batches`. A mixture of files draws each file's samples by its
weight every epoch (`vlmcp.data.mixture`), in file order or, with shuffle, in that permutation.

A degree per micro-batch (`parallel.sp_dynamic`): which packs run spread over the SP group and
which run whole, one pack per rank.

P = `parallel.sp_size`, L = `data.max_seq_len`, B = ceil(L / P): the tokens one rank holds of a
pack of L spread over P ranks, the per-rank budget of docs/memory.md. A micro-batch slot of an SP
group is either one pack over the P ranks (degree P; rank r holds its r-th shard), or up to P
packs of at most B tokens each, whole on one rank (degree 1; rank r runs packs[r], a rank past the
slot's last pack repeats packs[0] at weight 0). So a degree-1 pack never holds more tokens than a
rank holds of a degree-P pack of L.

Samples longer than B are packed first-fit into packs of at most L (degree P), the others
first-fit into packs of at most B, grouped P at a time in creation order (degree 1). Slots are
ordered by their first sample's place in the packing order, so long and short work interleave
as the samples do. The plan is a pure function of the lengths in order: every rank computes the
same slots, and a resumed run the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmcp.data.batch import ARRAY_FILL, IGNORE_INDEX, PackedBatch
from vlmcp.data.formats import Sample
from vlmcp.data.mixture import epoch_draws
from vlmcp.data.routes import pack_routes


class _FirstFit:
    """Leftmost bin with enough room, in O(log n): a max segment tree over remaining capacity.

    Leaves are n bins, all starting with `capacity`; unopened bins are the full leaves after the
    opened ones, so the leftmost fitting leaf is the first-fit choice.
    """

    def __init__(self, n: int, capacity: int) -> None:
        self.size = 1 << max(0, math.ceil(math.log2(max(n, 1))))
        self.tree = [capacity] * (2 * self.size)

    def place(self, need: int) -> int:
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        self.tree[node] -= need
        bin_index = node - self.size
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return bin_index


def first_fit(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Indices of `lengths` grouped into packs of at most max_seq_len tokens, first-fit."""
    too_long = [i for i, n in enumerate(lengths) if n > max_seq_len]
    if too_long:
        raise ValueError(f"samples {too_long[:5]} are longer than max_seq_len {max_seq_len}")
    fit = _FirstFit(len(lengths), max_seq_len)
    packs: list[list[int]] = []
    for i, n in enumerate(lengths):
        b = fit.place(n)
        if b == len(packs):
            packs.append([])
        packs[b].append(i)
    return packs


@dataclass(frozen=True)
class Slot:
    """One micro-batch of an SP group, as sample indices.

    packs:  the slot's packs: one (degree None, spread over the group), or 1..P (degree 1).
    degree: None: packs[0] spread over the SP group's P ranks; 1: packs[r] whole on SP rank r.
    """

    packs: tuple[tuple[int, ...], ...]
    degree: int | None = None

    def pack_of(self, sp_rank: int) -> tuple[list[int], float]:
        """(the pack SP rank `sp_rank` runs, its weight): 0.0 for a repeat of packs[0] that only
        keeps the rank in step with the others (a degree-1 slot with fewer packs than ranks)."""
        if self.degree is None:
            return list(self.packs[0]), 1.0
        if sp_rank < len(self.packs):
            return list(self.packs[sp_rank]), 1.0
        return list(self.packs[0]), 0.0

    def owns(self, sp_rank: int) -> bool:
        """Whether SP rank `sp_rank` counts its pack (tokens, targets, ...) for the step: each
        pack once, from the rank that holds its first token."""
        return sp_rank == 0 or (self.degree == 1 and sp_rank < len(self.packs))


def rank_budget(max_seq_len: int, sp_size: int) -> int:
    """B = ceil(L / P): the most tokens of a degree-1 pack."""
    return math.ceil(max_seq_len / sp_size)


def fixed_slots(packs: Sequence[Sequence[int]]) -> list[Slot]:
    """Every pack spread over the SP group (the fixed degree)."""
    return [Slot((tuple(pack),)) for pack in packs]


def dynamic_slots(lengths: Sequence[int], max_seq_len: int, sp_size: int) -> list[Slot]:
    """The slots of samples of `lengths` (in packing order; indices into it), as the module
    docstring describes."""
    budget = rank_budget(max_seq_len, sp_size)
    long = [i for i, n in enumerate(lengths) if n > budget]
    short = [i for i, n in enumerate(lengths) if n <= budget]
    keyed = [(long[pack[0]], Slot((tuple(long[j] for j in pack),)))
             for pack in first_fit([lengths[i] for i in long], max_seq_len)]
    packs = [tuple(short[j] for j in pack) for pack in first_fit([lengths[i] for i in short], budget)]
    keyed += [(packs[k][0], Slot(tuple(packs[k:k + sp_size]), degree=1))
              for k in range(0, len(packs), sp_size)]
    return [slot for _, slot in sorted(keyed, key=lambda item: item[0])]


def plan_slots(lengths: Sequence[int], max_seq_len: int, sp_size: int, dynamic: bool) -> list[Slot]:
    """The micro-batch slots of samples of `lengths` (in packing order; indices into it): the
    degree plan (`dynamic_slots`) when `dynamic` (`parallel.sp_dynamic`) and the SP group has two
    ranks or more, else every first-fit pack spread over the group."""
    if dynamic and sp_size > 1:
        return dynamic_slots(lengths, max_seq_len, sp_size)
    return fixed_slots(first_fit(lengths, max_seq_len))


def shifted_targets(labels: Sequence[int]) -> list[int]:
    """Targets of one sample: targets[t] = labels[t + 1], IGNORE_INDEX at the last token."""
    return list(labels[1:]) + [IGNORE_INDEX]


def shifted_array(values: torch.Tensor) -> torch.Tensor:
    """A per-token array aligned with labels, shifted like `shifted_targets` (0 at the last)."""
    return torch.cat([values[1:], values.new_zeros(1)])


def _token_array(sample: Sample, name: str) -> torch.Tensor:
    """The sample's per-token array `name` ([L] fp32), or `ARRAY_FILL[name]` everywhere."""
    if name in sample.token_arrays:
        return sample.token_arrays[name]
    return torch.full((len(sample),), ARRAY_FILL[name], dtype=torch.float32)


def build_batch(samples: Sequence[Sample]) -> PackedBatch:
    """Concatenate whole samples into one `PackedBatch` (S = sum of lengths).

    pixel_values and image_grid_thw hold each distinct image once, in sample order: the rejected
    half of a preference pair shows its chosen half's images (their shared prompt's), and
    `image_index` points its placeholder runs at those. Both halves of every pair must be in
    `samples` (`PackedBatch.pairs`). pixel_values_videos and video_grid_thw are concatenated in
    sample order, which is placeholder order. Per-token arrays and per-sample values are kept when
    every sample carries them (arrays of `ARRAY_FILL` when any sample does, filled in for the
    others), the arrays shifted like the targets. Routes are concatenated unshifted (a sample
    without routes gets NO_ROUTE rows: native routing), when any sample has them.
    """
    shared = set.intersection(*(set(s.token_arrays) for s in samples)) if samples else set()
    shared |= {name for s in samples for name in s.token_arrays if name in ARRAY_FILL}
    valued = set.intersection(*(set(s.values) for s in samples)) if samples else set()
    pairs: list[tuple[int, int]] = []
    open_pairs: dict[str, int] = {}
    shown: list[list[int]] = []
    pixels, grids = [], []
    for i, s in enumerate(samples):
        count = 0 if s.image_grid_thw is None else len(s.image_grid_thw)
        if s.pair == "rejected":
            if s.source not in open_pairs:
                raise ValueError(f"{s.source}: the rejected half of a pair is packed without "
                                 "its chosen half")
            chosen = open_pairs.pop(s.source)
            if count != len(shown[chosen]) or (count and not torch.equal(
                    s.image_grid_thw, samples[chosen].image_grid_thw)):
                raise ValueError(f"{s.source}: the halves of a pair show different images")
            pairs.append((chosen, i))
            shown.append(shown[chosen])
            continue
        if s.pair == "chosen":
            open_pairs[s.source] = i
        first = sum(len(g) for g in grids)
        shown.append(list(range(first, first + count)))
        if count:
            pixels.append(s.pixel_values)
            grids.append(s.image_grid_thw)
    if open_pairs:
        raise ValueError(f"{next(iter(open_pairs))}: the chosen half of a pair is packed without "
                         "its rejected half")
    uses = [j for images in shown for j in images]
    distinct = sum(len(g) for g in grids)
    with_videos = [s for s in samples if s.video_grid_thw is not None]
    return PackedBatch(
        input_ids=torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long),
        targets=torch.tensor([t for s in samples for t in shifted_targets(s.labels)],
                             dtype=torch.long),
        position_ids=torch.cat([s.position_ids for s in samples], dim=1),
        mm_token_type_ids=torch.cat([s.mm_token_type_ids for s in samples]),
        seq_lens=[len(s) for s in samples],
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        image_index=None if uses == list(range(distinct)) else torch.tensor(uses),
        sample_ids=[s.source for s in samples],
        token_arrays={name: torch.cat([shifted_array(_token_array(s, name)) for s in samples])
                      for name in sorted(shared)},
        pairs=pairs,
        sample_values={name: torch.tensor([s.values[name] for s in samples], dtype=torch.float64)
                       for name in sorted(valued)},
        pixel_values_videos=torch.cat([s.pixel_values_videos for s in with_videos])
        if with_videos else None,
        video_grid_thw=torch.cat([s.video_grid_thw for s in with_videos]) if with_videos else None,
        routes=pack_routes([s.routes for s in samples], [len(s) for s in samples]),
    )


def pack_samples(samples: Sequence[Sample], max_seq_len: int) -> list[PackedBatch]:
    """First-fit pack samples, in the given order, into batches of at most max_seq_len tokens."""
    return [build_batch([samples[i] for i in pack])
            for pack in first_fit([len(s) for s in samples], max_seq_len)]


class PackedDataset:
    """The packing plan of one data-parallel rank, epoch by epoch (see the module docstring).

    Works from sample lengths alone (the length index); only sample indices are kept per epoch.
    Loading the packs' samples is `vlmcp.data.stream`'s job. lengths holds the files of a mixture
    concatenated in file order: file_sizes[f] samples of file f, drawn weights[f] times per epoch
    (`vlmcp.data.mixture`; default one file, weight 1). sp_size and sp_rank place the rank in
    its SP group: with `sp_dynamic` (and sp_size > 1) its micro-batches follow the degree plan
    of the module docstring, and `rank_packs` gives this SP rank's pack of each slot.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        multiple_of: int = 1,
        file_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        sp_size: int = 1,
        sp_rank: int = 0,
        sp_dynamic: bool = False,
    ) -> None:
        if not len(lengths):
            raise ValueError("no samples to pack")
        self.file_sizes = list(file_sizes) if file_sizes is not None else [len(lengths)]
        self.weights = list(weights) if weights is not None else [1.0] * len(self.file_sizes)
        if sum(self.file_sizes) != len(lengths) or len(self.weights) != len(self.file_sizes):
            raise ValueError(f"file sizes {self.file_sizes} and weights {self.weights} do not "
                             f"describe {len(lengths)} samples")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.lengths = [int(n) for n in lengths]
        self.max_seq_len = max_seq_len
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.seed = seed
        self.multiple_of = multiple_of
        if not 0 <= sp_rank < sp_size:
            raise ValueError(f"sp_rank {sp_rank} outside [0, {sp_size})")
        self.sp_size = sp_size
        self.sp_rank = sp_rank
        self.sp_dynamic = sp_dynamic and sp_size > 1
        self._plan: tuple[int, list[list[int]]] | None = None
        self._slots: tuple[int, list[Slot]] | None = None

    def order(self, epoch: int) -> list[int]:
        """Sample indices in the order they are packed in `epoch` (`vlmcp.data.mixture`)."""
        offsets = [sum(self.file_sizes[:f]) for f in range(len(self.file_sizes))]
        return [offsets[f] + i for f, i in epoch_draws(self.file_sizes, self.weights, self.seed,
                                                       epoch, self.shuffle)]

    def packs(self, epoch: int) -> list[list[int]]:
        """Every pack of `epoch` (all ranks), as sample indices."""
        if self._plan is None or self._plan[0] != epoch:
            order = self.order(epoch)
            packs = first_fit([self.lengths[i] for i in order], self.max_seq_len)
            self._plan = (epoch, [[order[i] for i in pack] for pack in packs])
        return self._plan[1]

    def slots(self, epoch: int) -> list[Slot]:
        """Every micro-batch slot of `epoch` (all DP groups): each pack of `packs` spread over the
        SP group, or with `sp_dynamic` the degree plan below."""
        if self._slots is None or self._slots[0] != epoch:
            if self.sp_dynamic:
                order = self.order(epoch)
                slots = [Slot(tuple(tuple(order[i] for i in pack) for pack in slot.packs), slot.degree)
                         for slot in dynamic_slots([self.lengths[i] for i in order],
                                                   self.max_seq_len, self.sp_size)]
            else:
                slots = fixed_slots(self.packs(epoch))
            self._slots = (epoch, slots)
        return self._slots[1]

    def num_micro_batches(self, epoch: int = 0) -> int:
        """Micro-batches every rank runs in `epoch` (the same on all ranks)."""
        steps = math.ceil(len(self.slots(epoch)) / self.dp_size)
        return math.ceil(steps / self.multiple_of) * self.multiple_of

    def slot_at(self, epoch: int, step: int, dp_rank: int) -> Slot:
        """The slot DP rank `dp_rank` runs at micro-batch `step` of `epoch`, wrapping around."""
        slots = self.slots(epoch)
        return slots[(step * self.dp_size + dp_rank) % len(slots)]

    def rank_slots(self, epoch: int) -> list[Slot]:
        """This rank's slots of `epoch`, in step order, wrapping around when short."""
        return [self.slot_at(epoch, step, self.dp_rank) for step in range(self.num_micro_batches(epoch))]

    def rank_packs(self, epoch: int) -> list[list[int]]:
        """This rank's packs of `epoch`, in step order (its pack of each of `rank_slots`)."""
        return [slot.pack_of(self.sp_rank)[0] for slot in self.rank_slots(epoch)]
