"""The job schema: defaults, errors that name their key, overrides, DeepSpeed "auto" filling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmcp.config import job_from_dict, load_job, parse_override
from vlmcp.errors import ConfigError
from vlmcp.training.ds.config import fill_deepspeed_config, load_deepspeed_config
from vlmcp.training.optim import lr_multiplier

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"}}


def _problems(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    return info.value.problems


def _write_job(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    return path


def test_minimal_job_gets_documented_defaults():
    job = job_from_dict(MINIMAL)
    assert job.model.dtype == "float32" and job.model.freeze_vision is True
    assert job.parallel.sp_size == 1 and job.parallel.deltanet_cp == "state"
    assert job.parallel.vision == "split"
    assert job.optimizer.type == "adamw" and job.optimizer.betas == [0.9, 0.95]
    assert job.data.truncate is False and job.data.shuffle is False
    assert job.train.grad_accum == 1 and job.train.resume is False


def test_unknown_key_error_names_full_key_path():
    assert _problems({**MINIMAL, "train": {"max_stepz": 3}}) == [
        "unknown config key 'train.max_stepz'"]
    assert _problems({**MINIMAL, "optimiser": {}}) == ["unknown config key 'optimiser'"]


def test_a_number_beyond_the_float_range_is_a_problem_not_a_crash():
    assert _problems({**MINIMAL, "optimizer": {"lr": 10**400}}) == [
        "config key 'optimizer.lr': must be a finite number, got inf"]


def test_every_problem_is_reported_on_its_own_line():
    problems = _problems({"model": {"path": "ckpt", "dtype": "float64"},
                          "data": {"train": "t.jsonl", "max_seq_len": 1},
                          "train": {"grad_accum": 0, "bogus": 1}})
    assert len(problems) == 4
    assert any("'model.dtype'" in p and "float64" in p for p in problems)
    assert any("'data.max_seq_len'" in p and ">= 2" in p for p in problems)
    assert any("'train.grad_accum'" in p for p in problems)
    assert "unknown config key 'train.bogus'" in problems


@pytest.mark.parametrize("section,key,value,expected", [
    ("train", "max_steps", "10", "expected an integer"),
    ("train", "max_steps", 2.5, "expected an integer"),
    ("train", "resume", 1, "expected true or false"),
    ("optimizer", "lr", "fast", "expected a number"),
    ("optimizer", "betas", [0.9], "expected 2 values"),
    ("optimizer", "type", "lion", "not one of"),
    ("parallel", "deltanet_cp", "ring", "not one of"),
    ("parallel", "vision", "sharded", "not one of"),
    ("parallel", "sp_size", 0, "must be >= 1"),
])
def test_bad_value_error_names_the_key(section, key, value, expected):
    problems = _problems({**MINIMAL, section: {key: value}})
    assert len(problems) == 1
    assert f"'{section}.{key}'" in problems[0] and expected in problems[0]


def test_missing_required_keys_are_named():
    assert set(_problems({})) == {"missing required config key 'model.path'",
                                  "missing required config key 'data.train'"}


def test_cross_key_rules_name_both_keys():
    problems = _problems({**MINIMAL, "train": {"eval_every": 5}})
    assert problems == ["config key 'train.eval_every' is set but 'data.eval' is not"]
    problems = _problems({"model": {"path": "ckpt"}, "data": {"train": "t", "eval": "e"},
                          "eval": {"generate": True}})
    assert len(problems) == 1 and "'eval.generate'" in problems[0] and "train.eval_every" in problems[0]


def test_set_overrides_parse_json_and_reject_unknown_keys(tmp_path):
    path = _write_job(tmp_path, MINIMAL)
    job = load_job(path, ["train.max_steps=7", "optimizer.betas=[0.8, 0.9]",
                          "data.eval=held.jsonl", "model.freeze_vision=false"])
    assert job.train.max_steps == 7 and job.optimizer.betas == [0.8, 0.9]
    assert job.data.eval == "held.jsonl" and job.model.freeze_vision is False
    with pytest.raises(ConfigError) as info:
        load_job(path, ["train.max_stepz=7"])
    assert info.value.problems == ["unknown config key 'train.max_stepz'"]
    assert parse_override("a.b=null") == ("a.b", None)
    with pytest.raises(ConfigError):
        parse_override("no_equals_sign")


def test_invalid_json_job_names_file_and_line(tmp_path):
    path = tmp_path / "job.json"
    path.write_text('{\n  "model": {"path": "x"},\n  oops\n}')
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert info.value.problems[0].startswith(f"{path}:3:")


def test_input_paths_resolve_next_to_the_job_file_then_cwd(tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "train.jsonl").write_text("")
    (tmp_path / "ds.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    job = load_job(_write_job(tmp_path / "jobs", MINIMAL))
    assert job.resolve_input("train.jsonl") == tmp_path / "jobs" / "train.jsonl"
    assert job.resolve_input("ds.json") == tmp_path / "ds.json"


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
def test_stock_deepspeed_json_auto_values_are_filled_from_the_job(name):
    job = job_from_dict({**MINIMAL, "deepspeed": str(REPO / "ds_configs" / f"{name}.json"),
                         "model": {"path": "ckpt", "dtype": "bfloat16"},
                         "train": {"grad_accum": 4, "grad_clip": 0.5}})
    config = fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=2, hidden_size=64)
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert config["gradient_accumulation_steps"] == 4
    assert config["gradient_clipping"] == 0.5
    assert "train_batch_size" not in config
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert "auto" not in json.dumps(config)
    assert "optimizer" not in config and "scheduler" not in config
    if name.startswith("zero3"):
        assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
        assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_deepspeed_optimizer_block_is_kept_with_autos_filled_and_set_overrides_apply(tmp_path):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 1}}
    job = load_job(_write_job(tmp_path, {**MINIMAL, "deepspeed": ds}),
                   ["deepspeed.zero_optimization.stage=2"])
    config = fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=1, hidden_size=8)
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": job.optimizer.lr}}
    assert config["zero_optimization"]["stage"] == 2


def test_deepspeed_numbers_that_disagree_with_the_job_name_both_keys():
    job = job_from_dict({**MINIMAL, "model": {"path": "ckpt", "dtype": "float32"},
                         "deepspeed": {"gradient_accumulation_steps": 4, "bf16": {"enabled": True}}})
    with pytest.raises(ConfigError) as info:
        fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=1, hidden_size=8)
    assert any("deepspeed.gradient_accumulation_steps" in p and "train.grad_accum" in p
               for p in info.value.problems)
    assert any("deepspeed.bf16.enabled" in p and "model.dtype" in p for p in info.value.problems)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine():
    job = job_from_dict({**MINIMAL, "scheduler": {"type": "cosine", "warmup_steps": 3,
                                                  "min_lr_ratio": 0.1},
                         "train": {"max_steps": 13}})
    factors = [lr_multiplier(s, job.scheduler, 13) for s in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[8] == pytest.approx(0.1 + 0.9 * 0.5)
    assert factors[13] == pytest.approx(0.1)


def test_data_video_keys_are_checked_against_each_other_and_named():
    def video(**keys):
        return {**MINIMAL, "data": {**MINIMAL["data"], "video": keys}}

    assert _problems(video(frame_list_fpz=2)) == ["unknown config key 'data.video.frame_list_fpz'"]
    assert _problems(video(fps=0, min_frames=9, max_frames=8, min_pixels=4096,
                           max_pixels=1024)) == [
        "config key 'data.video.fps': must be > 0, got 0",
        "config key 'data.video.min_frames' (9) is above 'data.video.max_frames' (8)",
        "config key 'data.video.min_pixels' (4096) is above 'data.video.max_pixels' (1024)"]
    assert job_from_dict(video(fps=4, max_pixels=2**20)).data.video.fps == 4.0
