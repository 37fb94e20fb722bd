"""Token-level objectives (`loss.type`) as functions of per-token logprobs and per-token data.

Legend: N = target tokens of one shard (positions whose target is not IGNORE_INDEX), in order;
logp [N] = log pi(y_t) under the current policy (`model.token_logprobs`); the per-token arrays of
the data, each [N], are the entries aligned with those targets: loss_weights w, advantages A,
old_logprobs (the generating policy, recomputed by the trainer), inference_logprobs mu (the
inference engine's), ref_logprobs, teacher_logprobs. Ratios are taken in log space, in fp32;
sg() is stop-gradient. Every exp of a log-ratio (r_t, k3_t, s_i, and their metrics) takes the
log-ratio capped where fp32's exp overflows (`model.log_ratio.bounded`): unchanged, gradient
included, wherever the exp was finite, and no NaN from a branch that is not selected.

Per-token loss l_t:
    ce               -logp
    weighted_ce      -w_t logp
    policy_gradient  -A_t logp
    ppo_clip         -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),
                     r_t = exp(logp - old_logprobs); with clip_ratio_c (dual clip), a token with
                     A_t < 0 loses at most -clip_ratio_c A_t; + kl_coef k3_t with
                     k3_t = exp(ref - logp) - (ref - logp) - 1 (Schulman's k3 estimator of
                     KL(pi || pi_ref), >= 0) when kl_coef > 0
    cispo            -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp
    gspo             -min(s_it A_t, clip(s_it, 1 - clip_low, 1 + clip_high) A_t),
                     s_it = sg(s_i) exp(logp - sg(logp)) (value s_i, gradient s_i d logp),
                     s_i = exp(mean over the targets of t's whole sample of (logp - old_logprobs))
                     (`sequence_log_ratio`, reduced over the SP group by model.sample_sums)
    dppo             -keep_t A_t r_t + kl_tau (log r_t)^2, r_t = exp(logp - mu_t); a token is
                     dropped (keep_t = 0) when A_t > 0 and exp(logp) - exp(mu_t) > delta_high,
                     or A_t < 0 and exp(logp) - exp(mu_t) < -delta_low
    opd              -sg(teacher_logprobs - logp) logp (on-policy distillation: the per-token
                     advantage is the reverse-KL reward, in the policy-gradient form); with
                     opd_form "importance" -r_t (teacher_logprobs - mu_t), r_t = exp(logp - mu_t)
                     (Thinking Machines' off-policy form: the tokens mu sampled, importance-
                     weighted to pi, the advantage taken at the sampler; its gradient is the
                     on-policy form's where pi = mu)

The policy objectives (config.loss_checks.POLICY_OBJECTIVES) may be multiplied by a train-inference
mismatch weight (`loss.mismatch`, model.mismatch; config.loss_checks refuses it on dppo and on
opd's importance form, whose ratios are already against mu). Normalisation and several terms:
model.loss_terms. Preference objectives (dpo, ipo, simpo): model.pair_objectives.

Metrics (per target; the caller sums them over the term's targets and divides by their global
count): ppo_clip "clip_fraction" (tokens whose clipped term is the smaller one, so their gradient
is zero; "clip_low" and "clip_high" each side), "ratio" (r), "approx_kl" ((r - 1) - log r, k3 of
KL(pi_old || pi)), "dual_clip_fraction" with clip_ratio_c, "ref_kl" (k3) with kl_coef; cispo
"clip_fraction" (r outside the range, "clip_low" / "clip_high"), "ratio", "approx_kl"; gspo
"clip_fraction", "clip_low", "clip_high", "ratio" (s_i); dppo "dropped_fraction"
("dropped_low" for A < 0, "dropped_high" for A > 0), "ratio" (r against mu); opd "teacher_kl"
(logp - teacher_logprobs, the k1 estimate of KL(pi || teacher)), and "ratio" (r against mu)
with opd_form "importance".

logp is at each token's sampling temperature when the data gives `temperatures`
(`model.token_logprobs`): log_softmax(logits / tau).
"""

from __future__ import annotations

import torch

from vlmcp.config.loss_checks import POLICY_OBJECTIVES
from vlmcp.config.schema import LossTerm
from vlmcp.model.log_ratio import bounded
from vlmcp.model.mismatch import mismatch_metric_keys

_CLIP_KEYS = ("clip_fraction", "clip_low", "clip_high")
#: The per-token metrics each token-level objective reports.
_METRICS = {
    "ce": (), "weighted_ce": (), "policy_gradient": (),
    "ppo_clip": _CLIP_KEYS + ("ratio", "approx_kl"),
    "cispo": _CLIP_KEYS + ("ratio", "approx_kl"),
    "gspo": _CLIP_KEYS + ("ratio",),
    "dppo": ("dropped_fraction", "dropped_low", "dropped_high", "ratio"),
    "opd": ("teacher_kl",),
}
_ARRAYS = {
    "ce": (), "weighted_ce": ("loss_weights",), "policy_gradient": ("advantages",),
    "ppo_clip": ("advantages", "old_logprobs"), "cispo": ("advantages", "old_logprobs"),
    "gspo": ("advantages", "old_logprobs"), "dppo": ("advantages", "inference_logprobs"),
    "opd": ("teacher_logprobs",),
}


def required_arrays(term: LossTerm) -> tuple[str, ...]:
    """The per-token arrays every training sample must carry for `term` (its own weight array
    included), each named once."""
    needs = list(_ARRAYS[term.type])
    if term.type == "ppo_clip" and term.kl_coef > 0:
        needs.append("ref_logprobs")
    if term.type == "opd" and term.opd_form == "importance":
        needs.append("inference_logprobs")
    if term.mismatch != "none":
        needs += ["old_logprobs", "inference_logprobs"]
    if term.weights is not None:
        needs.append(term.weights)
    return tuple(dict.fromkeys(needs))


def metric_keys(term: LossTerm) -> tuple[str, ...]:
    """The per-token metrics `term` reports (`token_losses`, then the mismatch correction's)."""
    keys = _METRICS[term.type]
    if term.type == "ppo_clip" and term.clip_ratio_c is not None:
        keys += ("dual_clip_fraction",)
    if term.type == "ppo_clip" and term.kl_coef > 0:
        keys += ("ref_kl",)
    if term.type == "opd" and term.opd_form == "importance":
        keys += ("ratio",)
    if term.type in POLICY_OBJECTIVES:
        keys += mismatch_metric_keys(term)
    return keys


def uses_sequence_ratio(term: LossTerm) -> bool:
    """Whether `term` needs `sequence_log_ratio`'s per-sample sums (gspo)."""
    return term.type == "gspo"


def sequence_log_ratio_column(logp: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-token column gspo sums over each whole sample: logp - old_logprobs, [N] -> [N]
    (no autograd)."""
    return (logp.detach() - arrays["old_logprobs"]).float()


def _clip_sides(ratio: torch.Tensor, advantages: torch.Tensor, term: LossTerm
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clipped ratio, below the range with A < 0, above it with A > 0): the tokens whose
    clipped surrogate term is the smaller one."""
    clipped = ratio.clamp(1.0 - term.clip_low, 1.0 + term.clip_high)
    low = (ratio < 1.0 - term.clip_low) & (advantages < 0)
    high = (ratio > 1.0 + term.clip_high) & (advantages > 0)
    return clipped, low, high


def _clip_stats(low: torch.Tensor, high: torch.Tensor, ratio: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    return {"clip_fraction": low | high, "clip_low": low, "clip_high": high,
            "ratio": ratio.detach()}


def token_losses(term: LossTerm, logp: torch.Tensor, arrays: dict[str, torch.Tensor],
                 sequence_log_ratio: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses l_t ([N] fp32, differentiable through logp) and the per-token metric
    values ([N] each, `metric_keys` without the mismatch correction's).

    arrays: the `required_arrays`, each [N] fp32 at the target positions; sequence_log_ratio:
    gspo's log s_i at each target ([N], no autograd).
    """
    kind = term.type
    if kind == "ce":
        return -logp, {}
    if kind == "weighted_ce":
        return -arrays["loss_weights"] * logp, {}
    if kind == "opd" and term.opd_form == "importance":
        mu = arrays["inference_logprobs"]
        ratio = bounded(logp - mu).exp()
        return -ratio * (arrays["teacher_logprobs"] - mu), {
            "teacher_kl": (logp - arrays["teacher_logprobs"]).detach(), "ratio": ratio.detach()}
    if kind == "opd":
        reward = (arrays["teacher_logprobs"] - logp).detach()
        return -reward * logp, {"teacher_kl": -reward}
    advantages = arrays.get("advantages")
    if kind == "policy_gradient":
        return -advantages * logp, {}
    if kind == "dppo":
        return _dppo(term, logp, advantages, arrays["inference_logprobs"])
    if kind == "gspo":
        return _gspo(term, logp, advantages, sequence_log_ratio)
    log_ratio = bounded(logp - arrays["old_logprobs"])
    ratio = log_ratio.exp()
    approx_kl = ((ratio - 1.0) - log_ratio).detach()
    if kind == "cispo":
        clipped = ratio.clamp(1.0 - term.clip_low, 1.0 + term.clip_high)
        stats = _clip_stats(ratio < 1.0 - term.clip_low, ratio > 1.0 + term.clip_high, ratio)
        return -clipped.detach() * advantages * logp, {**stats, "approx_kl": approx_kl}
    clipped, low, high = _clip_sides(ratio, advantages, term)
    stats = {**_clip_stats(low, high, ratio), "approx_kl": approx_kl}
    losses = -torch.minimum(ratio * advantages, clipped * advantages)
    if term.clip_ratio_c is not None:
        cap = -term.clip_ratio_c * advantages
        capped = (advantages < 0) & (losses > cap)
        losses = torch.where(capped, cap, losses)
        stats["dual_clip_fraction"] = capped
    if term.kl_coef > 0:
        ref_diff = bounded(arrays["ref_logprobs"] - logp)
        k3 = ref_diff.exp() - ref_diff - 1.0
        losses = losses + term.kl_coef * k3
        stats["ref_kl"] = k3.detach()
    return losses, stats


def _gspo(term: LossTerm, logp: torch.Tensor, advantages: torch.Tensor,
          sequence_log_ratio: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = bounded(sequence_log_ratio).exp() * (logp - logp.detach()).exp()
    clipped, low, high = _clip_sides(ratio, advantages, term)
    losses = -torch.minimum(ratio * advantages, clipped * advantages)
    return losses, _clip_stats(low, high, ratio)


def _dppo(term: LossTerm, logp: torch.Tensor, advantages: torch.Tensor, inference: torch.Tensor
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = logp - inference
    ratio = bounded(log_ratio).exp()
    with torch.no_grad():
        gap = logp.exp() - inference.exp()
        high = (advantages > 0) & (gap > term.delta_high)
        low = (advantages < 0) & (gap < -term.delta_low)
        keep = (~(high | low)).float()
    losses = -keep * advantages * ratio + term.kl_tau * log_ratio.square()
    return losses, {"dropped_fraction": high | low, "dropped_low": low, "dropped_high": high,
                    "ratio": ratio.detach()}
