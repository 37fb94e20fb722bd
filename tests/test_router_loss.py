"""The MoE router load-balancing loss on one rank (SP = 1): a packed forward+backward of
CE / N + router_aux_loss_coef x aux equals plain transformers (CE of each sample alone, aux of the
pack's samples batched and right-padded with an attention mask) in fp32 within rel 1e-5 of plain
transformers in float64 (or within fp32's own error of it where that is larger,
`assert_within_fp32_error`), also under activation checkpointing. A dense checkpoint with
`model.router_aux_loss` is an error naming the key (also in `vlmcp validate`); without it, the
warning about `output_router_logits` stays. `vlmcp train` reports the router loss beside an
unchanged LM loss. (SP = 2 and 4, DP and gradient
accumulation: tests/test_sp_parity.py.)"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, write_job
from tests.helpers.parity import (assert_within_fp32_error, build_model, float64_reference, make_sample,
                                  pack, reference_loss_and_grads, rel_err)
from tests.helpers.router_reference import add_grads, reference_router_aux_and_grads
from vlmcp.cli import main
from vlmcp.model.packed import PackedVLM
from vlmcp.model.router_loss import router_config_problem

TOL = 1e-5
#: Large enough that the router term moves every gradient it reaches well above the tolerance.
COEF = 0.5


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_packed_router_aux_step_equals_transformers_batched_with_attention_mask(checkpointing):
    model = build_model(moe=True, router_aux_loss_coef=COEF)
    gen = torch.Generator().manual_seed(11)
    samples = [
        make_sample(gen, model.config, 21, [(1, 4, 4)]),
        make_sample(gen, model.config, 9),
        make_sample(gen, model.config, 26, [(1, 2, 2), (1, 4, 2)]),
    ]
    ref_loss, lm_grads = reference_loss_and_grads(model, samples)
    ref_aux, router_grads = reference_router_aux_and_grads(model, [samples])
    ref_grads = add_grads(lm_grads, router_grads)
    truth_loss, truth_lm_grads = float64_reference(reference_loss_and_grads, model, samples)
    truth_aux, truth_router_grads = float64_reference(reference_router_aux_and_grads, model, [samples])
    truth_grads = add_grads(truth_lm_grads, truth_router_grads)
    trained = copy.deepcopy(model)
    trained.model.visual.requires_grad_(False)
    module = PackedVLM(trained, router_aux_loss=True, gradient_checkpointing=checkpointing)
    module.train()
    assert module.router_aux_coef == COEF
    loss_sum, count, router_share = module(pack(samples, model))
    (loss_sum / count + module.router_aux_coef * router_share).backward()
    assert_within_fp32_error(float(loss_sum.detach()) / count, ref_loss, truth_loss, at_least=TOL, name="loss")
    assert_within_fp32_error(float(router_share.detach()), ref_aux, truth_aux, at_least=TOL, name="router aux")
    gate = "model.language_model.layers.0.mlp.gate.weight"
    assert rel_err(router_grads[gate], lm_grads[gate]) > 100 * TOL
    grads = {n: p.grad for n, p in trained.named_parameters() if p.requires_grad}
    assert grads.keys() == {n for n in ref_grads if not n.startswith("model.visual")}
    for name, grad in grads.items():
        assert_within_fp32_error(grad, ref_grads[name], truth_grads[name], at_least=TOL, name=name)


def test_router_aux_loss_on_a_dense_checkpoint_is_an_error_naming_the_key():
    model = build_model()
    assert "model.router_aux_loss" in router_config_problem(model.config.text_config)
    with pytest.raises(ValueError, match="model.router_aux_loss"):
        PackedVLM(model, router_aux_loss=True)


@pytest.mark.parametrize("router_aux_loss", [False, True])
def test_output_router_logits_warns_only_without_the_router_loss(router_aux_loss, caplog):
    model = build_model(moe=True, output_router_logits=True)
    with caplog.at_level(logging.WARNING, logger="vlmcp.model.packed"):
        module = PackedVLM(model, router_aux_loss=router_aux_loss)
    warned = any("no router aux loss" in r.getMessage() for r in caplog.records)
    assert warned == (not router_aux_loss)
    assert (module.router_loss is not None) == router_aux_loss


def test_validate_rejects_the_router_loss_on_a_dense_checkpoint(tiny_checkpoint, digits_jsonl, tmp_path, capsys):
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
                                                    model={"router_aux_loss": True}))
    assert main(["validate", str(job)]) == 1
    assert "config key 'model.router_aux_loss'" in capsys.readouterr().err


def _first_train_row(checkpoint, data, out, router_aux_loss: bool) -> dict:
    job = write_job(out / "job.json", tiny_job(checkpoint, data, out, model={"router_aux_loss": router_aux_loss},
                                               train={"max_steps": 1}))
    assert_ok(run_vlmcp(["train", str(job)]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row][0]


@pytest.mark.e2e
def test_train_rows_report_the_router_loss_beside_an_unchanged_lm_loss(tiny_moe_checkpoint, digits_jsonl, tmp_path):
    """The first step's `loss` (before any update) is the same CE with and without the router loss."""
    data = digits_jsonl / "train.jsonl"
    with_router = _first_train_row(tiny_moe_checkpoint, data, tmp_path / "router", True)
    without = _first_train_row(tiny_moe_checkpoint, data, tmp_path / "plain", False)
    # top-2 of 4 experts: the loss is 2 when the routing is balanced, and at most 4
    assert 1.0 <= with_router["router_aux_loss"] <= 4.0
    assert "router_aux_loss" not in without
    assert abs(with_router["loss"] - without["loss"]) <= 1e-6 * without["loss"]
