"""The loss terms at their edges, in process (`Loss.shard_loss` on one shard of a text pack,
tests/helpers/loss_cases.py): a term whose global count is 0 contributes 0 and reports no token
metric; a large finite log-ratio (a sentinel logprob, a misaligned array) gives finite losses and
gradients in every objective that exponentiates one, and every result below the bound is the
unbounded formula's bit for bit; opd's importance-weighted form equals its definition."""

from __future__ import annotations

import torch

from tests.helpers.loss_cases import shard_inputs, shard_step, token_arrays, token_batch
from vlmcp.config import LossTerm
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
