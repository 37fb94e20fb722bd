"""A LoRA run's merged weights for the push (training/weights/lora_push.py), against PEFT's own
`merge_and_unload` of the same model: the same names, bit for bit the same values, on one rank
and spread over the ranks of a world (each tensor on exactly one rank); only the adapted weights
and modules_to_save copies are marked trained. Dense (Linear adapters and a modules_to_save
norm) and MoE (Linear adapters and the routed experts' fused parameters, two PEFT wrappers
around one experts module)."""

from __future__ import annotations

import copy

import pytest
import torch

from vlmcp.config import LoraSection
from vlmcp.model.load import load_model
from vlmcp.model.lora import apply_lora
from vlmcp.model.tiny import build_tiny_checkpoint
from vlmcp.training.weights.hf_format import saved_tensors
from vlmcp.training.weights.lora_push import MergedShare

CASES = {
    "dense": (False, LoraSection(r=2, alpha=4.0, target_modules=["q_proj", "in_proj_qkv",
                                                                   "down_proj"],
                                 modules_to_save=["post_attention_layernorm"])),
    "moe": (True, LoraSection(r=2, alpha=4.0, target_modules=["o_proj", "out_proj"],
                              target_parameters=["mlp.experts.gate_up_proj",
                                                 "mlp.experts.down_proj"])),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def adapted(request, tmp_path_factory):
    """(the HF model with trained-looking adapters injected, its PEFT model)."""
    moe, section = CASES[request.param]
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", moe=moe,
                                       seed=0)
    model = load_model(checkpoint, "float32", freeze_vision=True)
    peft_model = apply_lora(model, section, checkpoint)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # PEFT starts lora_B at zero: give every adapter a delta
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model, peft_model


def test_the_merged_share_is_peft_merge_and_unload_bit_for_bit(adapted):
    model, peft_model = adapted
    expected = saved_tensors(copy.deepcopy(peft_model).merge_and_unload())
    share = MergedShare(model, world=1, rank=0)
    trained = share.trained()
    whole = share.whole()
    assert list(whole) == list(expected)
    for key, value in expected.items():
        assert torch.equal(whole[key], value), key
    live = model.state_dict()
    changed = {key for key, value in expected.items() if not torch.equal(value, _base(live, key))}
    assert set(trained) == {t.key for t in share.tensors if t.trained} == changed

def test_over_three_ranks_every_merged_tensor_is_on_exactly_one_rank_with_the_same_bytes(adapted):
    model, _ = adapted
    alone = MergedShare(model, world=1, rank=0)
    alone.trained()
    expected = alone.whole()
    parts = []
    for rank in range(3):
        share = MergedShare(model, world=3, rank=rank)
        share.trained()
        parts.append(share.whole())
    assert all(parts)
    assert sorted(k for part in parts for k in part) == sorted(expected)
    for part in parts:
        assert all(torch.equal(value, expected[key]) for key, value in part.items())


def _base(live: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The frozen value of merged tensor `key` in the adapted model's state dict `live` (before
    any adapter or trained copy)."""
    path, _, name = key.rpartition(".")
    for candidate in (f"{path}.base_layer.{name}", f"{path}.base_layer.base_layer.{name}",
                      f"{path}.original_module.{name}", key):
        if candidate in live:
            return live[candidate]
    raise KeyError(key)
