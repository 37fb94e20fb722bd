"""The `lora` section and its module names, checked without loading weights or starting ranks:
every bad setting is one clear error line naming its key (and the module it hits)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from tests.helpers.parity import (assert_within_fp32_error, build_model, float64_reference, rel_err,
                                  seed_adapter_weights)
from vlmcp.config import LoraSection, job_from_dict
from vlmcp.errors import ConfigError
from vlmcp.model.lora import (apply_lora, lora_config, lora_problems, resolve_lora_modules,
                              resolve_lora_parameters)
from vlmcp.model.tiny import tiny_qwen3_5_config
from vlmcp.training.weights.lora_export import export_lora, save_adapter, trained_state_dict


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
    ("experts", "adapt them with lora.target_parameters"),
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


ROUTED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_target_parameters_select_the_routed_experts_fused_weights():
    model = build_model(moe=True)
    section = LoraSection(r=4, target_modules=[], target_parameters=ROUTED_EXPERTS)
    names = resolve_lora_parameters(model, section)
    layers = model.config.text_config.num_hidden_layers
    assert len(names) == 2 * layers
    assert all(n.startswith("model.language_model.layers.") and ".mlp.experts." in n for n in names)
    config = lora_config(model, section, "/base")
    assert config.target_modules is None and sorted(config.target_parameters) == names


@pytest.mark.parametrize("entry,message", [
    ("experts.nope", "'experts.nope' matches no parameter of the model"),
    ("shared_expert.down_proj.weight", "not a weight of the routed experts"),
    ("embed_tokens.weight", "the embeddings stay frozen"),
])
def test_target_parameters_outside_the_routed_experts_are_refused(entry, message):
    problems = lora_problems(tiny_qwen3_5_config(moe=True),
                             LoraSection(r=4, target_modules=["q_proj"], target_parameters=[entry]))
    assert problems and all(message in p for p in problems)


def test_target_parameters_need_dropout_zero():
    with pytest.raises(ConfigError, match="'lora.dropout' is 0.1 but 'lora.target_parameters'"):
        job_from_dict(_job(r=4, dropout=0.1, target_parameters=ROUTED_EXPERTS))


def test_routed_expert_adapter_loads_in_peft_and_exports_merged(tmp_path):
    """The adapter of routed-expert LoRA (plus a Linear target), written as `vlmcp` writes
    `final/`, loads with `PeftModel.from_pretrained` onto the plain base and gives the live
    model's logits; `vlmcp export --merge`'s path gives a plain model with the same logits."""
    base = tmp_path / "base"
    build_model(moe=True).save_pretrained(base)
    lora = dict(r=4, alpha=8.0, target_modules=["q_proj"], target_parameters=ROUTED_EXPERTS)
    live = Qwen3_5MoeForConditionalGeneration.from_pretrained(base)
    peft_model = apply_lora(live, LoraSection(**lora), base)
    seed_adapter_weights(live)
    state = trained_state_dict(live, live)
    assert sum(".mlp.experts." in k for k in state) == 4 * live.config.text_config.num_hidden_layers
    save_adapter(peft_model, state, base, tmp_path / "adapter")
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = live(input_ids=ids).logits
        truth = float64_reference(lambda model: model(input_ids=ids).logits, live)
        plain = Qwen3_5MoeForConditionalGeneration.from_pretrained(base)
        assert rel_err(plain(input_ids=ids).logits, expected) > 1e-3, "the adapters change nothing"
        loaded = PeftModel.from_pretrained(plain, str(tmp_path / "adapter"))
        assert rel_err(loaded(input_ids=ids).logits, expected) <= 1e-6
        job = job_from_dict({"model": {"path": str(base)}, "data": {"train": "t.jsonl"}, "lora": lora})
        export_lora(job, state, tmp_path / "merged", merge=True)
        merged = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "merged")
        assert_within_fp32_error(merged(input_ids=ids).logits, expected, truth, at_least=1e-5, name="merged logits")
