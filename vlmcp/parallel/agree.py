"""Failing together: when any rank hits a problem, every rank raises, so that none is left
waiting in a collective the others skipped.

One small all-reduce (`comm.rank_flags`) tells every rank which ranks failed; then each rank
raises the same error class, and the lines the CLI prints appear once.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmcp.errors import JobError
from vlmcp.parallel import comm


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
