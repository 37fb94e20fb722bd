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
exits non-zero (SIGTERM, then SIGKILL 30 s later, which also ends a frozen rank: torch 2.13's
agent stops a failed group with that fixed grace, not its --shutdown-timeout). No state is kept
outside the `Watchdog` object the loop owns.

A collective that fails instead of hanging (a peer rank was killed or its connection dropped:
gloo's "Connection reset by peer", NCCL's backend errors) raises a RuntimeError from inside
torch.distributed; `watch` turns it into one `CollectiveError` line naming the phase, the
collective, its group and the backend's reason, in place of a traceback through DeepSpeed and
torch. The rank then exits like any rank failing alone (the CLI does not wait for its peers), and
the launcher ends the rest.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from vlmcp.errors import CollectiveError

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


def _collective_and_caller(frames: Iterable[tuple[FrameType, int]]) -> tuple[str | None, str]:
    """From (frame, line) pairs, innermost first: the innermost public torch.distributed
    collective with its group ("torch.distributed.NAME on GROUP", None if there is none) and
    " (from FILE:LINE in FUNCTION)" for the innermost vlmcp frame ("" if none)."""
    collective, vlmcp_frame = None, ""
    for frame, line in frames:
        code = frame.f_code
        if collective is None and code.co_filename.endswith(_C10D_FILE) \
                and not code.co_name.startswith("_") and code.co_name != "wrapper":
            collective = (f"torch.distributed.{code.co_name} on "
                          f"{_describe_group(frame.f_locals.get('group'))}")
        if not vlmcp_frame and code.co_filename.startswith(_VLMCP_DIR):
            vlmcp_frame = f" (from {Path(code.co_filename).relative_to(Path(_VLMCP_DIR).parent)}" \
                          f":{line} in {code.co_name})"
    return collective, vlmcp_frame


def where_it_waits(frame: FrameType | None) -> str:
    """The collective (and its group) and the vlmcp code a thread's `frame` is stuck in."""
    # walk_stack(None) would walk this (the watchdog's) thread instead
    stack = traceback.walk_stack(frame) if frame is not None else ()
    collective, called_from = _collective_and_caller(stack)
    if collective is None:
        return f"no collective in flight{called_from}"
    return f"waiting in collective {collective}{called_from}"


def failed_collective(exc: BaseException) -> str | None:
    """For an exception raised inside a torch.distributed collective: that collective, its
    group and the vlmcp code that called it; None for any other exception."""
    collective, called_from = _collective_and_caller(
        reversed(list(traceback.walk_tb(exc.__traceback__))))
    return None if collective is None else f"{collective}{called_from}"


def _reason(exc: BaseException) -> str:
    """The first sentence of a backend's error, without the source location gloo puts first
    ("[.../pair.cc:537] Read error [127.0.0.1]:12002: Connection reset by peer. This is ...")."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())
    first = text.splitlines()[0].split(". ")[0] if text else type(exc).__name__
    return first[:300]


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
        """Watch the phase `label` (e.g. "step 12"): it must end within the timeout. A collective
        that fails in it raises CollectiveError (the module docstring)."""
        with self._lock:
            self._phase = (label, time.monotonic() + self.timeout_s)
        try:
            yield
        except RuntimeError as exc:
            collective = failed_collective(exc)
            if collective is None:
                raise
            raise CollectiveError(
                f"rank {self._rank}: {label}: collective {collective} failed: {_reason(exc)} "
                "(a peer rank ended or lost its connection: its own log says why)") from exc
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
