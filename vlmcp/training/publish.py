"""Publishing the weights for an inference engine after optimizer steps (`publish.dir`).

    WEIGHTS/                    publish.dir
        step_4/                 the weights after optimizer step 4 (policy version 4): a Hugging
                                Face model directory (config.json, model.safetensors,
                                generation_config.json, the tokenizer, chat template and
                                processor files of model.path), or under LoRA the PEFT adapter
                                directory (adapter_config.json, adapter_model.safetensors, the
                                same tokenizer and processor files)
            STABLE              written last: {"step": 4, "bytes": ..., "written_by": "vlmcp publish"}
        step_8/
        .tmp-step_12/           being written; never a published step
        .set-aside/run-<time>/step_9/   set aside by a resume from an earlier checkpoint

After every `publish.every`-th step, every rank calls `Publisher.publish`: the weights are gathered
as for the final export (under ZeRO-3 layer by layer onto rank 0; under LoRA the adapters only),
and rank 0 fills WEIGHTS/.tmp-step_N/, writes STABLE last and renames the directory to step_N
(`hf_format.write_dir_atomically`; a rename within one filesystem is atomic). So a reader that
finds step_N finds all of it; one that also checks for STABLE is safe where renames are not atomic.
The files are flushed to the disk before STABLE, and the directory before and after the rename.
Then rank 0 removes the published steps older than the newest `publish.keep` (each renamed away
first, then deleted): never the step just published, never a `.tmp-` one being written, never a
directory whose STABLE does not name vlmcp's publish as its writer (`written_by`; a rollout
step's STABLE never does, so the two kinds of step can never be taken for each other).
A failed write raises CheckpointError on every rank; nothing half-written stays.

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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vlmcp.config import JobConfig
from vlmcp.data.rollouts import PUBLISHED_BY, STABLE, written_by_publish
from vlmcp.model.packed import PackedVLM
from vlmcp.errors import CheckpointError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.training.atomic import dir_size, remove_quietly, write_text_atomic
from vlmcp.training.export import engine_hf_state_dict
from vlmcp.training.hf_format import state_bytes, write_dir_atomically, write_hf_files, \
    write_on_rank0
from vlmcp.training.lora_export import trained_state_dict, write_adapter_files

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


class Publisher:
    """Writes WEIGHTS/step_N of the live run (see the module docstring)."""

    def __init__(self, job: JobConfig, engine: Any, module: PackedVLM, adapter: Any = None,
                 start_step: int = 0):
        """Call on every rank, before the first step: rank 0 clears what an interrupted run left
        in publish.dir and sets aside the published steps beyond `start_step` (the module
        docstring); every rank raises CheckpointError when it cannot."""
        self.root = Path(job.publish.dir).absolute()
        self.every = job.publish.every
        self.keep = job.publish.keep
        self.source_dir = job.resolve_input(job.model.path)
        self.engine, self.module, self.adapter = engine, module, adapter
        problems = []
        if comm.rank() == 0:
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

    def due(self, done: int) -> bool:
        """Whether the weights after `done` completed steps are published."""
        return done % self.every == 0

    def publish(self, done: int) -> dict[str, Any]:
        """Publish the weights after `done` steps (call on every rank); returns the metrics row
        {"step", "published", "publish_s", "publish_bytes"} (meaningful on rank 0)."""
        started = time.perf_counter()
        out = self.root / f"step_{done}"
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
                                 seal=lambda tmp: self._mark(tmp, done, state))

        write_on_rank0(state, write, out)
        row: dict[str, Any] = {"step": done, "published": str(out)}
        if comm.rank() == 0:
            self._prune(done)
            row.update({"publish_s": time.perf_counter() - started,
                        "publish_bytes": dir_size(out)})
            logger.info("published the weights of step %d to %s (%d bytes, %.2f s)", done, out,
                        row["publish_bytes"], row["publish_s"])
        return row

    @staticmethod
    def _mark(tmp: Path, done: int, state: dict) -> None:
        write_text_atomic(tmp / STABLE, json.dumps({"step": done, "bytes": state_bytes(state),
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
