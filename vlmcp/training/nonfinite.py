"""What a step whose loss or gradient norm is not finite does: `train.nonfinite`.

Such a step never reaches the weights: DeepSpeed's ZeRO 1-3 and bf16/fp16 optimizers check the
gradients for NaN/Inf before applying a step and skip it ("OVERFLOW!"), and on ZeRO-0 fp32 the
loop vetoes the step from its own gradient norm (`optim._VetoableStep`). A DeepSpeed-built
optimizer (a config's optimizer block) cannot be vetoed there: `skip` is refused for it at
validate, and `abort` stops after the step reached the weights. Every rank sees the
same verdict (the norm is of the all-reduced gradients; the skip flag and the loss are
all-reduced with the step's sums).

`abort` (the default) stops the run at the first such step; `skip` goes on, and aborts once
`train.max_skipped_steps` steps in a row were not finite.
"""

from __future__ import annotations

import math
from typing import Any


def nonfinite_keys(row: dict[str, Any]) -> list[str]:
    """The keys of a training row that make its step non-finite."""
    bad = [k for k in ("loss", "grad_norm")
           if isinstance(row.get(k), float) and not math.isfinite(row[k])]
    if row.get("skipped_step") and not bad:
        bad.append("gradients")
    return bad


class NonFiniteGuard:
    """Counts non-finite steps in a row and decides: go on, skip, or abort."""

    def __init__(self, mode: str, max_skipped_steps: int):
        self.mode = mode
        self.max_skipped_steps = max_skipped_steps
        self.in_a_row = 0

    def check(self, row: dict[str, Any]) -> str | None:
        """None for a finite step; else one line describing it (counted)."""
        bad = nonfinite_keys(row)
        if not bad:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        values = ", ".join(f"{k}={row[k]}" for k in bad if k in row)
        applied = "not applied" if row.get("skipped_step") else "APPLIED"
        return f"step {row['step']}: non-finite {' and '.join(bad)} ({values}); the optimizer " \
               f"step was {applied}"

    def must_abort(self) -> bool:
        """After a non-finite step: whether the run stops now."""
        return self.mode == "abort" or self.in_a_row > self.max_skipped_steps
