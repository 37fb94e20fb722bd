"""Failing together: when any rank hits a problem, every rank raises, so that none is left
waiting in a collective the others skipped.

One small all-reduce (`comm.rank_flags`) tells every rank which ranks failed; then each rank
raises the same error class, and the lines the CLI prints appear once.

`run_together` is the form for an action one rank does on its own before the ranks meet again
(loading its packs, rank 0 indexing a rollout step or writing a metrics row): whatever the action
raises, a `JobError` with its lines or any other exception (a library's `OverflowError`, a
DataLoader worker that died), becomes one agreed error on every rank. An unexpected exception
gives one line naming the action, the exception's type and message; its traceback goes to the
debug log only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from vlmcp.errors import JobError
from vlmcp.parallel import comm

logger = logging.getLogger(__name__)

T = TypeVar("T")


def fail_together(problems: Sequence[str], error: type[JobError], *, what: str | None = None) -> None:
    """Raise `error` on every rank when any rank has `problems`; call on every rank.

    Without `what`, the ranks' problems are alike (each rank checked the same job or data): the
    lowest failing rank raises its lines and every other rank an empty `error`, so each line is
    printed once. With `what` (an action each rank did on its own, such as writing its shards of a
    checkpoint), every failing rank raises its own lines, and rank 0, when it did not fail itself,
    raises one line naming `what` and the failing ranks; the others raise an empty `error`.
    """
    failing = [r for r, flag in enumerate(comm.rank_flags(bool(problems))) if flag]
    if not failing:
        return
    if problems and (what is not None or comm.rank() == failing[0]):
        raise error(list(problems))
    if what is not None and comm.rank() == 0:
        raise error([f"{what} failed on rank(s) {failing} (see their error line)"])
    raise error([])


def attempt(action: Callable[[], T], failure: str) -> tuple[T | None, list[str]]:
    """Run `action` on this rank alone (no collective): (its result, []), or (None, the lines)
    when it raised: a JobError's lines, each after "`failure`: ", or for any other exception one
    line "`failure`: an unexpected TYPE: message" (the traceback logged at debug level)."""
    try:
        return action(), []
    except JobError as exc:
        return None, [f"{failure}: {line}" for line in exc.problems] or [f"{failure}: {exc!r}"]
    except Exception as exc:  # noqa: BLE001 - every exception must reach the agreement
        logger.debug("%s: the traceback of the unexpected error", failure, exc_info=True)
        return None, [f"{failure}: an unexpected {type(exc).__name__}: {exc}"]


def run_together(action: Callable[[], T], error: type[JobError], failure: str, *,
                 what: str | None = None) -> T:
    """`action()` on this rank, then agree: when it raised on any rank, every rank raises `error`
    (`attempt`'s lines, as `fail_together` with `what` deals them); call on every rank."""
    result, problems = attempt(action, failure)
    fail_together(problems, error, what=what)
    return result
