"""The `lora` section and its module names, checked without loading weights or starting ranks:
every bad setting is one clear error line naming its key (and the module it hits)."""

from __future__ import annotations

import pytest

from tests.parity import build_model
from vlmcp.config import ConfigError, LoraSection, job_from_dict
from vlmcp.model.lora import lora_config, lora_problems, resolve_lora_modules
from vlmcp.model.tiny import tiny_qwen3_5_config


def _job(**lora):
    return {"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "lora": lora}


@pytest.mark.parametrize("lora,message", [
    ({"alpha": 32}, "config key 'lora.alpha' is set but 'lora.r' is 0"),
    ({"r": 4, "target_modules": "q_proj"}, "expected a list of module names or \"all-linear\""),
    ({"r": 4, "target_modules": []}, "'lora.target_modules': must name at least one module"),
    ({"r": -1}, "config key 'lora.r': must be >= 0"),
    ({"r": 4, "dropout": 1.5}, "config key 'lora.dropout': must be <= 1.0"),
])
def test_lora_section_errors_name_their_key(lora, message):
    with pytest.raises(ConfigError) as exc:
        job_from_dict(_job(**lora))
    assert len(exc.value.problems) == 1
    assert message in exc.value.problems[0]


def test_lora_with_a_trainable_vision_tower_is_an_error():
    raw = _job(r=4)
    raw["model"]["freeze_vision"] = False
    with pytest.raises(ConfigError, match="'model.freeze_vision' is false but LoRA"):
        job_from_dict(raw)


def test_all_linear_covers_every_decoder_linear_and_nothing_of_vision_or_lm_head():
    model = build_model()
    targets, to_save = resolve_lora_modules(model, LoraSection(r=4))
    leaves = {t.rsplit(".", 1)[1] for t in targets}
    assert leaves == {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj",
                      "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(t.startswith("model.language_model.layers.") for t in targets)
    assert to_save == []
    config = lora_config(model, LoraSection(r=4), "/base")
    assert config.base_model_name_or_path == "/base"


@pytest.mark.parametrize("entry,message", [
    ("nope_proj", "'nope_proj' matches no module"),
    ("qkv", "in the vision tower, which stays frozen"),
    ("lm_head", "the fused cross-entropy reads its weight directly"),
    ("embed_tokens", "the embeddings stay frozen"),
    ("conv1d", "reads the conv1d weight directly"),
    ("input_layernorm", "LoRA targets Linear layers"),
])
def test_refused_targets_are_named(entry, message):
    problems = lora_problems(tiny_qwen3_5_config(), LoraSection(r=4, target_modules=["q_proj", entry]))
    assert problems and all(message in p for p in problems)


@pytest.mark.parametrize("entry,message", [
    ("gate_up_proj", "names a parameter of the routed experts"),
    ("experts", "the routed experts hold fused 3-D weights"),
])
def test_moe_routed_experts_are_refused_with_the_reason(entry, message):
    problems = lora_problems(tiny_qwen3_5_config(moe=True), LoraSection(r=4, target_modules=[entry]))
    assert problems and all(message in p for p in problems)


def test_moe_mlp_names_adapt_the_shared_expert():
    model = build_model(moe=True)
    targets, _ = resolve_lora_modules(model, LoraSection(r=4, target_modules=["down_proj"]))
    assert targets and all(t.endswith("mlp.shared_expert.down_proj") for t in targets)


@pytest.mark.parametrize("entry,message", [
    ("self_attn", "is not a leaf module with weights"),
    ("lm_head", "the lm_head stays frozen"),
    ("q_proj", "is also a LoRA target"),
])
def test_refused_modules_to_save_are_named(entry, message):
    problems = lora_problems(tiny_qwen3_5_config(),
                             LoraSection(r=4, target_modules=["q_proj"], modules_to_save=[entry]))
    assert problems and all(message in p for p in problems)
