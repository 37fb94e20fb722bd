"""DeepSpeed configs as users have them (accelerate's templates, LLaMA-Factory's, ms-swift's,
written in their shape in tests/fixtures/deepspeed/) run with HF Trainer's semantics: every "auto"
gets a value from the job, optimizer/scheduler blocks are built by DeepSpeed, every change is
logged, and what cannot run is one error naming its key.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vlmcp.config import job_from_dict
from vlmcp.errors import ConfigError
from vlmcp.training.ds.config import fill_deepspeed_config, load_deepspeed_config
from vlmcp.training.ds.engine import engine_optim_args
from vlmcp.training.optim import can_veto

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import REPO, run_vlmcp, tiny_job, write_job

DATA = Path(__file__).parent / "fixtures" / "deepspeed"
SHAPES = sorted(p.name for p in DATA.glob("*.json"))
JOB = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"},
       "optimizer": {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.01},
       "scheduler": {"warmup_steps": 5, "min_lr_ratio": 0.1},
       "train": {"max_steps": 50, "grad_clip": 0.5}}


def _fill(raw: dict, **job_keys) -> tuple[dict, object]:
    job = job_from_dict({**JOB, **job_keys, "deepspeed": raw})
    return fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=2, hidden_size=8), job


@pytest.fixture
def on_cuda(monkeypatch):
    """Pretend the run is on CUDA, where fp16 runs (only the fp16 device check reads it)."""
    monkeypatch.setattr("vlmcp.device.use_cuda", lambda: True)


@pytest.mark.parametrize("name", SHAPES)
def test_public_config_shapes_get_every_auto_from_the_job(name, on_cuda):
    raw = json.loads((DATA / name).read_text())
    config, job = _fill(raw)
    assert "auto" not in json.dumps(config)
    zero = config["zero_optimization"]
    assert zero["stage"] in (0, 1, 2, 3) and config["gradient_clipping"] == 0.5
    if "stage3_gather_16bit_weights_on_model_save" in zero:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is (zero["stage"] == 3)
    if "optimizer" in raw:
        params = config["optimizer"]["params"]
        assert params["lr"] == 3e-4 and params["weight_decay"] == 0.01
        assert params.get("betas", [0.8, 0.9]) == [0.8, 0.9] and params.get("eps", 1e-7) == 1e-7
        assert config.get("zero_allow_untested_optimizer") is raw.get("zero_allow_untested_optimizer")
    else:
        assert config["zero_allow_untested_optimizer"] is True
        if zero.get("offload_optimizer", {}).get("device") == "cpu":
            assert config["zero_force_ds_cpu_optimizer"] is False
    if "scheduler" in raw:
        params = config["scheduler"]["params"]
        assert params["warmup_num_steps"] == 5 and params["total_num_steps"] == 50
        assert params.get("warmup_max_lr", 3e-4) == 3e-4
        assert params.get("cos_min_ratio", 0.1) == 0.1
    if raw.get("fp16", {}).get("enabled") is True:
        assert job.model.dtype == "float16" and config["fp16"]["enabled"] is True


def test_stage_auto_is_filled_once_and_every_change_is_logged_with_old_and_new(caplog):
    raw = json.loads((DATA / "every_auto.json").read_text())
    with caplog.at_level(logging.INFO):
        config, _ = _fill(raw)
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert config["zero_optimization"]["offload_param"] == {"device": "none"}
    log = caplog.text
    assert 'deepspeed config zero_optimization.stage: "auto" -> 2' in log
    assert 'deepspeed config optimizer.params.betas: "auto" -> [0.8, 0.9] (' in log
    assert 'deepspeed config scheduler.params.cos_min_ratio: "auto" -> 0.1 (' in log
    assert 'deepspeed config train_batch_size: "auto" -> (removed)' in log
    assert "deepspeed config steps_per_print: (absent) -> 1000000000" in log
    assert "DeepSpeed builds the deepspeed config's \"AdamW\" block" in log


def test_explicit_fp16_block_and_an_explicit_job_dtype_that_disagree_are_one_error():
    raw = json.loads((DATA / "accelerate_zero_stage1.json").read_text())
    with pytest.raises(ConfigError) as info:
        _fill(raw, model={"path": "ckpt", "dtype": "bfloat16"})
    assert info.value.problems == [
        "config key 'deepspeed.fp16.enabled': true disagrees with model.dtype=\"bfloat16\"; "
        "set it to \"auto\" or make them equal"]


def test_job_values_the_deepspeed_blocks_override_are_warned(caplog):
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    with caplog.at_level(logging.INFO):
        config, _ = _fill(raw, optimizer={"type": "sgd", "lr": 3e-4})
    assert config["optimizer"]["params"]["lr"] == 1e-5
    assert "optimizer.params.lr=1e-05 wins over the job's optimizer.lr=0.0003" in caplog.text
    assert "the job's optimizer.type is not used" in caplog.text


def test_zero_force_ds_cpu_optimizer_true_is_honoured_with_deepspeeds_cpu_adam(caplog):
    raw = {"zero_force_ds_cpu_optimizer": True,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with caplog.at_level(logging.INFO):
        config, _ = _fill(raw)
    assert config["zero_force_ds_cpu_optimizer"] is True
    assert config["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.01}}
    assert "deepspeed config optimizer: (absent) -> {" in caplog.text
    with pytest.raises(ConfigError, match="zero_force_ds_cpu_optimizer.*optimizer.type='sgd'"):
        _fill(raw, optimizer={"type": "sgd"})


def test_what_cannot_run_is_an_error_naming_its_key():
    with pytest.raises(ConfigError) as info:
        _fill({"fp16": {"enabled": True}, "tensor_parallel": {"autotp_size": 2}})
    assert len(info.value.problems) == 2
    assert "'deepspeed.fp16.enabled' is true" in info.value.problems[0]
    assert "fp16 does not run on the CPU" in info.value.problems[0]
    assert "'deepspeed.tensor_parallel.autotp_size': 2" in info.value.problems[1]
    with pytest.raises(ConfigError, match="'train.nonfinite' is 'skip'"):
        _fill({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}},
              train={"nonfinite": "skip"})


def test_blocks_decide_what_deepspeed_initialize_is_handed():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    job = job_from_dict(JOB)
    mine = engine_optim_args(job, {}, params)
    assert can_veto(mine["optimizer"]) and type(mine["lr_scheduler"]).__name__ == "LambdaLR"
    ds_optimizer = engine_optim_args(job, {"optimizer": {}}, params)
    assert ds_optimizer["optimizer"] is None and callable(ds_optimizer["lr_scheduler"])
    ds_scheduler = engine_optim_args(job, {"scheduler": {}}, params)
    assert can_veto(ds_scheduler["optimizer"]) and ds_scheduler["lr_scheduler"] is None


def _build_offload_engine(raw: dict) -> dict:
    import deepspeed
    import torch

    from vlmcp.training.ds.engine import describe_engine

    job = job_from_dict({**JOB, "deepspeed": raw})
    config = fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=1, hidden_size=8)
    model = torch.nn.Linear(4, 4)
    params = list(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                      **engine_optim_args(job, config, params))
    lrs = []
    for _ in range(3):
        loss = engine(torch.ones(1, 4)).sum()
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    return {"optimizer": type(engine.basic_optimizer).__name__,
            "scheduler": type(engine.lr_scheduler).__name__, "lrs": lrs,
            "summary": describe_engine(engine, config)}


@pytest.mark.e2e
def test_optimizer_block_with_offload_builds_deepspeeds_cpu_adam():
    """The one test that pays DeepSpeed's CPU Adam JIT build (~100 s cold on 2 cores; cached in
    TORCH_EXTENSIONS_DIR after)."""
    raw = json.loads((DATA / "accelerate_zero_stage2_offload.json").read_text())
    raw["fp16"]["enabled"] = "auto"
    [built] = run_ranks(_build_offload_engine, 1, raw)
    assert built["optimizer"] == "DeepSpeedCPUAdam" and built["scheduler"] == "WarmupDecayLR"
    # WarmupDecayLR from warmup_min_lr 0 up to the job's lr over scheduler.warmup_steps (5)
    assert built["lrs"][0] == 0.0 and 0 < built["lrs"][1] < built["lrs"][2] < 3e-4
    summary = built["summary"]
    assert "optimizer deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam (from the deepspeed config)" \
        in summary
    assert "scheduler WarmupDecayLR (from the deepspeed config); ZeRO stage 2; offload " \
        "optimizer cpu, params none; precision fp32; gradient accumulation 1; gradient " \
        "clipping 0.5" in summary


@pytest.mark.e2e
def test_validate_names_fp16_on_cpu_and_tensor_parallelism(tiny_checkpoint, digits_jsonl, tmp_path):
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
        deepspeed=str(DATA / "accelerate_zero_stage1.json")))
    result = run_vlmcp(["validate", str(job), "--set", "deepspeed.tensor_parallel.autotp_size=2"],
                       cwd=REPO)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, result.stderr
    assert "'deepspeed.fp16.enabled' is true (model.dtype=\"float16\")" in errors[0]
    assert "'deepspeed.tensor_parallel.autotp_size': 2" in errors[1]
