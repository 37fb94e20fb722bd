"""Group-relative advantages (`rl.advantage`), one per answer of a prompt's group of G answers.

With rewards r_1..r_G of one group, mean m = (1/G) sum r_j:

    grpo      A_i = (r_i - m) / (s + EPS), s the sample standard deviation of the group
              (sqrt(sum (r_j - m)^2 / (G - 1)), as TRL and verl compute it)
    dr_grpo   A_i = r_i - m  (Dr. GRPO: no division by the std, which up-weights groups whose
              answers barely differ)
    rloo      A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j = G / (G - 1) (r_i - m)  (REINFORCE
              leave-one-out: the baseline excludes the answer itself)

Every answer's tokens carry its A_i. A group whose rewards are all equal has A_i = 0 under
each estimator: it carries no signal (`rl.dynamic_sampling` drops it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Added to grpo's standard deviation (verl's epsilon), so that a tiny spread stays finite.
EPS = 1e-6


def group_advantages(rewards: Sequence[float], estimator: str) -> list[float]:
    """The advantages of one group's `rewards` (at least 2) under `estimator` (see the module
    docstring)."""
    count = len(rewards)
    if count < 2:
        raise ValueError("a group needs at least two answers")
    mean = math.fsum(rewards) / count
    if estimator == "dr_grpo":
        return [r - mean for r in rewards]
    if estimator == "rloo":
        return [count / (count - 1) * (r - mean) for r in rewards]
    if estimator == "grpo":
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (count - 1))
        return [(r - mean) / (std + EPS) for r in rewards]
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def carries_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's answers got more than one reward value."""
    return len(set(rewards)) > 1
