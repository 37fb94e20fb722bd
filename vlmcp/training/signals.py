"""Stopping on a signal without losing work: SIGTERM, SIGINT, and SIGUSR1 (what SLURM sends
before a kill).

The first signal only records itself. The training loop finishes its current optimizer step,
and once per step all ranks agree on whether any rank was signalled (`StopSignals.agreed`, one
all-reduce of a single number), so every rank stops after the same step, writes the same
checkpoint and exits with 128 + the signal number (SIGTERM 143, SIGINT 130, SIGUSR1 138).

A second signal, at least `REPEAT_AFTER_S` after the first, exits at once with 128 + its number.
Repeats closer together count once: a Ctrl-C under torchrun reaches each rank twice within
milliseconds (from the terminal, and forwarded by torchrun).

A clean stop leaves two records for whoever launched the run, since a launcher does not pass the
ranks' 128 + N on (torchrun, signalled itself, exits 1): a metrics row `stop_row` and, written
last, OUTPUT_DIR/stopped.json (`STOP_MARKER`: the signal, the exit code, the completed steps and
their checkpoint). Every `vlmcp train` removes the marker when it starts, so a marker after the
launcher exited means that launch stopped cleanly; no marker means it failed or finished (exit 0).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from vlmcp.parallel import comm
from vlmcp.training.atomic import write_text_atomic

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REPEAT_AFTER_S = 1.0
#: Written in OUTPUT_DIR at a clean stop, after the checkpoint.
STOP_MARKER = "stopped.json"


def stop_row(signum: int, step: int, checkpoint: str | None) -> dict[str, Any]:
    """The metrics row of a clean stop after `step` completed steps; `checkpoint`: the directory
    of their checkpoint (None: no step was trained, so none was written)."""
    return {"step": step, "stopped": signal.Signals(signum).name, "exit_code": 128 + signum,
            "checkpoint": checkpoint}


def write_stop_marker(output_dir: str | Path, signum: int, step: int,
                      checkpoint: str | None) -> None:
    """OUTPUT_DIR/stopped.json, atomically: `stop_row` (call on one rank, after the checkpoint).
    Raises OSError when it cannot be written."""
    write_text_atomic(Path(output_dir) / STOP_MARKER,
                      json.dumps(stop_row(signum, step, checkpoint)) + "\n")


def clear_stop_marker(output_dir: str | Path) -> None:
    """Remove an earlier run's OUTPUT_DIR/stopped.json (call on one rank as the run starts); an
    output_dir that cannot be written is left to the job's checks to name."""
    try:
        (Path(output_dir) / STOP_MARKER).unlink(missing_ok=True)
    except OSError:
        pass


class StopRequested(Exception):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is 128 + signum."""

    def __init__(self, signum: int, step: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped on {signal.Signals(signum).name} after step {step}; "
                         "continue with train.resume=true")


class StopSignals:
    """Records stop signals for the training loop; a context manager that installs the handlers
    (main thread only) and restores the previous ones on exit."""

    def __init__(self) -> None:
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            logger.warning("received %s: finishing the current step, then saving a checkpoint "
                           "(send it again to stop at once)", name)
        elif now - self._first_at >= REPEAT_AFTER_S:
            logger.error("received %s again: stopping at once without a checkpoint (exit %d)",
                         name, 128 + signum)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(128 + signum)

    def agreed(self) -> int:
        """The signal any rank received (the highest number), or 0; call on every rank."""
        flag = torch.tensor([float(self.signum)], dtype=torch.float64)
        comm.all_reduce_max(flag)
        return int(flag.item())
