"""Publishing the weights for an inference engine after optimizer steps (`publish.dir`).

    WEIGHTS/                    publish.dir
        step_4/                 the weights after optimizer step 4 (policy version 4): a Hugging
                                Face model directory (config.json, generation_config.json,
                                model-0000R-of-0000W.safetensors, one per rank, and
                                model.safetensors.index.json; one model.safetensors at world 1
                                or with publish.sharded false; the tokenizer, chat template and
                                processor files of model.path), or under LoRA the PEFT adapter
                                directory (adapter_config.json, adapter_model.safetensors, the
                                same tokenizer and processor files)
            STABLE              written last: {"step": 4, "bytes": ..., "written_by": "vlmcp publish"}
        step_8/
        .tmp-step_12/           being written; never a published step
        .set-aside/run-<time>/step_9/   set aside by a resume from an earlier checkpoint

After every `publish.every`-th step, every rank calls `Publisher.publish`. With publish.sharded
(the default) each rank takes its share of whole tensors (training/weights/shards.py: under ZeRO-3
every rank joins each gather and keeps its own tensors) and writes it into its own shard of
WEIGHTS/.tmp-step_N/; rank 0 writes the config and processor files, and once every shard is on
the disk the index, STABLE last, and renames the directory to step_N
(training/weights/sharded_write.py; a rename within one filesystem is atomic). With publish.sharded
false, rank 0 gathers the whole model and writes it with save_pretrained
(`hf_format.write_dir_atomically`); under LoRA rank 0 writes the adapter that way. So a reader that
finds step_N finds all of it; one that also checks for STABLE is safe where renames are not atomic.
Files are flushed to the disk before STABLE, and the directory before and after the rename.

With publish.background (the default, with sharded), `publish` starts this rank's publish thread
and returns. The thread copies this rank's own data off the live model into host buffers it
keeps (under ZeRO-3 its partitions of every parameter, 1/W of the model; under ZeRO 0-2 its
share), then under ZeRO-3 gathers each parameter to its writer from those copies over the
publisher's own gloo group, made at construction, and writes (training/weights/shards.py). The
weights stay step N's until the next optimizer step, and `fence`, which the trainer calls right
before that step, waits until this rank's copy is complete (logged; `publish_fence_wait_s` in the
publish's row). Parameters DeepSpeed cannot gather to one owner are gathered on the training's
thread, as without background, and only written by the thread; so is every share when a rank's
host copy exceeds publish.buffer_mb (under ZeRO-3 any rank's), and a rank whose share itself
exceeds it writes before returning. At most one publish is in flight: the next one first waits
for it (logged, `publish_wait_s` in its row). Every rank calls `check` at every step boundary:
one small all-reduce tells all ranks whether every shard of the step in flight is written, and a
failed copy or write raises CheckpointError on every rank there (the loop checkpoints first).
`close` ends the run's publishing: at the end of training it waits for the write in flight; on a
stop it waits at most publish.stop_wait_s and otherwise abandons the write as its `.tmp-`
directory; after another error (a rank may be alone) it abandons it without talking to the
other ranks on the training's thread. The row of a publish, {"step", "published", "publish_s"
(on the critical path: the time in `publish` and, in the background, in the fences after it),
"publish_total_s", "publish_bytes"}, is returned when the publish completes: by `publish` itself
when it is synchronous, by a later `check`, `publish` or `close` when it is not.

Then rank 0 removes the published steps older than the newest `publish.keep` (each renamed away
first, then deleted): never the step just published, never a `.tmp-` one being written, never a
directory whose STABLE does not name vlmcp's publish as its writer (`written_by`; a rollout
step's STABLE never does, so the two kinds of step can never be taken for each other).
A failed write raises CheckpointError on every rank; nothing half-written stays.

With publish.engines, every `publish.every`-th step also goes straight into running vLLM engines,
labelled policy version N, in memory (training/weights/engine_push.py): each rank hands the same
share to the push on its publish thread, before writing it, so the push carries step N's bytes
exactly as the directory does, fenced the same way; publish.dir, when set, is then written only
after every `publish.dir_every`-th step (the durable record), and a step that is only pushed
writes nothing to the disk. The publish's row then also says which engines serve the step. A
LoRA run pushes the merged weights (training/weights/lora_push.py) on the training's thread,
before rank 0 writes the adapter.

At the start (`Publisher(...)`), rank 0 removes the `.tmp-step_*` and `.old-step_*` directories
an interrupted run left behind (a network filesystem can keep them), and a resume at step S sets
aside the published steps beyond S (a crashed run can publish steps after its last checkpoint:
weights of a timeline the resume does not continue) by renaming them into
`.set-aside/run-<UTC time>/`, where no engine looking for `step_N` finds them. A fresh run
refuses a publish.dir that already holds steps (training/preflight.py).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from vlmcp.config import JobConfig
from vlmcp.data.rollouts import PUBLISHED_BY, STABLE, written_by_publish
from vlmcp.model.packed import PackedVLM
from vlmcp.errors import CheckpointError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.training.atomic import dir_size, remove_quietly, write_text_atomic
from vlmcp.training.weights.export import engine_hf_state_dict
from vlmcp.training.weights.hf_format import (saved_tensors, state_bytes, write_dir_atomically,
                                              write_hf_files, write_model_config, write_on_rank0)
from vlmcp.training.weights.expert_shards import is_gathered_slice
from vlmcp.training.weights.engine_push import EnginePush, PushSettings
from vlmcp.training.weights.sharded_write import PushFailed, ShardedWrite
from vlmcp.training.weights.shards import (SharePlan, StagedShare, buffers_held_bytes,
                                           bytes_to_stage, gather_share, gathers_by_modules,
                                           partitioned)
from vlmcp.training.weights.lora_export import trained_state_dict, write_adapter_files
from vlmcp.training.weights.lora_push import MergedShare, merged_share

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^step_(\d+)$")
#: Leftovers of an interrupted write or prune, removed at the start of a run.
_STALE = re.compile(r"^\.(tmp|old)-step_\d+$")
#: Where a resume sets aside the published steps beyond its checkpoint.
SET_ASIDE = ".set-aside"


def step_dirs(directory: str | Path) -> dict[int, Path]:
    """{N: path} of every `step_N` directory in `directory` (published or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    return {int(m.group(1)): p for p in directory.iterdir()
            if p.is_dir() and (m := _STEP.match(p.name))}


def published_steps(directory: str | Path) -> list[int]:
    """The complete published steps in `directory` (their STABLE names vlmcp's publish), newest
    first."""
    return sorted((step for step, path in step_dirs(directory).items()
                   if written_by_publish(path)), reverse=True)


@dataclass
class _InFlight:
    """A publish not yet settled: its step, directory (None: pushed into the engines only),
    start (perf_counter), the seconds it waited for the previous one, its rank-parallel write
    (None: written on rank 0), and whether it pushes into the engines."""

    step: int
    out: Path | None
    started: float
    waited_s: float
    write: ShardedWrite | None
    pushed: bool = False
    #: Seconds `publish` took on the main thread, when the write went on in the background.
    critical_s: float | None = None
    #: Seconds the optimizer steps after it waited for this rank's copy (`Publisher.fence`).
    fence_wait_s: float = 0.0


class Publisher:
    """Writes WEIGHTS/step_N of the live run (see the module docstring)."""

    def __init__(self, job: JobConfig, engine: Any, module: PackedVLM, adapter: Any = None,
                 start_step: int = 0):
        """Call on every rank, before the first step: rank 0 clears what an interrupted run left
        in publish.dir and sets aside the published steps beyond `start_step` (the module
        docstring); every rank raises CheckpointError when it cannot."""
        self.root = Path(job.publish.dir).absolute() if job.publish.dir else None
        self.every = job.publish.every
        self.dir_every = job.publish.dir_every or job.publish.every
        self.keep = job.publish.keep
        self.source_dir = job.resolve_input(job.model.path)
        self.engine, self.module, self.adapter = engine, module, adapter
        self.sharded = job.publish.sharded
        self.background = job.publish.sharded and job.publish.background and adapter is None
        self.buffer_bytes = int(job.publish.buffer_mb * 2**20)
        self.stop_wait_s = job.publish.stop_wait_s
        self._plan: SharePlan | None = None
        #: A LoRA run's merged weights for the push, made at its first push.
        self._merged: MergedShare | None = None
        #: This rank's host copy of its share for background writes, reused from publish to
        #: publish (the previous write has finished before the next copy).
        self._staging: dict[str, torch.Tensor] = {}
        #: {rank: host bytes it stages} (every rank under ZeRO-3, this one otherwise), once.
        self._stage_bytes: dict[int, int] | None = None
        #: The publish thread's own group for the ZeRO-3 gather (training/weights/shards.py), made
        #: on every rank here, at the same point of the run; None at world 1 or without background.
        self._group = (comm.new_world_gloo_group(job.train.collective_timeout_s)
                       if self.background else None)
        self._inflight: _InFlight | None = None
        #: An abandoned write whose thread may still be in a gather on `_group`.
        self._abandoned: ShardedWrite | None = None
        #: Rows of publishes that completed but were not returned yet (`unreturned_rows`).
        self._unreturned: list[dict[str, Any]] = []
        self._warned_buffer = False
        publish = job.publish
        #: The push into publish.engines (training/weights/engine_push.py), None without.
        self.push = EnginePush(PushSettings(
            tuple(url.rstrip("/") for url in publish.engines), int(publish.bucket_mb * 2**20),
            publish.engine_timeout_s, publish.engine_pause, publish.on_engine_error,
            publish.push_host, getattr(torch, publish.push_dtype) if publish.push_dtype else None,
            publish.push_staged, publish.dense_every, publish.verify_push)
            ) if publish.engines else None
        problems = []
        if comm.rank() == 0 and self.root is not None:
            try:
                self._clear_leftovers(start_step)
            except OSError as exc:
                problems.append(f"publish.dir: cannot clear {self.root} for this run: {exc}")
        fail_together(problems, CheckpointError)

    def _clear_leftovers(self, start_step: int) -> None:
        """Rank 0: remove stale `.tmp-`/`.old-` steps; set aside published steps > start_step."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if _STALE.match(path.name):
                remove_quietly(path)
                logger.info("removed %s, left by an interrupted publish", path)
        ahead = sorted(step for step in published_steps(self.root) if step > start_step)
        if not ahead:
            return
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        aside = self.root / SET_ASIDE / f"run-{stamp}"
        aside.mkdir(parents=True)
        for step in ahead:
            (self.root / f"step_{step}").rename(aside / f"step_{step}")
        logger.warning("publish.dir: resuming at step %d, set aside the published steps %s (a "
                       "timeline ahead of the checkpoint) to %s", start_step,
                       ", ".join(map(str, ahead)), aside)

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory the buffers this rank keeps for background publishes really take
        (resident from the first one to the end of the run; pinned ones rounded up to a power
        of two, as torch's caching host allocator holds them)."""
        return buffers_held_bytes(self._staging)

    def due(self, done: int) -> bool:
        """Whether the weights after `done` completed steps are published (written, pushed or
        both)."""
        return self.dir_due(done) or self.push_due(done)

    def dir_due(self, done: int) -> bool:
        """Whether publish.dir gets the weights after `done` completed steps."""
        return self.root is not None and done % self.dir_every == 0

    def push_due(self, done: int) -> bool:
        """Whether the engines get the weights after `done` completed steps."""
        return self.push is not None and done % self.every == 0

    def publish(self, done: int, *, write: bool | None = None, push: bool | None = None
                ) -> list[dict[str, Any]]:
        """Publish the weights after `done` steps (call on every rank, right after the optimizer
        step): into publish.dir when `write` (default: when due) and into the engines when `push`
        (default: when due). Returns the rows of the publishes that completed meanwhile
        (meaningful on rank 0), this one's too when it is synchronous."""
        write = self.dir_due(done) if write is None else write
        push = self.push_due(done) if push is None else push
        started = time.perf_counter()
        waited = 0.0
        if self._inflight is not None:
            previous = self._inflight.step
            self._unreturned += self._settle(wait=True)
            waited = time.perf_counter() - started
            if comm.rank() == 0:
                logger.info("the publish of step %d waited %.2f s for the write of step %d, "
                            "still in flight (at most one publish is)", done, waited, previous)
        out = self.root / f"step_{done}" if write else None
        if self.adapter is not None or not self.sharded:
            if push:
                self._push_merged(done)
            if out is not None:
                self._publish_on_rank0(done, out)
            self._inflight = _InFlight(done, out, started, waited, None, pushed=push)
            self._unreturned += self._settle(wait=True)
            return self.unreturned_rows()
        plan = self._share_plan()
        writing = ShardedWrite.begin(
            out, plan, what="published weights" if out is not None else f"weights of step {done}",
            replaceable=written_by_publish, seal=lambda tmp: self._mark(tmp, done, plan.total_size),
            after=lambda _: self._prune(done),
            push=(lambda share: self.push.push(done, share)) if push else None)
        hf_model = self.module.hf_model
        tensors = saved_tensors(hf_model)
        zero3 = partitioned(self.engine)
        by_modules = gathers_by_modules(self.engine, tensors, plan)

        def extra(tmp: Path) -> None:
            write_model_config(hf_model, self.source_dir, tmp)

        write = writing
        if self._stages(plan, tensors, zero3, by_modules):
            if self._abandoned is not None:  # the group serves one publish at a time
                self._abandoned.abandon(None)
                self._abandoned = None
            staged = StagedShare.capture(tensors, plan, comm.rank(), zero3, self._staging)
            write.start_staged(staged.stage, lambda stop: staged.collect(self._group, stop),
                               extra=extra)
        else:
            background = self.background and plan.bytes_of(comm.rank()) <= self.buffer_bytes
            share = gather_share(self.engine, hf_model, plan, comm.rank(),
                                 self._staging if background else None, by_modules=by_modules)
            write.start(share, background=background, extra=extra)
            del share
        self._inflight = _InFlight(done, out, started, waited, write, pushed=push)
        if not self.background:
            self._unreturned += self._settle(wait=True)
        else:
            self._inflight.critical_s = time.perf_counter() - started
        return self.unreturned_rows()

    def unreturned_rows(self) -> list[dict[str, Any]]:
        """The rows of the publishes that completed but were not returned yet: after a
        `publish` that raised once it had settled the publish before it (that one's row), so
        that the caller still writes them; then none until the next such failure."""
        rows, self._unreturned = self._unreturned, []
        return rows

    def _stages(self, plan: SharePlan, tensors: dict[str, torch.Tensor], zero3: bool,
                by_modules: bool) -> bool:
        """Whether this publish copies (and under ZeRO-3 gathers) on the publish thread: in the
        background, unless the ranks gather with DeepSpeed (`by_modules`) or the host copy
        exceeds publish.buffer_mb: under ZeRO-3 on any rank, as the ranks gather together (every
        rank computes every rank's bytes, the same), else on this rank. Otherwise the gather runs
        here, on the training's thread, and a rank whose share fits still writes in the
        background. So it does under ZeRO-3 with expert parallelism: each rank's experts are
        gathered within its expert-data-parallel group (training/weights/expert_shards.py)."""
        if not self.background or by_modules or any(map(is_gathered_slice, tensors.values())):
            return False
        if self._stage_bytes is None:
            ranks = range(comm.world_size()) if zero3 else [comm.rank()]
            self._stage_bytes = {r: bytes_to_stage(tensors, plan, r, zero3) for r in ranks}
        over = sorted(r for r, size in self._stage_bytes.items() if size > self.buffer_bytes)
        if over and comm.rank() in over and not self._warned_buffer:
            self._warned_buffer = True
            logger.warning("rank %d: its host copy of the weights for a background publish "
                           "(%d MiB) exceeds publish.buffer_mb=%g, so %s", comm.rank(),
                           self._stage_bytes[comm.rank()] >> 20, self.buffer_bytes / 2**20,
                           "the ranks gather before training on, and it writes its share "
                           "before training on where that exceeds it too" if zero3
                           else "it writes its share before training on")
        return not over

    def fence(self) -> None:
        """Call on every rank right before an optimizer step that may change the parameters
        (training/loop.py: the accumulation boundary's `engine.step()`): waits until this rank's
        copy of the publish in flight is off the live model (training/weights/shards.py), logs the
        wait and counts it in the publish's row (`publish_fence_wait_s`, and in `publish_s`).
        It needs no other rank, so it never hangs; a copy that failed returns at once and fails
        the run at the next `check`."""
        inflight = self._inflight
        if inflight is None or inflight.write is None:
            return
        started = time.perf_counter()
        if not inflight.write.wait_staged():
            return
        waited = time.perf_counter() - started
        inflight.fence_wait_s += waited
        logger.info("rank %d: the optimizer step waited %.3f s for the host copy of step %d's "
                    "weights (the publish fence)", comm.rank(), waited, inflight.step)

    def check(self) -> list[dict[str, Any]]:
        """At a step boundary (call on every rank): the rows of the publishes that completed;
        CheckpointError on every rank when a background write failed."""
        return self._settle(wait=False) if self._inflight is not None else []

    def close(self, stop_wait_s: float | None = None, *, agreed: bool = True
              ) -> list[dict[str, Any]]:
        """End the run's publishing; afterwards no thread reads the live model. `stop_wait_s`
        None (the end of training, every rank): wait for the write in flight, as `check`. A
        number (a stop every rank agreed on): wait at most that long for it, else abandon it as
        its `.tmp-` directory. `agreed` False (an error that one rank may have alone): abandon it
        at once, with no collective on this thread. An abandoned write waits for this rank's
        copy off the live model, and at most publish.stop_wait_s for the ranks' publish threads
        to leave their gather together (training/weights/shards.py). Returns the write's row when it
        is complete: on every rank alike, except after an error that was not agreed (`agreed`
        False: complete is then known on rank 0 alone, the rank that writes the metrics, and the
        caller must write the row without a collective)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None or inflight.write is None:
            return []
        if not agreed:
            inflight.write.abandon(self.stop_wait_s)
            self._abandoned = inflight.write
            return [self._row(inflight)] if inflight.write.complete else []
        if stop_wait_s is None:
            self._inflight = inflight
            return self._settle(wait=True)
        if inflight.write.settle_within(stop_wait_s):
            return [self._row(inflight)]
        self._abandoned = inflight.write
        if comm.rank() == 0:
            logger.warning("stopping: abandoned the publish of step %d after publish.stop_wait_s="
                           "%g s; %s is never read and the next start removes it", inflight.step,
                           stop_wait_s, inflight.write.tmp)
        return []

    def _settle(self, wait: bool) -> list[dict[str, Any]]:
        inflight = self._inflight
        if inflight.write is not None:
            try:
                complete = inflight.write.settle(wait)
            except CheckpointError:
                self._inflight = None
                raise
            if not complete:
                return []
        self._inflight = None
        return [self._row(inflight)]

    def _row(self, inflight: _InFlight) -> dict[str, Any]:
        """The publish's row: `publish_s` (this rank's time on the critical path) and in the
        background `publish_fence_wait_s` on every rank, the rest on rank 0: the directory's
        `published`, `publish_bytes`; the push's `pushed` (the engines that serve the step now),
        `push_failed`, `push_bytes` (one engine's copy), `push_s` (rank 0's thread),
        `push_downtime_s` (the longest pause-to-resume) and `push_phases_s` (that engine's
        control plane, per phase), `push_sparse` (the engines pushed sparse), with a sparse push
        `push_changed_fraction` (of the share's elements, over all ranks), `push_reanchored`
        (sparse pushes that failed and were followed by a dense one), `push_check_s` (the
        longest delivery check), `push_base_bytes` (publish.dense_every > 1: the host bytes rank
        0 keeps of its share as last pushed, for the next delta)."""
        finished = inflight.write.finished_at if inflight.write is not None else None
        total = (finished or time.perf_counter()) - inflight.started
        background = inflight.critical_s is not None
        critical = inflight.critical_s + inflight.fence_wait_s if background else total
        row: dict[str, Any] = {"step": inflight.step, "publish_s": critical}
        if inflight.out is not None:
            row["published"] = str(inflight.out)
        if background:
            row["publish_fence_wait_s"] = inflight.fence_wait_s
        if comm.rank() != 0:
            return row
        row["publish_total_s"] = total
        if inflight.out is not None:
            row["publish_bytes"] = dir_size(inflight.out)
        if inflight.waited_s:
            row["publish_wait_s"] = inflight.waited_s
        if inflight.pushed:
            row.update(self._push_fields())
        logger.info("published the weights of step %d%s%s (%.2f s, %.2f s of them on the "
                    "training's critical path)", inflight.step,
                    f" to {inflight.out} ({row['publish_bytes']} bytes)" if inflight.out else "",
                    f" into {', '.join(row['pushed'])}" if row.get("pushed") else "", total,
                    critical)
        return row

    def _push_fields(self) -> dict[str, Any]:
        """Rank 0: the push's part of the row (see `_row`)."""
        outcomes = self.push.outcomes
        served = [o for o in outcomes if o.problem is None]
        fields: dict[str, Any] = {"pushed": [o.url for o in served],
                                  "push_bytes": self.push.pushed_bytes,
                                  "push_s": sum(o.seconds for o in outcomes),
                                  "push_sparse": [o.url for o in outcomes if o.mode == "sparse"]}
        if self.push.changed is not None:
            changed, total = self.push.changed
            fields["push_changed_fraction"] = changed / total if total else 0.0
        if self.push.settings.dense_every > 1:
            fields["push_base_bytes"] = self.push.base.nbytes
        if any(o.reanchored for o in outcomes):
            fields["push_reanchored"] = [o.url for o in outcomes if o.reanchored]
        checks = [o.check_s for o in outcomes if o.check_s is not None]
        if checks:
            fields["push_check_s"] = max(checks)
        if len(served) < len(outcomes):
            fields["push_failed"] = [o.url for o in outcomes if o.problem is not None]
        if served:
            slowest = max(served, key=lambda o: o.downtime_s or 0.0)
            fields["push_downtime_s"] = slowest.downtime_s
            fields["push_phases_s"] = slowest.phases
        return fields

    def _share_plan(self) -> SharePlan:
        if self._plan is None:
            self._plan = SharePlan.of(self.module.hf_model, comm.world_size())
        return self._plan

    def _push_merged(self, done: int) -> None:
        """A LoRA run's push of step `done` (every rank, on the training's thread): the merged
        weights of the adapted tensors, and of the whole model where an engine gets a dense push
        (training/weights/lora_push.py). CheckpointError on every rank when it failed (under
        publish.on_engine_error "error")."""
        if self._merged is None:
            self._merged = merged_share(self.module)
        problems = []
        try:
            self.push.push(done, self._merged.trained(), self._merged.whole)
        except Exception as exc:  # agreed below: every rank stops at the same point
            problems.append(str(exc) if isinstance(exc, PushFailed) else
                            f"pushing the merged weights of step {done}: "
                            f"{type(exc).__name__}: {exc}")
        fail_together(problems, CheckpointError)

    def _publish_on_rank0(self, done: int, out: Path) -> None:
        """Rank 0 writes the whole step with save_pretrained (the adapter under LoRA), every
        rank waiting; CheckpointError on every rank when it failed."""
        if self.adapter is not None:
            state = trained_state_dict(self.module, self.adapter.base_model.model)

            def fill(tmp: Path) -> None:
                write_adapter_files(self.adapter, state, self.source_dir, tmp)
        else:
            state = engine_hf_state_dict(self.engine, self.module, self.module.hf_model)

            def fill(tmp: Path) -> None:
                write_hf_files(self.module.hf_model, state, self.source_dir, tmp)

        def write() -> None:
            if out.exists() and not written_by_publish(out):
                raise CheckpointError([f"publishing step {done}: {out} exists and was not "
                                       "written by vlmcp's publish; it is left as it is"])
            write_dir_atomically(out, STABLE, "published weights", fill, state_bytes(state),
                                 seal=lambda tmp: self._mark(tmp, done, state_bytes(state)))
            self._prune(done)

        write_on_rank0(state, write, out)

    @staticmethod
    def _mark(tmp: Path, done: int, weight_bytes: int) -> None:
        write_text_atomic(tmp / STABLE, json.dumps({"step": done, "bytes": weight_bytes,
                                                    "written_by": PUBLISHED_BY}))

    def _prune(self, done: int) -> None:
        """Rank 0: remove the published steps older than the newest `keep` up to `done` (the step
        just published, which is always kept)."""
        if not self.keep:
            return
        for step in [s for s in published_steps(self.root) if s <= done][self.keep:]:
            path = self.root / f"step_{step}"
            gone = path.with_name(f".old-{path.name}")
            try:
                remove_quietly(gone)
                path.rename(gone)
            except OSError as exc:
                logger.warning("publish.keep=%d: cannot remove %s: %s", self.keep, path, exc)
                continue
            remove_quietly(gone)
            logger.info("removed published weights %s (publish.keep=%d)", path, self.keep)
