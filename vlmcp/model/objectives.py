"""Token-level objectives (`loss.type`) as functions of per-token logprobs and per-token data.

Legend: N = target tokens of one shard (positions whose target is not IGNORE_INDEX), in order;
logp [N] = log pi(y_t) under the current policy (`model.token_logprobs`); the per-token arrays of
the data (`loss_weights` w, `advantages` A, `old_logprobs`, `ref_logprobs`), each [N], are the
entries aligned with those targets.

Per-token loss l_t:
    ce               -logp
    weighted_ce      -w_t * logp
    policy_gradient  -A_t * logp
    ppo_clip         -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
                     + kl_coef * k3_t,   r_t = exp(logp - old_logprobs)
                     with k3_t = exp(ref - logp) - (ref - logp) - 1 (Schulman's k3 estimator of
                     KL(pi || pi_ref), >= 0) when kl_coef > 0.

Normalisation (`loss.normalize`): the step's loss is sum_t c_t l_t / D. `token`: c_t = 1 and D the
global number of target tokens (over SP, DP and accumulation), as for plain CE. `sequence`: c_t =
1 / (targets of t's sample), counted on the whole sample in the pack (never on the shard), and D
the global number of samples of the step (over DP and accumulation); so each sample's token mean
enters the mean over samples.

Metrics (sums over target tokens here; the loop divides by the global target count): the mean
entropy of the policy on target tokens, and for ppo_clip the clipped fraction (tokens where the
clipped term is the smaller one, so their gradient is zero), the mean ratio r, the approximate
KL to the old policy, mean of (r - 1) - log r (k3 again, >= 0), and with kl_coef the mean k3 to
the reference. Whatever the objective, data with `inference_logprobs` adds the train-inference
mismatch sums (`model.mismatch`, divided by their own token count).

logp is at each token's sampling temperature when the data gives `temperatures`
(`model.token_logprobs`): log_softmax(logits / tau).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.model.mismatch import MISMATCH_KEYS

OBJECTIVES = ("ce", "weighted_ce", "policy_gradient", "ppo_clip")
NORMALIZATIONS = ("token", "sequence")
#: Order of the per-shard metric sums `Objective.token_losses` returns (over target tokens; the
#: mismatch sums, `model.mismatch`, over the targets with an inference logprob).
STAT_KEYS = ("entropy", "clip_fraction", "ratio", "approx_kl", "ref_kl", *MISMATCH_KEYS)
#: Metric keys that only `ppo_clip` reports (`ref_kl` only with kl_coef > 0).
PPO_KEYS = ("clip_fraction", "ratio", "approx_kl")


@dataclass(frozen=True)
class Objective:
    """The `loss` job section: which objective, its normalisation and ppo_clip's constants."""

    type: str = "ce"
    normalize: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.type not in OBJECTIVES:
            raise ValueError(f"loss.type must be one of {list(OBJECTIVES)}, got {self.type!r}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"loss.normalize must be one of {list(NORMALIZATIONS)}, "
                             f"got {self.normalize!r}")

    @property
    def plain_ce(self) -> bool:
        """Today's loss (CE, token mean): computed by the fused CE sum, bit for bit as before."""
        return self.type == "ce" and self.normalize == "token"

    @property
    def required_arrays(self) -> tuple[str, ...]:
        """The per-token arrays every training sample must carry for this objective."""
        needs = {"ce": (), "weighted_ce": ("loss_weights",), "policy_gradient": ("advantages",),
                 "ppo_clip": ("advantages", "old_logprobs")}[self.type]
        if self.type == "ppo_clip" and self.kl_coef > 0:
            needs += ("ref_logprobs",)
        return needs

    def metric_keys(self) -> tuple[str, ...]:
        """The STAT_KEYS this objective reports."""
        keys = ("entropy",)
        if self.type == "ppo_clip":
            keys += PPO_KEYS + (("ref_kl",) if self.kl_coef > 0 else ())
        return keys

    def token_losses(self, logp: torch.Tensor, arrays: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token losses l_t ([N] fp32, differentiable through logp) and the metric sums
        ([len(STAT_KEYS)] float64, entropy left 0: the caller adds it).

        arrays: the `required_arrays`, each [N] fp32 at the target positions.
        """
        stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        if self.type == "ce":
            return -logp, stats
        if self.type == "weighted_ce":
            return -arrays["loss_weights"] * logp, stats
        advantages = arrays["advantages"]
        if self.type == "policy_gradient":
            return -advantages * logp, stats
        log_ratio = logp - arrays["old_logprobs"]
        ratio = log_ratio.exp()
        unclipped = ratio * advantages
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * advantages
        losses = -torch.minimum(unclipped, clipped)
        with torch.no_grad():
            stats[1] = float((clipped < unclipped).sum())
            stats[2] = float(ratio.double().sum())
            stats[3] = float(((ratio - 1.0) - log_ratio).double().sum())
        if self.kl_coef > 0:
            ref_diff = arrays["ref_logprobs"] - logp
            k3 = ref_diff.exp() - ref_diff - 1.0
            losses = losses + self.kl_coef * k3
            stats[4] = float(k3.detach().double().sum())
        return losses, stats


def sequence_weights(batch: PackedBatch) -> torch.Tensor:
    """[S] fp32: 1 / (number of targets of the sample) on every position of each sample (0 for a
    sample without targets), from the whole pack's targets."""
    weights = []
    for part in batch.targets.split(batch.seq_lens):
        count = int((part != IGNORE_INDEX).sum())
        weights.append(torch.full((len(part),), 1.0 / count if count else 0.0))
    return torch.cat(weights)
