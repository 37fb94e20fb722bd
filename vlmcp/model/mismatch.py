"""Train-inference mismatch: the correction of a policy objective (`loss.mismatch`), and the
mismatch metrics of any objective on data with `inference_logprobs`.

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
from the token-level w, whatever the level (log w_t capped where fp32's exp overflows,
`model.log_ratio.bounded`).

Mismatch metrics (`mismatch_sums`, whatever the objective and its correction): how far mu lies
from the trainer's current logprob logp (at the same per-token temperature). Per target token
whose mu is finite (a pack fills NaN in for samples without the array, `data.batch.ARRAY_FILL`),
with d_t = logp_t - mu_t: the shard's sums of mu_t - logp_t ("mismatch_logprob_diff") and of
k3_t = exp(d_t) - 1 - d_t ("mismatch_kl": Schulman's k3 estimate of KL(mu || pi) from tokens
that mu sampled, >= 0; PrimeRL's "mismatch KL"). The trainer divides both by the step's global
count of those tokens ("mismatch_targets", `model.loss_terms`). Computed in float64 from the fp32
logprobs, so that the k3 of a tiny d (about d^2 / 2) is not rounded away as fp32's exp(d) - 1
would. No autograd.
"""

from __future__ import annotations

import math

import torch

from vlmcp.config.schema import LossTerm
from vlmcp.model.log_ratio import bounded
from vlmcp.model.sample_sums import SampleTargets

#: The metric sums `mismatch_sums` returns, in order.
MISMATCH_KEYS = ("mismatch_logprob_diff", "mismatch_kl")
#: The count key they are divided by: the step's targets with a finite inference logprob.
MISMATCH_COUNT = "mismatch_targets"


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

    old, inference: [N] this shard's old_logprobs and inference_logprobs at its targets, on the
    model's device (that of samples.local; the weight and metrics come out there);
    whole_old, whole_inference: [N_pack] the same arrays at every target of the pack (for the
    sequence level), on any device (the batch's host tensors); samples: the micro-batch's
    `SampleTargets`.
    """
    with torch.no_grad():
        token_log_w = (old - inference).float()
        if term.mismatch_level == "sequence":
            # the whole-pack arrays are host data: the per-sample sums are taken there, then
            # moved to the device of this shard's targets (samples.local) before indexing
            per_sample = samples.whole_sums(whole_old - whole_inference)
            if term.mismatch_reduce == "mean":
                per_sample = per_sample / samples.counts.to(per_sample.device).clamp_min(1)
            log_w = per_sample.float().to(old.device)[samples.local]
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
        bounded_log_w = bounded(token_log_w)
        stats["is_kl"] = bounded_log_w.exp() - 1.0 - bounded_log_w
    return weight, stats


def mismatch_sums(logp: torch.Tensor, inference_logprobs: torch.Tensor | None) -> torch.Tensor:
    """[2] float64 (`MISMATCH_KEYS`): the sums of (mu - logp) and of k3 over this shard's targets
    with a finite mu (zeros without the array).

    logp: [N] the trainer's logprobs of one shard's targets; inference_logprobs: [N] mu at the
    same targets (NaN where the data gives none), or None when the pack has none.
    """
    with torch.no_grad():
        if inference_logprobs is None:
            return torch.zeros(len(MISMATCH_KEYS), dtype=torch.float64)
        mu = inference_logprobs.detach().double()
        present = torch.isfinite(mu)
        d = logp.detach().double()[present] - mu[present]
        return torch.stack([(-d).sum(), (torch.expm1(d) - d).sum()]).cpu()


def mismatch_count(inference_logprobs: torch.Tensor | None) -> int:
    """The targets with a finite mu, given the array at a pack's (or a shard's) targets."""
    return 0 if inference_logprobs is None else int(torch.isfinite(inference_logprobs).sum())
