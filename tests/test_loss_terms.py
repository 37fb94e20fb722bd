"""The loss terms at their edges, in process (`Loss.shard_loss` on one shard of a text pack,
tests/helpers/loss_cases.py): a term whose global count is 0 contributes 0 and reports no token
metric; a large finite log-ratio (a sentinel logprob, a misaligned array) gives finite losses and
gradients in every objective that exponentiates one, and every result below the bound is the
unbounded formula's bit for bit; opd's importance-weighted form equals its definition."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.loss_cases import (PPO_CLIP, SENTINELS, sentinel_step, shard_inputs,
                                      shard_step, token_arrays, token_batch)
from vlmcp.config import LossTerm
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.log_ratio import LOG_RATIO_MAX, bounded
from vlmcp.model.loss_terms import Loss
from vlmcp.parallel.shard import ShardPlan
from vlmcp.training.objective_step import StepCounts, objective_metrics


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
    three = Loss((LossTerm("ppo_clip", **PPO_CLIP), LossTerm("ce", weights="sft_weights", coef=0.1),
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


@pytest.mark.parametrize("name", list(SENTINELS))
def test_a_large_finite_log_ratio_gives_a_finite_loss_gradient_and_metrics(name):
    total, stats, grad = sentinel_step(name)
    assert torch.isfinite(total) and torch.isfinite(grad).all() and torch.isfinite(stats).all()
    if SENTINELS[name][2]:
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


def test_importance_weighted_opd_equals_its_definition_and_the_on_policy_form_where_pi_is_mu():
    batch = token_batch()
    plan = ShardPlan.build(batch.seq_lens)
    logp, entropy, keep = shard_inputs(batch, plan)
    is_target = batch.targets != IGNORE_INDEX
    loss = Loss((LossTerm("opd", opd_form="importance"),))
    total, stats, grad = shard_step(loss, batch, plan, logp, entropy, keep)
    # the definition, in float64: -(pi / mu) (teacher - mu), the mean over the step's targets
    mu = batch.token_arrays["inference_logprobs"][is_target].double()
    teacher = batch.token_arrays["teacher_logprobs"][is_target].double()
    x = logp.double().requires_grad_(True)
    want = (-(x - mu).exp() * (teacher - mu)).sum() / len(x)
    want.backward()
    assert torch.allclose(total.double(), want, rtol=1e-6, atol=0)
    assert torch.allclose(grad.double(), x.grad, rtol=1e-6, atol=1e-9)
    keys = [key for key, _ in loss.stat_specs()]
    assert torch.allclose(stats[keys.index("ratio")], (x - mu).exp().sum().detach(), rtol=1e-6)
    assert torch.allclose(stats[keys.index("teacher_kl")], (x - teacher).sum().detach(),
                          rtol=1e-6)
    # on the policy's own samples (mu = pi) its gradient is the on-policy form's
    batch.token_arrays["inference_logprobs"][is_target] = logp
    on_policy = shard_step(Loss((LossTerm("opd"),)), batch, plan, logp, entropy, keep)[2]
    assert torch.allclose(shard_step(loss, batch, plan, logp, entropy, keep)[2], on_policy,
                          rtol=1e-6, atol=0)
