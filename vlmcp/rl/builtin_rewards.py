"""The built-in rewards of `rl.rewards`, in TRL's reward-function signature.

    exact_match   1.0 when the answer's text, stripped, is the row's "answer" column, stripped
    math          1.0 when math-verify finds the answer's final expression equal to the row's
                  "answer" (its gold parsed the same way), else 0.0

Each takes `prompts`, `completions` (strings, or one-message lists for conversational prompts) and
the row's columns as lists, one entry per answer, and returns one float per answer. A row without
an "answer" column is an error naming the reward. `math` needs the optional `math-verify`
package (`pip install 'vlmcp[rl]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def completion_text(completion: Any) -> str:
    """The text of one completion as TRL passes it: a string, or [{"role", "content"}]."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def _answers(kwargs: dict[str, Any], name: str) -> Sequence[Any]:
    if "answer" not in kwargs:
        raise ValueError(f"the built-in reward {name!r} compares with the prompts' \"answer\" "
                         f"column, which they lack (columns: {sorted(kwargs)})")
    return kwargs["answer"]


def exact_match(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
                ) -> list[float]:
    """1.0 where the completion's text, stripped, equals the answer column's, stripped."""
    return [float(completion_text(c).strip() == str(a).strip())
            for c, a in zip(completions, _answers(kwargs, "exact_match"))]


def math(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where math-verify verifies the completion's answer against the answer column."""
    from math_verify import parse, verify

    rewards = []
    for completion, answer in zip(completions, _answers(kwargs, "math")):
        gold = parse(str(answer))
        rewards.append(float(bool(gold) and verify(gold, parse(completion_text(completion)))))
    return rewards


BUILTINS = {"exact_match": exact_match, "math": math}
