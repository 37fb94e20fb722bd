"""The loss terms at their edges, in process (`Loss.shard_loss` on one shard of a text pack,
tests/helpers/loss_cases.py): a term whose global count is 0 contributes 0 and reports no token
metric; a large finite log-ratio (a sentinel logprob, a misaligned array) gives finite losses and
gradients in every objective that exponentiates one, and every result below the bound is the
unbounded formula's bit for bit; opd's importance-weighted form equals its definition."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.loss_cases import shard_inputs, shard_step, token_arrays, token_batch
from vlmcp.config import LossTerm
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.log_ratio import LOG_RATIO_MAX, bounded
from vlmcp.model.loss_terms import Loss
from vlmcp.parallel.shard import ShardPlan
from vlmcp.training.objective_step import StepCounts, objective_metrics

_PPO = dict(clip_low=0.2, clip_high=0.25)


def _without(*names):
    """`token_arrays` with the weight arrays `names` 0 on every token."""
    def arrays(gen, length):
        out = token_arrays(gen, length)
        out.update({name: torch.zeros(length) for name in names})
        return out
    return arrays


def test_a_term_without_targets_in_the_step_contributes_zero_and_reports_no_token_metric():
    # the documented three-term recipe in an RL step without SFT or distillation tokens
    batch = token_batch(arrays=_without("sft_weights", "distill_weights"))
    plan = ShardPlan.build(batch.seq_lens)
    three = Loss((LossTerm("ppo_clip", **_PPO), LossTerm("ce", weights="sft_weights", coef=0.1),
                  LossTerm("opd", weights="distill_weights", normalize="sequence", coef=0.5)))
    counts = three.batch_counts(batch)
    assert counts["tokens1"] == counts["tokens2"] == counts["seqs2"] == 0
    total, stats, grad = shard_step(three, batch, plan, *shard_inputs(batch, plan))
    want_total, _, want_grad = shard_step(Loss(three.terms[:1]), batch, plan,
                                          *shard_inputs(batch, plan))
    assert torch.equal(total, want_total) and torch.equal(grad, want_grad)
    row = objective_metrics(stats, StepCounts(counts, three.denominators(counts)), three)
    assert row["term1_loss"] == row["term2_loss"] == 0.0
    assert not any(key.startswith("term2_") and key != "term2_loss" for key in row)
    assert {"term0_loss", "term0_clip_fraction", "term0_ratio", "entropy"} <= set(row)


#: Per case: the objective, and the sentinel it meets on the pack's first target (sample 0):
#: array -> value there ("logp": the policy's own logprob; "old_logprobs_sample": on every
#: target of sample 0), and whether that token's branch is unselected (its gradient is then 0).
_SENTINELS = {
    "ppo_clip_clipped": (LossTerm("ppo_clip", **_PPO),
                         {"old_logprobs": -100.0, "advantages": 1.5}, True),
    "ppo_clip_dual_clip": (LossTerm("ppo_clip", clip_ratio_c=3.0, **_PPO),
                           {"old_logprobs": -100.0, "advantages": -1.5}, True),
    "ppo_clip_k3": (LossTerm("ppo_clip", kl_coef=0.1, **_PPO),
                    {"logp": -95.0, "ref_logprobs": -1.0, "advantages": 1.0}, False),
    "dppo_dropped": (LossTerm("dppo", kl_tau=0.01),
                     {"logp": -0.5, "inference_logprobs": -100.0, "advantages": 1.5}, False),
    "gspo_clipped": (LossTerm("gspo", normalize="sequence"),
                     {"old_logprobs_sample": -100.0, "advantages_sample": 1.0}, True),
    "cispo": (LossTerm("cispo", **_PPO), {"old_logprobs": -100.0}, False),
    "tis_sequence": (LossTerm("policy_gradient", mismatch="tis", mismatch_level="sequence"),
                     {"inference_logprobs": -100.0}, False),
    "mis_token": (LossTerm("policy_gradient", mismatch="mis"),
                  {"inference_logprobs": -100.0}, True),
}


@pytest.mark.parametrize("name", list(_SENTINELS))
def test_a_large_finite_log_ratio_gives_a_finite_loss_gradient_and_metrics(name):
    term, sentinel, unselected = _SENTINELS[name]
    batch = token_batch()
    plan = ShardPlan.build(batch.seq_lens)
    logp, entropy, keep = shard_inputs(batch, plan)
    is_target = batch.targets != IGNORE_INDEX
    first = int(is_target.nonzero()[0])
    sample0 = torch.zeros_like(is_target)
    sample0[:batch.seq_lens[0]] = True
    for key, value in sentinel.items():
        if key == "logp":
            logp[0] = value
        elif key.endswith("_sample"):
            batch.token_arrays[key.removesuffix("_sample")][sample0 & is_target] = value
        else:
            batch.token_arrays[key][first] = value
    loss = Loss((term,))
    total, stats, grad = shard_step(loss, batch, plan, logp, entropy, keep)
    assert torch.isfinite(total) and torch.isfinite(grad).all() and torch.isfinite(stats).all()
    if unselected:
        assert grad[0] == 0


def test_the_bounded_log_ratio_changes_no_value_or_gradient_whose_exp_was_finite():
    edge = torch.tensor(LOG_RATIO_MAX)
    above = torch.nextafter(edge, torch.tensor(torch.inf))
    assert torch.isfinite(edge.exp()) and torch.isinf(above.exp())
    finite = torch.cat([torch.linspace(-120.0, LOG_RATIO_MAX, 20001), edge[None]])
    x = finite.clone().requires_grad_(True)
    y = finite.clone().requires_grad_(True)
    weights = torch.rand(len(finite))
    (bounded(x).exp() * weights).sum().backward()
    (y.exp() * weights).sum().backward()
    assert torch.equal(bounded(finite).exp(), finite.exp()) and torch.equal(x.grad, y.grad)
    z = torch.tensor([above, 100.0, 1e30]).requires_grad_(True)
    capped = bounded(z).exp()
    capped.sum().backward()
    assert torch.equal(capped, edge.exp().expand(3)) and torch.equal(z.grad, torch.zeros(3))
