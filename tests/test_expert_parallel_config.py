"""`parallel.ep_size` as a job key: the DeepSpeed config's `expert_parallel` section is filled from
it (a user's section honoured where it agrees, one error naming the key where it does not), the
optimizer reaches DeepSpeed as a callable over MoE param groups, and every layout or feature
combination that cannot run is one `error:` line at `vlmcp validate` naming `parallel.ep_size`.
"""

from __future__ import annotations

import pytest
import torch

from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.errors import ConfigError
from vlmcp.model.tiny import tiny_qwen3_5_config
from vlmcp.parallel.constraints import check_ep_constraints
from vlmcp.training.ds.config import fill_deepspeed_config, load_deepspeed_config
from vlmcp.training.ds.engine import engine_optim_args
from vlmcp.training.ds.expert_parallel import expert_weight, hf_expert_tensors, hf_name

from tests.helpers.launching import tiny_job, write_job

JOB = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"}}


def _fill(raw: dict, sp_size: int = 1, ep_size: int = 2, **job_keys) -> dict:
    job = job_from_dict({**JOB, **job_keys, "deepspeed": raw,
                         "parallel": {"sp_size": sp_size, "ep_size": ep_size}})
    return fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=2, hidden_size=8,
                                 moe_top_k=2)


def _problems(raw: dict, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        _fill(raw, **kwargs)
    return caught.value.problems


def test_ep_size_fills_deepspeeds_expert_parallel_section_with_qwen3_5_moe_routing():
    section = _fill({"zero_optimization": {"stage": 2}})["expert_parallel"]
    assert section["enabled"] is True and section["autoep_size"] == 2 and section["top_k"] == 2
    assert section["moe_layer_pattern"] == r"language_model\.layers\.\d+\.mlp"
    assert (section["score_func"], section["route_norm"], section["score_apply"]) == ("softmax", True, "post")
    assert "preset_model" not in section


def test_a_users_expert_parallel_section_keeps_its_other_keys_and_loses_its_preset(caplog):
    raw = {"expert_parallel": {"enabled": "auto", "autoep_size": 2, "comm_backend": "comm",
                               "preset_model": "qwen3_5_moe"}}
    section = _fill(raw)["expert_parallel"]
    assert section["comm_backend"] == "comm" and section["enabled"] is True
    assert "preset_model" not in section


@pytest.mark.parametrize("section, ep_size, expected", [
    ({"enabled": True, "autoep_size": 4}, 2, "'deepspeed.expert_parallel.autoep_size': 4 disagrees with parallel.ep_size=2"),
    ({"enabled": True, "autoep_size": 2}, 1, "'deepspeed.expert_parallel.enabled' is true but 'parallel.ep_size' is 1"),
    ({"num_expert_groups": 2}, 2, "'deepspeed.expert_parallel.num_expert_groups': 2 changes Qwen3.5-MoE's routing"),
    ({"route_scale": 2.0}, 2, "'deepspeed.expert_parallel.route_scale': 2.0; vlmcp's Qwen3.5-MoE needs 1.0"),
])
def test_an_expert_parallel_section_that_disagrees_with_the_job_is_one_error_naming_its_key(
        section, ep_size, expected):
    problems = _problems({"expert_parallel": section}, ep_size=ep_size)
    assert len(problems) == 1 and expected in problems[0], problems


def test_zero3_with_sequence_parallelism_under_ep_is_accepted_but_not_with_the_hybrid_engine():
    assert _fill({"zero_optimization": {"stage": 3}}, sp_size=2)["expert_parallel"]["enabled"]
    problems = _problems({"zero_optimization": {"stage": 3}, "hybrid_engine": {"enabled": True}},
                         sp_size=2)
    assert len(problems) == 1 and "'deepspeed.hybrid_engine.enabled' is true" in problems[0]


def test_a_deepspeed_optimizer_block_under_ep_is_refused():
    problems = _problems({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert len(problems) == 1 and "'deepspeed.optimizer' with parallel.ep_size > 1" in problems[0]


def test_under_ep_deepspeed_builds_the_jobs_optimizer_over_moe_param_groups_after_the_replacement():
    job = job_from_dict({**JOB, "parallel": {"ep_size": 2}})
    args = engine_optim_args(job, {}, [])
    assert callable(args["optimizer"]) and callable(args["lr_scheduler"])
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    optimizer = args["optimizer"]([dense, expert])
    groups = {group.get("name"): group for group in optimizer.param_groups}
    assert groups["dense"]["params"] == [dense]
    (moe,) = [g for g in optimizer.param_groups if g.get("moe")]
    assert moe["params"] == [expert] and moe["name"] == "ep_size_2"


def test_ep_constraints_name_the_key_for_a_dense_model_and_sizes_that_do_not_divide():
    moe = tiny_qwen3_5_config(moe=True).text_config
    dense = tiny_qwen3_5_config(moe=False).text_config
    assert check_ep_constraints(moe, 2, 4) == [] and check_ep_constraints(dense, 1, 4) == []
    assert "has no routed experts" in check_ep_constraints(dense, 2, 4)[0]
    problems = check_ep_constraints(moe, 3, 4)
    assert any("must divide the world size (4 processes)" in p for p in problems)
    assert any("num_experts=4" in p for p in problems)


@pytest.mark.parametrize("keys, expected", [
    ({"lora": {"r": 4, "target_modules": ["q_proj"]}},
     "'lora.target_parameters' is empty with parallel.ep_size=2"),
    ({"publish": {"dir": "weights", "sharded": False}},
     "'publish.sharded' is false with parallel.ep_size=2"),
])
def test_validate_refuses_each_feature_ep_cannot_run_with_one_error_line(
        keys, expected, tiny_moe_checkpoint, digits_jsonl, tmp_path, capsys):
    job = tiny_job(tiny_moe_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
                   parallel={"ep_size": 2})
    for section, values in keys.items():
        job.setdefault(section, {}).update({key: str(digits_jsonl / "eval.jsonl") if value == "EVAL"
                                            else value for key, value in values.items()})
    assert main(["validate", str(write_job(tmp_path / "job.json", job)), "--world-size", "2"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], errors


def test_validate_accepts_ep_on_the_moe_model_and_refuses_it_on_the_dense_one(
        tiny_moe_checkpoint, tiny_checkpoint, digits_jsonl, tmp_path, capsys):
    for checkpoint, world, code in ((tiny_moe_checkpoint, 2, 0), (tiny_moe_checkpoint, 3, 1),
                                    (tiny_checkpoint, 2, 1)):
        job = write_job(tmp_path / "job.json", tiny_job(
            checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out", parallel={"ep_size": 2}))
        assert main(["validate", str(job), "--world-size", str(world)]) == code
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert all("parallel.ep_size" in line for line in errors) and bool(errors) == bool(code), errors


def test_autoep_names_map_back_to_transformers_names_and_fused_expert_layout():
    assert hf_name("model.language_model.layers.3.mlp.router.gate.weight") == \
        "model.language_model.layers.3.mlp.gate.weight"
    assert hf_name("language_model.layers.0.mlp.shared_experts.up_proj.weight") == \
        "language_model.layers.0.mlp.shared_expert.up_proj.weight"
    assert hf_name("language_model.layers.0.mlp.shared_experts_gate.weight") == \
        "language_model.layers.0.mlp.shared_expert_gate.weight"
    assert expert_weight("language_model.layers.2.mlp.experts.w3") == ("language_model.layers.2.mlp.experts", "w3")
    assert expert_weight("language_model.layers.2.mlp.gate.weight") is None
    w1, w3, w2 = torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randn(2, 5, 3)
    fused = hf_expert_tensors("m.experts", w1, w2, w3)
    assert torch.equal(fused["m.experts.gate_up_proj"][:, :3], w1)
    assert torch.equal(fused["m.experts.gate_up_proj"][:, 3:], w3)
    assert fused["m.experts.down_proj"] is w2
