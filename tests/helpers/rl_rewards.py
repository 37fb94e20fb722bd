"""Reward functions the `vlmcp rl` tests name by path (`tests/helpers/rl_rewards.py:NAME`), in
TRL's signature. `parity` gives a group of a "constant" row one reward value (dynamic sampling
must drop it) and rewards the others by the parity of the first answer token (random, so their
groups mostly carry a signal); `hangs` never returns for the row whose answer is "hang"."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def parity(prompts: Sequence[Any], completions: Sequence[Any],
           completion_ids: Sequence[list[int]], kind: Sequence[str], **columns: Any
           ) -> list[float]:
    """1.0 for every answer of a "constant" row; else 1.0 where the first answer token is odd."""
    return [1.0 if k == "constant" else float(ids[0] % 2) for ids, k in zip(completion_ids, kind)]


def hangs(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str],
          **columns: Any) -> list[float]:
    """Sleeps for an hour on the row whose answer is "hang"; else 0.0 per answer."""
    if answer[0] == "hang":
        time.sleep(3600)
    return [0.0 for _ in completions]
