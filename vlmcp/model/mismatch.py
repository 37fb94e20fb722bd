"""Train-inference mismatch correction of a policy objective (`loss.mismatch`).

The inference engine's logprob mu (`inference_logprobs`) of a sampled token differs from the
trainer's own of the policy that generated it (`old_logprobs`, recomputed). Per target t, in log
space and fp32: log w_t = old_logprobs_t - inference_logprobs_t, or per sequence (`mismatch_level`
"sequence") log w_i = the sum or the mean (`mismatch_reduce`) of log w_t over the targets of t's
sample i, every target of i then taking w_i. The sums run over the whole sample: both arrays are
data that every rank holds for the whole pack, so no communication is needed. Then the token loss
is multiplied by a weight that is never differentiated:

    tis   min(w, mismatch_cap)                                       (truncated IS)
    mis   w if mismatch_low <= w <= mismatch_high, else 0             (masked IS)

Metrics (per target; the caller sums them over the term's targets): "is_weight" (the weight applied), "is_clamped_fraction"
(tis: w above the cap) or "is_masked_fraction" (mis: w outside the range, "is_masked_low" and
"is_masked_high" each side), and "is_kl", the k3 estimate (w_t - 1) - log w_t of KL(mu || pi_old)
from the token-level w, whatever the level.
"""

from __future__ import annotations

import math

import torch

from vlmcp.config.schema import LossTerm
from vlmcp.model.sample_sums import SampleTargets


def mismatch_metric_keys(term: LossTerm) -> tuple[str, ...]:
    """The metric keys the correction of `term` reports (none when it is off)."""
    if term.mismatch == "none":
        return ()
    sides = ("is_clamped_fraction",) if term.mismatch == "tis" else (
        "is_masked_fraction", "is_masked_low", "is_masked_high")
    return ("is_weight",) + sides + ("is_kl",)


def mismatch_weights(term: LossTerm, old: torch.Tensor, inference: torch.Tensor,
                     whole_old: torch.Tensor, whole_inference: torch.Tensor,
                     samples: SampleTargets) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weight of each of this shard's targets ([N] fp32, no autograd) and the per-target
    metric values ([N] each, `mismatch_metric_keys`).

    old, inference: [N] this shard's old_logprobs and inference_logprobs at its targets;
    whole_old, whole_inference: [N_pack] the same arrays at every target of the pack (for the
    sequence level); samples: the micro-batch's `SampleTargets`.
    """
    with torch.no_grad():
        token_log_w = (old - inference).float()
        if term.mismatch_level == "sequence":
            per_sample = samples.whole_sums(whole_old - whole_inference)
            if term.mismatch_reduce == "mean":
                per_sample = per_sample / samples.counts.clamp_min(1)
            log_w = per_sample.float()[samples.local]
        else:
            log_w = token_log_w
        stats: dict[str, torch.Tensor] = {}
        if term.mismatch == "tis":
            cap = math.log(term.mismatch_cap)
            weight = log_w.clamp(max=cap).exp()
            stats["is_clamped_fraction"] = log_w > cap
        else:
            low = math.log(term.mismatch_low) if term.mismatch_low > 0 else -math.inf
            high = math.log(term.mismatch_high)
            below, above = log_w < low, log_w > high
            weight = torch.where(below | above, torch.zeros_like(log_w), log_w.exp())
            stats.update(is_masked_fraction=below | above, is_masked_low=below,
                         is_masked_high=above)
        stats["is_weight"] = weight
        stats["is_kl"] = token_log_w.exp() - 1.0 - token_log_w
    return weight, stats
