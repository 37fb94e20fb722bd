"""Every objective of docs/losses.md from its definition, on plain transformers' log_softmax, each
sample forwarded alone: the reference of the objective parity tests. It never calls vlmcp's
objective code (it reads only the options of the `LossTerm`s it is given).

`reference_step` returns the step loss, every gradient, the metrics under the names vlmcp's
metrics rows use, and coverage counts (tokens clipped, dropped, clamped or masked on each side)
that the tests assert are not empty. A sample's per-token `temperatures` make its logprobs (and
entropies) those of log_softmax(logits / tau); its `inference_logprobs` add the train-inference
mismatch metrics, whatever the objective.

`float64_truth()` runs a reference in float64 with transformers' gated delta rule (which casts to
fp32 inside) replaced by the token-by-token float64 recurrence of tests/helpers/references.py, for
the duration of the reference only: the value two fp32 computations are both held to.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from transformers.models.qwen3_5 import modeling_qwen3_5

from tests.helpers.parity import RawSample, vision_kwargs
from tests.helpers.references import gated_delta_rule_f64
from vlmcp.config import LossTerm
from vlmcp.data.batch import IGNORE_INDEX

PAIR_TYPES = ("dpo", "ipo", "simpo")


def _delta_rule_f64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=True, **_):
    """transformers' gated delta rule call, for one sequence, computed in float64."""
    if initial_state is not None or not use_qk_l2norm_in_kernel or query.shape[0] != 1:
        raise NotImplementedError("the float64 reference runs one sample from a zero state")
    out, _ = gated_delta_rule_f64(query[0], key[0], value[0], g[0], beta[0],
                                  [query.shape[1]], [None])
    return out[None].to(query.dtype), None


@contextmanager
def float64_truth() -> Iterator[None]:
    """While it lasts, transformers' Qwen3.5 layers run the float64 delta rule (for a model
    converted with .double())."""
    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    modeling_qwen3_5.torch_chunk_gated_delta_rule = _delta_rule_f64
    try:
        yield
    finally:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = original


def forward_alone(model, sample: RawSample) -> torch.Tensor:
    """Logits [L, V] of plain transformers on one sample (its images and videos), batch of one."""
    kwargs = vision_kwargs(sample, model.config)
    for key in ("pixel_values", "pixel_values_videos"):
        if key in kwargs:
            kwargs[key] = kwargs[key].to(model.dtype)
    return model(input_ids=sample.input_ids[None], use_cache=False, **kwargs).logits[0]


def target_logprobs(model, sample: RawSample, temperatures: torch.Tensor | None = None):
    """(logp [n], entropy [n], target positions t: labels[t] != -100, t >= 1); with
    `temperatures` (aligned with labels) of log_softmax(logits / tau)."""
    logits = forward_alone(model, sample)
    positions = [t for t in range(1, len(sample.labels)) if sample.labels[t] != IGNORE_INDEX]
    logits = logits[[t - 1 for t in positions]]
    if temperatures is not None:
        logits = logits / temperatures[positions][:, None].to(logits.dtype)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, sample.labels[positions][:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(1)
    return logp, entropy, positions


@dataclass
class Reference:
    loss: float
    grads: dict[str, torch.Tensor]
    stats: dict[str, float]
    coverage: Counter
    #: The magnitude a metric's rounding scales with where it is not the metric's own (a mean
    #: difference of two arrays: their magnitude).
    scales: dict[str, float] = field(default_factory=dict)


def _bounded(ratio, adv, low, high):
    """The clipped ratio PPO's min picks against: capped above for A > 0, below for A < 0."""
    return torch.where(adv > 0, torch.clamp(ratio, max=1 + high), torch.clamp(ratio, min=1 - low))


def _token_losses(term: LossTerm, logp, a, seq_log_ratio, cover: Counter):
    """(per-token loss [n], per-token metric values) of one token-level term."""
    kind = term.type
    if kind == "ce":
        return -logp, {}
    if kind == "weighted_ce":
        return -a["loss_weights"] * logp, {}
    if kind == "policy_gradient":
        return -a["advantages"] * logp, {}
    if kind == "opd" and term.opd_form == "importance":
        ratio = torch.exp(logp - a["inference_logprobs"])
        losses = -ratio * (a["teacher_logprobs"] - a["inference_logprobs"])
        return losses, {"teacher_kl": (logp - a["teacher_logprobs"]).detach(),
                        "ratio": ratio.detach()}
    if kind == "opd":
        advantage = (a["teacher_logprobs"] - logp).detach()
        return -advantage * logp, {"teacher_kl": (logp - a["teacher_logprobs"]).detach()}
    adv = a["advantages"]
    if kind == "dppo":
        ratio = torch.exp(logp - a["inference_logprobs"])
        gap = logp.detach().exp() - a["inference_logprobs"].exp()
        high = (adv > 0) & (gap > term.delta_high)
        low = (adv < 0) & (gap < -term.delta_low)
        cover.update(dropped_low=int(low.sum()), dropped_high=int(high.sum()),
                     kept=int((~(low | high)).sum()))
        losses = -(~(low | high)).float() * adv * ratio + term.kl_tau * torch.log(ratio) ** 2
        return losses, {"dropped_fraction": (low | high).double(), "dropped_low": low.double(),
                        "dropped_high": high.double(), "ratio": ratio.detach()}
    if kind == "gspo":
        ratio = torch.exp(seq_log_ratio) * torch.exp(logp - logp.detach())
    else:
        ratio = torch.exp(logp - a["old_logprobs"])
    low_side = ratio.detach() < 1 - term.clip_low
    high_side = ratio.detach() > 1 + term.clip_high
    if kind == "cispo":
        cover.update(clip_low=int(low_side.sum()), clip_high=int(high_side.sum()))
        losses = -torch.clamp(ratio, 1 - term.clip_low, 1 + term.clip_high).detach() * adv * logp
        return losses, {"clip_fraction": (low_side | high_side).double(),
                        "clip_low": low_side.double(), "clip_high": high_side.double(),
                        "ratio": ratio.detach(),
                        "approx_kl": ((ratio - 1) - torch.log(ratio)).detach()}
    bounded = _bounded(ratio, adv, term.clip_low, term.clip_high)
    losses = -torch.minimum(ratio * adv, bounded * adv)
    low, high = low_side & (adv < 0), high_side & (adv > 0)
    cover.update(clip_low=int(low.sum()), clip_high=int(high.sum()))
    stats = {"clip_fraction": (low | high).double(), "clip_low": low.double(),
             "clip_high": high.double(), "ratio": ratio.detach()}
    if kind == "gspo":
        return losses, stats
    stats["approx_kl"] = ((ratio - 1) - torch.log(ratio)).detach()
    if term.clip_ratio_c is not None:
        cap = -term.clip_ratio_c * adv
        capped = (adv < 0) & (losses > cap)
        cover.update(dual_clip=int(capped.sum()))
        losses = torch.where(capped, cap, losses)
        stats["dual_clip_fraction"] = capped.double()
    if term.kl_coef > 0:
        d = a["ref_logprobs"] - logp
        k3 = torch.exp(d) - d - 1
        losses = losses + term.kl_coef * k3
        stats["ref_kl"] = k3.detach()
    return losses, stats


def _mismatch(term: LossTerm, a, cover: Counter):
    """(weight [n], per-token metric values) of the mismatch correction, w = pi_old / mu."""
    token_log_w = a["old_logprobs"] - a["inference_logprobs"]
    if term.mismatch_level == "sequence":
        total = token_log_w.double().sum()
        log_w = (total / len(token_log_w) if term.mismatch_reduce == "mean" else total)
        w = torch.full_like(token_log_w, float(torch.exp(log_w)))
    else:
        w = torch.exp(token_log_w)
    stats = {"is_kl": (torch.exp(token_log_w) - 1 - token_log_w)}
    if term.mismatch == "tis":
        clamped = w > term.mismatch_cap
        cover.update(is_clamped=int(clamped.sum()), is_unclamped=int((~clamped).sum()))
        weight = torch.clamp(w, max=term.mismatch_cap)
        stats["is_clamped_fraction"] = clamped.double()
    else:
        low, high = w < term.mismatch_low, w > term.mismatch_high
        cover.update(is_masked_low=int(low.sum()), is_masked_high=int(high.sum()),
                     is_kept=int((~(low | high)).sum()))
        weight = w * (~(low | high)).float()
        stats.update(is_masked_fraction=(low | high).double(), is_masked_low=low.double(),
                     is_masked_high=high.double())
    stats["is_weight"] = weight
    return weight, stats


def _weights(term: LossTerm, a, n: int) -> torch.Tensor:
    return a[term.weights] if term.weights is not None else torch.ones(n)


def reference_step(model, samples: list[RawSample], arrays: list[dict[str, torch.Tensor]],
                   terms: list[LossTerm]) -> Reference:
    """The step of the token-level `terms` (arrays aligned with labels, one dict per sample):
    sum_k coef_k (sum_t c_kt l_kt) / N_k with N_k from the definitions, its gradients and
    metrics."""
    model = copy.deepcopy(model)
    picked = []
    for sample, sample_arrays in zip(samples, arrays):
        positions = [t for t in range(1, len(sample.labels)) if sample.labels[t] != IGNORE_INDEX]
        picked.append({k: v[positions] for k, v in sample_arrays.items()})
    n_targets = sum(len(next(iter(p.values()))) for p in picked)
    denominators, tokens = [], []
    for term in terms:
        nonzero = [int((_weights(term, p, len(p["advantages"])) != 0).sum()) for p in picked]
        tokens.append(sum(nonzero))
        denominators.append({"token": sum(nonzero), "sequence": sum(n > 0 for n in nonzero),
                             "constant": term.normalize_constant}[term.normalize])
    sums = Counter()
    cover = Counter()
    mismatch = Counter()
    total = 0.0
    for sample, a, sample_arrays in zip(samples, picked, arrays):
        logp, entropy, _ = target_logprobs(model, sample, sample_arrays.get("temperatures"))
        sums["entropy"] += float(entropy.detach().sum())
        if "inference_logprobs" in a:
            mu = a["inference_logprobs"].double()
            d = logp.detach().double() - mu
            mismatch.update(diff=float(-d.sum()), kl=float((torch.exp(d) - 1 - d).sum()),
                            targets=len(d), size=float(mu.abs().sum()))
        step = 0.0
        for k, term in enumerate(terms):
            seq_log_ratio = (logp.detach() - a["old_logprobs"]).mean() if term.type == "gspo" \
                else None
            losses, stats = _token_losses(term, logp, a, seq_log_ratio, cover)
            if term.mismatch != "none":
                weight, more = _mismatch(term, a, cover)
                losses = losses * weight
                stats.update(more)
            w = _weights(term, a, len(logp))
            weighted = int((w != 0).sum())
            c = w / max(weighted, 1) if term.normalize == "sequence" else w
            term_sum = (c * losses).sum()
            step = step + term.coef * term_sum / denominators[k]
            prefix = "" if len(terms) == 1 else f"term{k}_"
            if prefix:
                sums[f"term{k}_loss"] += float(term_sum.detach()) / denominators[k]
            for key, values in stats.items():
                sums[prefix + key] += float((values.double() * (w != 0)).sum()) / tokens[k]
        step.backward()
        total += float(step.detach())
    sums["entropy"] /= n_targets
    scales = {}
    if mismatch["targets"]:
        sums.update(mismatch_logprob_diff=mismatch["diff"] / mismatch["targets"],
                    mismatch_kl=mismatch["kl"] / mismatch["targets"],
                    mismatch_targets=mismatch["targets"])
        # mu - logp cancels: its rounding scales with the logprobs' size, not the difference's
        scales["mismatch_logprob_diff"] = mismatch["size"] / mismatch["targets"]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Reference(total, grads, dict(sums), cover, scales)


def reference_pairs(model, pairs: list[tuple[RawSample, RawSample]],
                    reference: list[tuple[float, float]], term: LossTerm) -> Reference:
    """The step of a preference objective over `pairs` (each half forwarded alone): the mean
    over pairs of its loss, from the definitions, with TRL's metrics."""
    model = copy.deepcopy(model)
    beta = term.beta
    sums = Counter()
    scales = Counter()
    total = 0.0
    n_targets = 0
    for (chosen, rejected), (ref_c, ref_r) in zip(pairs, reference):
        logp_c, entropy_c, _ = target_logprobs(model, chosen)
        logp_r, entropy_r, _ = target_logprobs(model, rejected)
        sums["entropy"] += float((entropy_c.sum() + entropy_r.sum()).detach())
        n_targets += len(logp_c) + len(logp_r)
        s_c, s_r = logp_c.double().sum(), logp_r.double().sum()
        if term.type == "simpo":
            reward_c, reward_r = beta * s_c / len(logp_c), beta * s_r / len(logp_r)
            loss = -F.logsigmoid(reward_c - reward_r - term.gamma)
        else:
            reward_c, reward_r = beta * (s_c - ref_c), beta * (s_r - ref_r)
            h = reward_c - reward_r
            loss = -F.logsigmoid(h) if term.type == "dpo" else (h / beta - 1 / (2 * beta)) ** 2
            # beta * (s - ref) cancels: its rounding scales with the logprob sums, not the reward
            size_c = beta * (abs(float(s_c)) + abs(float(ref_c)))
            size_r = beta * (abs(float(s_r)) + abs(float(ref_r)))
            scales["rewards/chosen"] += size_c / len(pairs)
            scales["rewards/rejected"] += size_r / len(pairs)
            scales["rewards/margins"] += (size_c + size_r) / len(pairs)
        (loss / len(pairs)).backward()
        total += float(loss.detach()) / len(pairs)
        for key, value in (("rewards/chosen", reward_c), ("rewards/rejected", reward_r),
                           ("rewards/accuracies", (reward_c > reward_r).double()),
                           ("rewards/margins", reward_c - reward_r), ("logps/chosen", s_c),
                           ("logps/rejected", s_r)):
            sums[key] += float(value.detach()) / len(pairs)
    sums["entropy"] /= n_targets
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Reference(total, grads, dict(sums), Counter(), dict(scales))
