"""Which packed micro-batches each optimizer step runs (`StepPacks`): a pure function of the step number.

An epoch of `PackedDataset` gives every data-parallel rank the same number of micro-batches, a
multiple of `train.grad_accum`, so optimizer steps never straddle epochs. Step k of a run is
located by walking the epochs; a resumed run that starts at step k therefore sees exactly the
micro-batches an uninterrupted run would.

The micro-batches are loaded by `vlmcp.data.stream.load_packs` (DataLoader workers, prefetching
ahead in this rank's pack order). Steps asked for in order continue one loader; a step out of
order (the first step of a resumed run) starts a loader at that step's first pack. A step's
`grad_accum` packs are loaded before it runs (its counts are taken from them); a rollout step
(training/steps/rollout_steps.py) streams its packs instead, its counts taken from the length index.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vlmcp.data.batch import PackedBatch
from vlmcp.data.pack import PackedDataset, Slot
from vlmcp.data.stream import SampleReader, load_packs
from vlmcp.model.loss_terms import Loss
from vlmcp.training.objective_step import pack_counts


@dataclass
class StepBatches:
    """One optimizer step's micro-batches on this rank, as the training step runs them.

    weights:     [M] 1.0 for a micro-batch of the step, 0.0 for one that only repeats another
                 rank's pack so that every rank runs the same collectives (its loss is not
                 counted); M is the same on every rank.
    micro_batches: the step's packs of weight 1 over the world (a pack spread over an SP group
                 counts once): what the mean of per-pack quantities divides by.
    counts:      `Loss.count_keys` over the packs of weight 1 this rank owns (each pack is owned
                 by one rank: a spread pack by SP rank 0, a pack of SP degree 1 by the rank that
                 runs it), known before any is loaded (`objective_step.step_counts` sums them
                 over the world).
    sample_ids:  [M] the "file:line" of each micro-batch's samples, for error lines.
    row:         metrics row entries of the step's data ("epoch"; a rollout step's lag, ...).
    skip:        why the step trains nothing (a rollout step skipped as stale, ...), else None.
    batches:     the M micro-batches in order, each loaded when the step reaches it (at most
                 `data.prefetch_factor` per loader worker ahead) and dropped once handed out; one
                 pass. Raises what loading raises (DataError naming the sample).
    """

    weights: list[float]
    micro_batches: int
    counts: dict[str, float]
    sample_ids: list[list[str]]
    row: dict[str, Any]
    skip: str | None = None
    batches: Iterator[PackedBatch] = field(default_factory=lambda: iter(()))

    def close(self) -> None:
        """Stop loading the micro-batches not handed out yet (their loader and its workers)."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


def _handed_out(batches: list[PackedBatch]) -> Iterator[PackedBatch]:
    """`batches` in order, each dropped from the list as it is handed out."""
    while batches:
        yield batches.pop(0)


class StepPacks:
    """Optimizer step -> this rank's `grad_accum` packed micro-batches."""

    def __init__(self, dataset: PackedDataset, grad_accum: int, reader: SampleReader,
                 objective: Loss, num_workers: int = 0, prefetch_factor: int = 2):
        if dataset.multiple_of % grad_accum:
            raise ValueError("the dataset's micro-batch count must be a multiple of grad_accum")
        self.dataset = dataset
        self.grad_accum = grad_accum
        self.reader = reader
        self.objective = objective
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._steps_per_epoch: list[int] = []
        self._stream: Iterator[PackedBatch] | None = None
        self._next: tuple[int, int] | None = None
        self._last: tuple[int, StepBatches] | None = None

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps that epoch `epoch` holds."""
        while len(self._steps_per_epoch) <= epoch:
            e = len(self._steps_per_epoch)
            self._steps_per_epoch.append(self.dataset.num_micro_batches(e) // self.grad_accum)
        return self._steps_per_epoch[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step inside that epoch) of global optimizer step `step` (0-based)."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def batches(self, step: int) -> list[PackedBatch]:
        """This rank's micro-batches of optimizer step `step` (0-based), in order.

        Raises DataError when a sample of them cannot be loaded.
        """
        epoch, inner = self.locate(step)
        if self._stream is None or self._next != (epoch, inner):
            self.close()
            packs = self.dataset.rank_packs(epoch)[inner * self.grad_accum:]
            self._stream = load_packs(self.reader, packs, self.num_workers, self.prefetch_factor)
        chosen = [next(self._stream) for _ in range(self.grad_accum)]
        if self.dataset.sp_dynamic:
            for batch, slot in zip(chosen, self._slots(epoch, inner, self.dataset.dp_rank)):
                batch.sp_degree = slot.degree
        if inner + 1 == self.steps_in_epoch(epoch):
            self.close()
        else:
            self._next = (epoch, inner + 1)
        return chosen

    def step_batches(self, step: int) -> StepBatches:
        """`batches(step)` as the training step runs them (weight 0: a repeat that keeps this rank
        in step with its SP group, `vlmcp.data.pack.Slot`); asked again
        for the same step, the same `StepBatches` (its micro-batches handed out once)."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        self._last = None
        batches = self.batches(step)
        epoch, inner = self.locate(step)
        sp_rank = self.dataset.sp_rank
        mine = self._slots(epoch, inner, self.dataset.dp_rank)
        weights = [slot.pack_of(sp_rank)[1] for slot in mine]
        owned = [batch for batch, slot, weight in zip(batches, mine, weights)
                 if weight and slot.owns(sp_rank)]
        packs = sum(len(slot.packs) for dp_rank in range(self.dataset.dp_size)
                    for slot in self._slots(epoch, inner, dp_rank))
        fetched = StepBatches(weights, packs, pack_counts(self.objective, owned),
                              [batch.sample_ids for batch in batches],
                              {"epoch": epoch}, batches=_handed_out(batches))
        self._last = (step, fetched)
        return fetched

    def _slots(self, epoch: int, inner: int, dp_rank: int) -> list[Slot]:
        """The slots DP rank `dp_rank` runs in step `inner` of `epoch`."""
        first = inner * self.grad_accum
        return [self.dataset.slot_at(epoch, k, dp_rank) for k in range(first, first + self.grad_accum)]

    def close(self) -> None:
        """Stop the loader (and its workers) of the current epoch, if any."""
        if self._stream is not None:
            self._stream.close()
        self._stream, self._next = None, None
