"""Optimizer step N from rollout step N (`rollouts.dir`): wait for it, index it, pack it, load it.

The layout and the completion rule are `vlmcp.data.rollouts`'s. Per optimizer step N, every rank:

1. waits (`RolloutSteps.wait`, outside the watchdog): each rank looks for step_N/STABLE, then
   the ranks agree (one all-reduce of three numbers: whether a rank does not see it yet, the stop
   signal a rank received, the longest wait) and sleep `rollouts.poll_s` before the next look.
   No rank sits in a collective while it waits, and none spins. The step arrives when every rank
   sees it; a stop signal ends the wait (the loop checkpoints and exits 128 + N); so does
   `rollouts.timeout_s` (the loop checkpoints and raises RolloutError). Rank 0 logs the wait.
2. indexes it (`step_batches`, inside the step's watch), on global rank 0 only: meta.json, the
   policy lag against `rollouts.max_staleness`, and the length index of the step's data files
   (each record's text and its images' headers, no pixels; `vlmcp.data.index`; a preference
   pair is one row, so packing keeps its halves together) with the per-token arrays the loss
   needs. A sample that cannot train (`objective_step.untrainable`: an array missing, a pair
   under a token objective or a single sample under a preference one, a pair without its
   reference sums) is one error line naming its step_N/file:line (`rollouts.on_bad_sample`
   "error") or is dropped and counted ("skip"); so is a record that fails with any other
   exception. A policy_step ahead of the step (a negative lag: a producer bug, or another run's
   directory) is an error naming meta.json. Whatever else goes wrong on rank 0 while it indexes
   (any exception) is one error line naming the step directory. The outcome (the index: a dozen
   integers per sample) goes to every rank in one broadcast, and every rank raises RolloutError
   together when it says so.
3. packs it, the same on every rank: first-fit in the step's sample order into
   `data.max_seq_len` packs, dealt round-robin over the DP groups (pack k*dp_size + r to DP rank
   r). Every rank runs M = ceil(packs / dp_size) micro-batches; a DP rank short of packs repeats
   one with weight 0, so that all ranks run the same collectives. The step's gradient is the sum
   over exactly the step's samples, normalised by their global count (token or sequence), however
   many micro-batches that takes: the loop marks the accumulation boundary itself. With
   `parallel.sp_dynamic` the slots of `vlmcp.data.pack`'s degree plan are dealt instead (short
   packs whole, one per SP rank; a slot short of packs repeats one at weight 0).
4. streams only this rank's packs (`vlmcp.data.stream`: records read back from their byte spans,
   images decoded, in DataLoader workers): each is loaded when the step reaches it, at most
   `data.prefetch_factor` per worker ahead, and dropped after its backward, so a rank holds a
   bounded number of packs whatever the step's size. The step's counts (targets, samples, pairs,
   weighted targets, inference-logprob targets: the normalisers) and its samples' names come
   from the index before any pack loads (`objective_step.index_counts`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.data.batch import PackedBatch
from vlmcp.data.index import LengthIndex, build_index
from vlmcp.data.pack import plan_slots
from vlmcp.data.policy_versions import StepVersions, step_versions
from vlmcp.data.processor import VLProcessor
from vlmcp.data.rollouts import META, RolloutMeta, is_complete, read_meta, step_dir, step_files
from vlmcp.data.stream import SampleReader, load_packs
from vlmcp.errors import DataError, RolloutError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import attempt, fail_together
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.objective_step import (index_counts, objective_of, objective_problems,
                                           token_array_names, untrainable, weight_arrays)
from vlmcp.training.steps.step_packs import StepBatches
from vlmcp.training.watchdog import Watchdog

logger = logging.getLogger(__name__)

#: Rank 0 logs that it is still waiting for a step this often.
WAIT_LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class WaitOutcome:
    """How the wait for a step ended: it arrived (signum 0, timed_out False), a stop signal
    (its number), or rollouts.timeout_s; `waited_s`, the longest wait of any rank."""

    signum: int
    timed_out: bool
    waited_s: float


@dataclass
class _Indexed:
    """Rank 0's findings on one step, broadcast to every rank."""

    problems: list[str] = field(default_factory=list)
    index: LengthIndex | None = None
    row: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None


class RolloutSteps:
    """Optimizer step (0-based) -> this rank's micro-batches of rollout step_{step + 1}."""

    def __init__(self, job: JobConfig, processor: VLProcessor, sp: SequenceParallel):
        self.job = job
        self.root = Path(job.rollouts.dir)
        self.processor = processor
        self.sp = sp
        self.objective = objective_of(job)
        self.stale_skipped = 0
        self._waited_s = 0.0
        self._last: tuple[int, StepBatches] | None = None

    def wait(self, step: int, signum: Callable[[], int], watchdog: Watchdog) -> WaitOutcome:
        """Wait until step_{step + 1} is complete on every rank (call on every rank, outside the
        watchdog's phases). `signum()` gives the stop signal this rank received (0: none)."""
        cfg = self.job.rollouts
        path = step_dir(self.root, step + 1)
        started = time.monotonic()
        next_log = 0.0
        while True:
            elapsed = time.monotonic() - started
            flags = torch.tensor([0.0 if is_complete(path) else 1.0, float(signum()), elapsed],
                                 dtype=torch.float64)
            with watchdog.watch(f"agreeing on the arrival of {path}"):
                comm.all_reduce_max(flags)
            missing, agreed_signum, longest = bool(flags[0]), int(flags[1]), float(flags[2])
            if not missing or agreed_signum or longest >= cfg.timeout_s:
                self._waited_s = longest
                return WaitOutcome(0 if not missing else agreed_signum,
                                   missing and not agreed_signum, longest)
            if comm.rank() == 0 and elapsed >= next_log:
                logger.info("waiting for rollout step %s (no %s/STABLE yet; %.0f s so far, "
                            "rollouts.timeout_s=%g)", path, path.name, elapsed, cfg.timeout_s)
                next_log = elapsed + WAIT_LOG_EVERY_S
            time.sleep(cfg.poll_s)

    def timeout_problem(self, step: int, waited_s: float) -> str:
        """The error line of a wait for step_{step + 1} that ran out."""
        return (f"rollouts.timeout_s={self.job.rollouts.timeout_s:g}: no complete "
                f"{step_dir(self.root, step + 1)} (with its STABLE marker) after {waited_s:.0f} s; "
                "has the producer stopped?")

    def step_batches(self, step: int) -> StepBatches:
        """This rank's micro-batches of optimizer step `step` (0-based): rollout step_{step + 1},
        indexed on rank 0 and broadcast (call on every rank, after `wait`); its packs load as the
        step iterates them. Raises RolloutError on every rank when the step cannot train under
        rollouts.on_stale / on_bad_sample, or rank 0 could not index it; asked again for the same
        step, the same `StepBatches`."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self._last is not None:
            self._last[1].close()
            self._last = None
        indexed = comm.broadcast_object(self._index_agreed(step + 1) if comm.rank() == 0 else None)
        fail_together(indexed.problems, RolloutError)
        row = {**indexed.row, "rollout_wait_s": self._waited_s}
        if indexed.skip:
            self.stale_skipped += indexed.skip == "stale"
            fetched = StepBatches([], 0, {}, [], row, skip=indexed.skip)
        else:
            fetched = self._stream(indexed.index, row)
            if comm.rank() == 0:
                logger.info("rollout step %s: %d samples in %d packs, %d micro-batches per rank",
                            step_dir(self.root, step + 1), len(indexed.index),
                            fetched.micro_batches, len(fetched.weights))
        self._last = (step, fetched)
        return fetched

    def close(self) -> None:
        """Stop loading the micro-batches of the last step handed out (its loader's workers)."""
        if self._last is not None:
            self._last[1].close()
            self._last = None

    def _index_agreed(self, number: int) -> _Indexed:
        """Rank 0: `_index`, with anything it raises as the step's problem line."""
        path = step_dir(self.root, number)
        indexed, problems = attempt(lambda: self._index(number), f"indexing {path}")
        return indexed if indexed is not None else _Indexed(problems=problems)

    def _index(self, number: int) -> _Indexed:
        """Rank 0: meta.json, staleness, the length index of step_`number` and its bad samples."""
        cfg = self.job.rollouts
        path = step_dir(self.root, number)
        try:
            meta = read_meta(path)
            files = step_files(path)
        except DataError as exc:
            return _Indexed(problems=[str(exc)])
        data = self.job.data
        image_root = None if data.image_root is None else self.job.resolve_input(data.image_root)
        index, bad = build_index(files, self.processor, data.max_seq_len, data.truncate,
                                 image_root=image_root, array_names=token_array_names(self.job),
                                 count_nonzero=weight_arrays(self.objective), versions=True)
        lacking = sorted({int(i) for indices, _, _ in untrainable(self.job, index)
                          for i in indices})
        lines = bad + objective_problems(self.job, index)
        if lines and cfg.on_bad_sample == "error":
            return _Indexed(problems=lines, row=_lag_row(number, meta, index))
        for line in lines:
            logger.warning("skipping a sample of rollout step %s (rollouts.on_bad_sample=skip): "
                           "%s", path, line)
        index = index.without(lacking)
        versions = step_versions(index.policy_versions, meta.policy_step)
        row = _lag_row(number, meta, index)
        ahead = self._ahead(number, index, meta)
        if ahead is not None:
            return _Indexed(problems=[ahead], row=row)
        stale = self._stale(number, versions)
        if stale is not None and cfg.on_stale == "error":
            return _Indexed(problems=[stale], row=row)
        if stale is not None:
            logger.warning("skipping rollout step %s: %s (rollouts.on_stale=skip; %d stale steps "
                           "skipped in this run)", path, stale, self.stale_skipped + 1)
            return _Indexed(row=row, skip="stale")
        row.update({"rollout_samples": len(index),
                    "rollout_skipped_samples": len(bad) + len(lacking)})
        if not len(index):
            logger.warning("skipping rollout step %s: no sample of it can train", path)
            return _Indexed(row=row, skip="no usable sample")
        return _Indexed(index=index, row=row)

    def _ahead(self, number: int, index: LengthIndex, meta: RolloutMeta) -> str | None:
        """Why step_`number` cannot have been generated before it trains: a version newer than
        the weights that train it (a producer bug, or another run's rollouts.dir). Names the
        first line whose policy_versions give one, and how many more lines do; else meta.json,
        when its policy_step covers a line without per-token versions. None: nothing is ahead."""
        trained_by = number - 1
        ranges = index.policy_versions
        ahead = np.flatnonzero(ranges[:, 1] > trained_by)
        if len(ahead):
            version = int(ranges[ahead[0], 1])
            what = f"{index.source(int(ahead[0]))}: policy_versions give version {version}"
            more = (f" ({len(ahead) - 1} more line(s) of the step are ahead too)"
                    if len(ahead) > 1 else "")
        elif (meta.policy_step is not None and meta.policy_step > trained_by
              and bool((ranges[:, 0] < 0).any())):
            version = meta.policy_step
            what, more = f"{step_dir(self.root, number) / META}: policy_step {version}", ""
        else:
            return None
        return (f"{what}, newer than the weights of step {trained_by}, which train step "
                f"{number} (policy lag {trained_by - version}): a producer bug, or another "
                f"run's rollouts.dir{more}")

    def _stale(self, number: int, versions: StepVersions) -> str | None:
        """Why step_`number` is too old for rollouts.max_staleness, counting from the oldest
        version of any of its tokens (None: it is not)."""
        limit = self.job.rollouts.max_staleness
        if limit is None:
            return None
        if versions.oldest is None:
            return (f"rollouts.max_staleness={limit} needs the generating policy's step: "
                    f"{step_dir(self.root, number) / META} has no \"policy_step\" and the data "
                    "no \"policy_versions\"")
        lag = versions.lags(number)[0]
        if lag > limit:
            what = (f"{step_dir(self.root, number)}: policy version {versions.oldest} (the "
                    "oldest of the step's policy_versions)" if versions.per_token
                    else f"{step_dir(self.root, number) / META}: policy_step {versions.oldest}")
            return (f"{what} is {lag} steps behind the weights that train step {number} "
                    f"(rollouts.max_staleness={limit})")
        return None

    def _stream(self, index: LengthIndex, row: dict[str, Any]) -> StepBatches:
        """This rank's share of the step's packs, streamed, with its counts and sample names from
        the index; repeats of another rank's pack (to keep the micro-batch count equal on every
        rank) get weight 0. With `parallel.sp_dynamic` the packs follow the degree plan of
        `vlmcp.data.pack` (short packs whole, one per SP rank)."""
        data = self.job.data
        lengths = index.tokens.tolist()
        slots = plan_slots(lengths, data.max_seq_len, self.sp.size, self.job.parallel.sp_dynamic)
        dp_size, dp_rank, sp_rank = self.sp.dp_size, self.sp.dp_rank, self.sp.rank
        chosen = [k * dp_size + dp_rank for k in range(max(1, math.ceil(len(slots) / dp_size)))]
        mine, weights, counted = [], [], []
        for i in chosen:
            slot = slots[i % len(slots)]
            pack, weight = slot.pack_of(sp_rank)
            weight = weight if i < len(slots) else 0.0
            mine.append(pack)
            weights.append(weight)
            if weight and slot.owns(sp_rank):
                counted += pack
        reader = SampleReader(index, self.processor, data.max_seq_len, data.truncate)
        batches = load_packs(reader, mine, data.num_workers, data.prefetch_factor)
        degrees = [slots[i % len(slots)].degree for i in chosen]
        if any(degree is not None for degree in degrees):
            batches = _with_degrees(batches, degrees)
        return StepBatches(weights, sum(len(slot.packs) for slot in slots),
                           index_counts(self.objective, index, counted),
                           [[index.source(i) for i in pack] for pack in mine], row,
                           batches=batches)


def _with_degrees(batches: Iterator[PackedBatch], degrees: list[int | None]
                  ) -> Iterator[PackedBatch]:
    """`batches` in order, each with its SP degree set; closing it closes `batches`."""
    try:
        for batch, degree in zip(batches, degrees):
            batch.sp_degree = degree
            yield batch
    finally:
        batches.close()


def _lag_row(number: int, meta: RolloutMeta, index: LengthIndex) -> dict[str, Any]:
    """The row entries of rollout step_`number`'s policy lag: `policy_step` (meta.json's),
    `policy_lag` (from the oldest version of any token), and with per-token versions the oldest
    and newest version and the lags from each."""
    versions = step_versions(index.policy_versions, meta.policy_step)
    oldest_lag, newest_lag = versions.lags(number)
    row: dict[str, Any] = {"policy_step": meta.policy_step, "policy_lag": oldest_lag}
    if versions.per_token:
        row.update({"policy_version_oldest": versions.oldest,
                    "policy_version_newest": versions.newest,
                    "policy_lag_min": newest_lag, "policy_lag_max": oldest_lag})
    return row
