"""An accelerate YAML drives the run: the environment `accelerate launch --config_file X` gives
its processes (built here by accelerate's own launch code from YAMLs written in the shape of
accelerate's templates and TRL's) sets the job's keys, and a disagreement is one error naming both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vlmcp.config import load_job
from vlmcp.errors import ConfigError
from vlmcp.training.ds.config import fill_deepspeed_config, load_deepspeed_config

from tests.helpers.accelerate_yamls import ACCELERATE_PLUGIN_KEYS, BASE_YAML, TRL_ZERO3_SP2, accelerate_env


def _job(tmp_path: Path, **sections) -> Path:
    raw = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"}, **sections}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    return path


def _filled(job) -> dict:
    return fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=1, hidden_size=8)


def test_trl_zero3_sp2_yaml_sets_stage_sp_precision_and_16bit_save(tmp_path, caplog):
    env = accelerate_env(TRL_ZERO3_SP2, tmp_path)
    assert env["PARALLELISM_CONFIG_SP_SIZE"] == "2"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    with caplog.at_level(logging.INFO):
        job = load_job(_job(tmp_path), environ=env)
        config = _filled(job)
    assert job.parallel.sp_size == 2 and job.model.dtype == "bfloat16" and job.zero3_init is True
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert config["bf16"] == {"enabled": True}
    assert "parallel.sp_size: 1 -> 2 (from accelerate config parallelism_config_sp_size=2 " \
           "(PARALLELISM_CONFIG_SP_SIZE))" in caplog.text
    assert "deepspeed config zero_optimization.stage: (absent) -> 3 (from accelerate config " \
           "zero_stage=3 (ACCELERATE_DEEPSPEED_ZERO_STAGE))" in caplog.text
    assert "not honoured" not in caplog.text


def test_accelerate_plugin_keys_set_accumulation_clipping_offload_and_stage(tmp_path, caplog):
    env = accelerate_env(ACCELERATE_PLUGIN_KEYS, tmp_path)
    job = load_job(_job(tmp_path, model={"path": "ckpt", "dtype": "float32"}), environ=env)
    with caplog.at_level(logging.INFO):
        config = _filled(job)
    assert (job.train.grad_accum, job.train.grad_clip, job.zero3_init) == (4, 0.5, False)
    assert config["gradient_accumulation_steps"] == 4 and config["gradient_clipping"] == 0.5
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "deepspeed config zero_force_ds_cpu_optimizer: (absent) -> false" in caplog.text


def test_yaml_deepspeed_config_file_is_the_jobs_deepspeed_config(tmp_path):
    ds = tmp_path / "ds_z3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": "auto"}, "bf16": {"enabled": "auto"},
                              "gradient_accumulation_steps": "auto"}))
    env = accelerate_env(BASE_YAML + f"deepspeed_config:\n  deepspeed_config_file: {ds}\n"
                         "  zero3_init_flag: true\n", tmp_path)
    job = load_job(_job(tmp_path), environ=env)
    assert job.deepspeed == str(ds)
    # zero_stage is not in the YAML: "auto" is accelerate's default stage, 2.
    assert _filled(job)["zero_optimization"]["stage"] == 2


def test_yaml_and_job_that_disagree_are_one_error_each_naming_both(tmp_path):
    env = accelerate_env(TRL_ZERO3_SP2, tmp_path)
    with pytest.raises(ConfigError) as info:
        load_job(_job(tmp_path, parallel={"sp_size": 1},
                      model={"path": "ckpt", "dtype": "float32"}), environ=env)
    assert info.value.problems == [
        "accelerate config mixed_precision=bf16 (ACCELERATE_MIXED_PRECISION) disagrees with the "
        "job's model.dtype='float32'; make them equal or drop one",
        "accelerate config parallelism_config_sp_size=2 (PARALLELISM_CONFIG_SP_SIZE) disagrees "
        "with the job's parallel.sp_size=1; make them equal or drop one"]
    job = load_job(_job(tmp_path, deepspeed={"zero_optimization": {"stage": 2}}), environ=env)
    with pytest.raises(ConfigError) as info:
        _filled(job)
    assert info.value.problems == [
        "accelerate config zero_stage=3 (ACCELERATE_DEEPSPEED_ZERO_STAGE) disagrees with the "
        "job's deepspeed config zero_optimization.stage=2; make them equal or drop one"]
    env = accelerate_env(ACCELERATE_PLUGIN_KEYS, tmp_path)
    job = load_job(_job(tmp_path, deepspeed={"gradient_accumulation_steps": 2}), environ=env)
    with pytest.raises(ConfigError) as info:
        _filled(job)
    assert info.value.problems == [
        "config key 'deepspeed.gradient_accumulation_steps': 2 disagrees with train.grad_accum=4 "
        "(from accelerate config gradient_accumulation_steps=4 "
        "(ACCELERATE_GRADIENT_ACCUMULATION_STEPS)); set it to \"auto\" or make them equal"]


def test_settings_vlmcp_cannot_honour_are_errors_or_warnings(tmp_path, caplog):
    yaml_text = TRL_ZERO3_SP2.replace("parallelism_config_tp_size: 1",
                                      "parallelism_config_tp_size: 2")
    env = accelerate_env(yaml_text, tmp_path)
    with pytest.raises(ConfigError,
                       match=r"parallelism_config_tp_size=2 \(PARALLELISM_CONFIG_TP_SIZE\)"):
        load_job(_job(tmp_path), environ=env)
    with pytest.raises(ConfigError, match="distributed_type FSDP"):
        load_job(_job(tmp_path), environ={"ACCELERATE_USE_FSDP": "true"})
    with caplog.at_level(logging.WARNING):
        load_job(_job(tmp_path), environ={"ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "Block",
                                          "ACCELERATE_USE_DEEPSPEED": "true"})
    assert "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES=Block: not honoured by vlmcp" in caplog.text
    assert "ACCELERATE_USE_DEEPSPEED" not in caplog.text
