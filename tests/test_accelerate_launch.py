"""Acceptance: `accelerate launch --config_file X.yaml` whose YAML says ZeRO 3 and SP 2 (TRL's
ZeRO-3 YAML shape plus parallelism_config) trains 2 CPU ranks with ZeRO stage 3 and sp 2, to
per-step losses equal to those of the same job written in JSON (torchrun).
"""

from __future__ import annotations

import pytest

from tests.helpers.accelerate_yamls import TRL_ZERO3_SP2
from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, train_losses, write_job

pytestmark = pytest.mark.e2e

STEPS = 20


def test_accelerate_yaml_with_zero3_sp2_trains_like_the_same_job_in_json(
        tiny_checkpoint, digits_jsonl, tmp_path):
    yaml = tmp_path / "trl_zero3_sp2.yaml"
    yaml.write_text(TRL_ZERO3_SP2)
    train = {"max_steps": STEPS, "seed": 0}
    from_yaml = tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "yaml",
                         train=train)
    del from_yaml["deepspeed"]  # everything DeepSpeed comes from the YAML
    from_json = tiny_job(
        tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "json", train=train,
        model={"path": str(tiny_checkpoint), "dtype": "bfloat16"}, parallel={"sp_size": 2},
        deepspeed={"zero_optimization": {"stage": 3,
                                         "stage3_gather_16bit_weights_on_model_save": True}})
    launched = run_vlmcp(["train", str(write_job(tmp_path / "yaml.json", from_yaml))],
                         launcher="accelerate", nproc=2, accelerate_yaml=yaml)
    assert_ok(launched)
    assert "world 2 = sp 2 x dp 1, ZeRO stage 3" in launched.stderr
    assert "parallel.sp_size: 1 -> 2 (from accelerate config parallelism_config_sp_size=2" \
        in launched.stderr
    assert "ZeRO stage 3; offload optimizer none, params none; precision bf16" in launched.stderr
    assert_ok(run_vlmcp(["train", str(write_job(tmp_path / "json.json", from_json))],
                        launcher="torchrun", nproc=2))
    losses = train_losses(tmp_path / "yaml")
    assert len(losses) == STEPS
    assert losses == train_losses(tmp_path / "json")
