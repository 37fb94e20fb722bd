"""Publishing the weights for an inference engine after optimizer steps (`publish.dir`).

    WEIGHTS/                    publish.dir
        step_4/                 the weights after optimizer step 4 (policy version 4): a Hugging
                                Face model directory (config.json, model.safetensors,
                                generation_config.json, the tokenizer, chat template and
                                processor files of model.path), or under LoRA the PEFT adapter
                                directory (adapter_config.json, adapter_model.safetensors, the
                                same tokenizer and processor files)
            STABLE              written last: {"step": 4, "bytes": ...}
        step_8/
        .tmp-step_12/           being written; never a published step

After every `publish.every`-th step, every rank calls `Publisher.publish`: the weights are gathered
as for the final export (under ZeRO-3 layer by layer onto rank 0; under LoRA the adapters only),
and rank 0 fills WEIGHTS/.tmp-step_N/, writes STABLE last and renames the directory to step_N
(`hf_format.write_dir_atomically`; a rename within one filesystem is atomic). So a reader that
finds step_N finds all of it; one that also checks for STABLE is safe where renames are not atomic.
Then rank 0 removes the complete steps older than the newest `publish.keep` (each renamed away
first, then deleted): never a `.tmp-` one being written, never one without STABLE.
A failed write raises CheckpointError on every rank; nothing half-written stays.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from vlmcp.config import JobConfig
from vlmcp.data.rollouts import STABLE, is_complete
from vlmcp.model.packed import PackedVLM
from vlmcp.parallel import comm
from vlmcp.training.atomic import dir_size, remove_quietly, write_text_atomic
from vlmcp.training.export import engine_hf_state_dict
from vlmcp.training.hf_format import state_bytes, write_dir_atomically, write_hf_files, \
    write_on_rank0
from vlmcp.training.lora_export import trained_state_dict, write_adapter_files

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^step_(\d+)$")


def published_steps(directory: str | Path) -> list[int]:
    """The complete (STABLE) published steps in `directory`, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)) for p in directory.iterdir()
                   if p.is_dir() and (m := _STEP.match(p.name)) and is_complete(p)), reverse=True)


class Publisher:
    """Writes WEIGHTS/step_N of the live run (see the module docstring)."""

    def __init__(self, job: JobConfig, engine: Any, module: PackedVLM, adapter: Any = None):
        self.root = Path(job.publish.dir).absolute()
        self.every = job.publish.every
        self.keep = job.publish.keep
        self.source_dir = job.resolve_input(job.model.path)
        self.engine, self.module, self.adapter = engine, module, adapter

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
                self._mark(tmp, done, state)
        else:
            state = engine_hf_state_dict(self.engine, self.module, self.module.hf_model)

            def fill(tmp: Path) -> None:
                write_hf_files(self.module.hf_model, state, self.source_dir, tmp)
                self._mark(tmp, done, state)

        write_on_rank0(state, lambda: write_dir_atomically(out, STABLE, "published weights",
                                                           fill, state_bytes(state)))
        row: dict[str, Any] = {"step": done, "published": str(out)}
        if comm.rank() == 0:
            self._prune()
            row.update({"publish_s": time.perf_counter() - started,
                        "publish_bytes": dir_size(out)})
            logger.info("published the weights of step %d to %s (%d bytes, %.2f s)", done, out,
                        row["publish_bytes"], row["publish_s"])
        return row

    @staticmethod
    def _mark(tmp: Path, done: int, state: dict) -> None:
        write_text_atomic(tmp / STABLE, json.dumps({"step": done, "bytes": state_bytes(state)}))

    def _prune(self) -> None:
        """Rank 0: remove the complete published steps beyond the newest `keep`."""
        if not self.keep:
            return
        for step in published_steps(self.root)[self.keep:]:
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
