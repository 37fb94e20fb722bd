"""A per-rank watchdog: no hang outlives `train.collective_timeout_s`.

Why a watchdog and not process-group timeouts alone: the timeout given to
`init_process_group` covers only the default group. DeepSpeed makes the sequence-parallel and
sequence-data-parallel groups (`parallel_state_sp`) and its ZeRO groups with `new_group(ranks)`
and no timeout, which torch then sets to its 30-minute default, and making them ourselves would
mean re-implementing DeepSpeed's group bookkeeping. A gloo timeout, where it fires, also says
neither which collective nor which step. One thread per rank covers every collective (vlmcp's,
DeepSpeed's, under any group), and a stuck write too.

The training loop wraps each phase (a step, an evaluation, a checkpoint save, the final export)
in `watch(label)`. When a phase runs past the timeout, the thread reads where the training
thread waits (its innermost `torch.distributed` call, that call's `group` argument, and the
innermost vlmcp frame), logs one line naming them and the phase, and ends the process with
`EXIT_HUNG`. The peers' launcher then ends the rest: torchrun stops the other ranks when one
exits non-zero (SIGTERM, then SIGKILL after its --shutdown-timeout, which also ends a frozen
rank). No state is kept outside the `Watchdog` object the loop owns.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

logger = logging.getLogger(__name__)

#: Exit code of a rank the watchdog ended (the code `timeout(1)` uses).
EXIT_HUNG = 124
_C10D_FILE = str(Path("torch", "distributed", "distributed_c10d.py"))
_VLMCP_DIR = str(Path(__file__).resolve().parents[1])


def _describe_group(group: object) -> str:
    import torch.distributed as dist

    if group is None:
        return f"the default group (ranks 0..{dist.get_world_size() - 1})"
    try:
        return f"group of ranks {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):
        return f"group {group!r}"


def where_it_waits(frame: FrameType | None) -> str:
    """The collective (and its group) and the vlmcp code a thread's `frame` is stuck in."""
    collective, vlmcp_frame = None, None
    while frame is not None:
        code = frame.f_code
        if collective is None and code.co_filename.endswith(_C10D_FILE) \
                and not code.co_name.startswith("_") and code.co_name != "wrapper":
            collective = (code.co_name, frame.f_locals.get("group"))
        if vlmcp_frame is None and code.co_filename.startswith(_VLMCP_DIR):
            vlmcp_frame = f"{Path(code.co_filename).relative_to(Path(_VLMCP_DIR).parent)}:" \
                          f"{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    called_from = f" (from {vlmcp_frame})" if vlmcp_frame else ""
    if collective is None:
        return f"no collective in flight{called_from}"
    name, group = collective
    return (f"waiting in collective torch.distributed.{name} on {_describe_group(group)}"
            f"{called_from}")


class Watchdog:
    """Ends this process when a watched phase runs past `timeout_s`; a context manager that
    starts and stops the watching thread. Create it on the thread that trains."""

    def __init__(self, timeout_s: float, *, rank: int, poll_s: float = 1.0):
        self.timeout_s = timeout_s
        self._rank = rank
        self._poll_s = min(poll_s, timeout_s / 4)
        self._watched_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._phase: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlmcp-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def watch(self, label: str) -> Iterator[None]:
        """Watch the phase `label` (e.g. "step 12"): it must end within the timeout."""
        with self._lock:
            self._phase = (label, time.monotonic() + self.timeout_s)
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                phase = self._phase
            if phase is not None and time.monotonic() > phase[1]:
                self._end(phase[0])

    def _end(self, label: str) -> None:
        where = where_it_waits(sys._current_frames().get(self._watched_thread))
        logger.error("rank %d: %s did not finish within train.collective_timeout_s=%g s: %s; "
                     "ending this process (exit %d)", self._rank, label, self.timeout_s, where,
                     EXIT_HUNG)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)
