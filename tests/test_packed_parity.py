"""On one rank, a packed forward+backward equals plain transformers forwarding each sample alone:
loss and every gradient in fp32 within rel 1e-5 of plain transformers in float64 (or within fp32's
own error of it where that is larger, `assert_within_fp32_error`), for dense and MoE models, with text-only,
one-image and multi-image samples in one pack, with either vision mode. Also: wrapping a model leaves transformers'
global attention registry as it was and keeps the vision tower on sdpa."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tests.helpers.parity import (assert_within_fp32_error, build_model, float64_reference, make_sample,
                                  pack, reference_loss_and_grads)
from vlmcp.model.attention import ATTENTION_KEY
from vlmcp.model.packed import PackedVLM

TOL = 1e-5


@pytest.mark.parametrize("vision_mode", ["split", "replicated"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_step_equals_plain_transformers_per_sample(moe, vision_mode):
    model = build_model(moe=moe)
    gen = torch.Generator().manual_seed(7)
    samples = [
        make_sample(gen, model.config, 20, [(1, 4, 4)]),
        make_sample(gen, model.config, 9),
        make_sample(gen, model.config, 30, [(1, 2, 2), (1, 4, 2)]),
    ]
    ref_loss, ref_grads = reference_loss_and_grads(model, samples)
    truth_loss, truth_grads = float64_reference(reference_loss_and_grads, model, samples)
    trained = copy.deepcopy(model)
    trained.model.visual.requires_grad_(False)
    module = PackedVLM(trained, vision_mode=vision_mode)
    batch = pack(samples, model)
    loss_sum, count, _ = module(batch)
    assert count == batch.num_targets
    (loss_sum / count).backward()
    assert_within_fp32_error(float(loss_sum.detach()) / count, ref_loss, truth_loss, at_least=TOL, name="loss")
    grads = {n: p.grad for n, p in trained.named_parameters() if p.requires_grad}
    assert grads.keys() == {n for n in ref_grads if not n.startswith("model.visual")}
    for name, grad in grads.items():
        assert_within_fp32_error(grad, ref_grads[name], truth_grads[name], at_least=TOL, name=name)


def test_wrapping_replaces_no_global_attention_entry_and_keeps_vision_on_sdpa():
    model = build_model()
    PackedVLM(model)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert model.config.text_config._attn_implementation == ATTENTION_KEY
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_unknown_vision_mode_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="parallel.vision must be one of"):
        PackedVLM(build_model(), vision_mode="sharded")


def test_wrapped_model_still_generates_like_plain_transformers():
    model = build_model()
    prompt = torch.tensor([[9, 10, 11, 12]])
    expected = model.generate(prompt, max_new_tokens=5, do_sample=False)
    wrapped = copy.deepcopy(model)
    PackedVLM(wrapped)
    assert torch.equal(wrapped.generate(prompt, max_new_tokens=5, do_sample=False), expected)
