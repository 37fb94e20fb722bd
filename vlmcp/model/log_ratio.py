"""The exp of an fp32 log-ratio that cannot overflow.

An objective's ratio exp(logp - old_logprobs) (or against inference_logprobs, a reference or a
sequence mean) overflows to inf once the log-ratio passes 88.72: one sentinel logprob (-100) or
a misaligned array does it. Where the branch holding the ratio is not selected (ppo_clip's
clipped side, the dual clip, a token dppo drops), the forward or autograd's exp backward then
computes 0 * inf = NaN and spoils the whole step. `bounded` caps the log-ratio at
`LOG_RATIO_MAX`, the largest fp32 whose exp is finite: every log-ratio whose exp was finite keeps
its value and its gradient bit for bit; above it the exp takes fp32's largest power of e and no
gradient flows through the cap.
"""

from __future__ import annotations

import torch

#: The largest fp32 whose exp is finite in fp32: ln of fp32's largest value (88.7228391)
#: rounded down to fp32; the next fp32 (88.7228394) overflows.
LOG_RATIO_MAX = 88.72283172607422


def bounded(log_ratio: torch.Tensor) -> torch.Tensor:
    """`log_ratio` (fp32, any shape) capped at `LOG_RATIO_MAX`: its exp is finite, and equals
    exp(log_ratio), gradient included, wherever that was finite."""
    return log_ratio.clamp(max=LOG_RATIO_MAX)
