"""Which packed micro-batches each optimizer step runs: a pure function of the step number.

An epoch of `PackedDataset` gives every data-parallel rank the same number of micro-batches, a
multiple of `train.grad_accum`, so optimizer steps never straddle epochs. Step k of a run is
located by walking the epochs; a resumed run that starts at step k therefore sees exactly the
micro-batches an uninterrupted run would.
"""

from __future__ import annotations

from vlmcp.data.batch import PackedBatch
from vlmcp.data.pack import PackedDataset, build_batch


class StepSchedule:
    """Optimizer step -> this rank's `grad_accum` packed micro-batches."""

    def __init__(self, dataset: PackedDataset, grad_accum: int):
        if dataset.multiple_of % grad_accum:
            raise ValueError("the dataset's micro-batch count must be a multiple of grad_accum")
        self.dataset = dataset
        self.grad_accum = grad_accum
        self._steps_per_epoch: list[int] = []

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
        """This rank's micro-batches of optimizer step `step` (0-based), in order."""
        epoch, inner = self.locate(step)
        packs = self.dataset.rank_packs(epoch)
        chosen = packs[inner * self.grad_accum:(inner + 1) * self.grad_accum]
        return [build_batch([self.dataset.samples[i] for i in pack]) for pack in chosen]
