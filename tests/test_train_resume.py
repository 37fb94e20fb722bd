"""Checkpoint and resume: 4 steps straight equal 2 steps, then a resume for 2 more; and a saved
checkpoint exports to the same weights as the run's final model. bf16, AdamW, ZeRO-2 over 2
ranks, shuffled data.

The interrupted run is simulated by `--set train.max_steps=2`, so the LR schedule must not depend
on max_steps: a warmup (which spans the resume point) followed by a constant rate.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, train_losses, write_job
from vlmcp.cli import main
from vlmcp.data.index import build_index
from vlmcp.data.pack import PackedDataset
from vlmcp.data.stream import SampleReader
from vlmcp.model.loss_terms import Loss
from vlmcp.training.steps.step_packs import StepPacks
from vlmcp.training.weights.hf_format import read_hf_weights


def _job(checkpoint, digits, out, **train):
    return tiny_job(checkpoint, digits / "train.jsonl", out,
                    data={"max_seq_len": 64, "shuffle": True},
                    optimizer={"type": "adamw", "lr": 2e-3, "weight_decay": 0.01},
                    scheduler={"type": "constant", "warmup_steps": 3},
                    model={"dtype": "bfloat16"},
                    deepspeed={"zero_optimization": {"stage": 2}},
                    train={"seed": 3, "grad_accum": 2, **train})


@pytest.mark.e2e
def test_two_steps_plus_resume_equal_four_straight_steps_and_export_matches_final(
        tiny_checkpoint, digits_jsonl, tmp_path):
    straight = tmp_path / "straight"
    job = write_job(tmp_path / "straight.json", _job(tiny_checkpoint, digits_jsonl, straight,
                                                     max_steps=4))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2))

    resumed = tmp_path / "resumed"
    job = write_job(tmp_path / "resumed.json", _job(tiny_checkpoint, digits_jsonl, resumed,
                                                    max_steps=4, save_every=2))
    assert_ok(run_vlmcp(["train", str(job), "--set", "train.max_steps=2"],
                        launcher="torchrun", nproc=2))
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step2"
    first_final = read_hf_weights(resumed / "final")

    assert_ok(run_vlmcp(["export", str(job), "--tag", "step2", "--out", str(tmp_path / "exported")]))
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert exported.keys() == first_final.keys()
    for key, value in first_final.items():
        assert torch.equal(exported[key], value), key
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == "qwen3_5"

    result = run_vlmcp(["train", str(job), "--set", "train.resume=true"], launcher="torchrun",
                       nproc=2)
    assert_ok(result)
    assert "resumed from" in result.stderr
    assert "length index: loaded from cache" in result.stderr
    assert "length index: built" not in result.stderr
    straight_losses, resumed_losses = train_losses(straight), train_losses(resumed)
    assert len(resumed_losses) == 4
    assert resumed_losses == pytest.approx(straight_losses, rel=1e-6)
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_checkpoint, digits_jsonl, tmp_path,
                                                      capsys):
    job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, tmp_path / "out",
                                                max_steps=2, resume=True))
    assert main(["validate", str(job)]) == 1
    assert "config key 'train.resume' is true but" in capsys.readouterr().err


def test_step_packs_are_a_pure_function_of_the_step(tiny_processor, digits_jsonl):
    index, problems = build_index([digits_jsonl / "train.jsonl"], tiny_processor, max_seq_len=64)
    assert problems == []
    reader = SampleReader(index, tiny_processor, max_seq_len=64, truncate=False)

    def step_packs():
        return StepPacks(PackedDataset(index.tokens, 64, dp_rank=1, dp_size=2, shuffle=True,
                                       seed=5, multiple_of=2), grad_accum=2, reader=reader,
                          objective=Loss())

    walked = step_packs()
    steps_per_epoch = walked.steps_in_epoch(0)
    sequence = [[b.sample_ids for b in walked.batches(step)] for step in range(3 * steps_per_epoch)]
    for step in (0, steps_per_epoch - 1, steps_per_epoch, 2 * steps_per_epoch + 1):
        assert [b.sample_ids for b in step_packs().batches(step)] == sequence[step]
    assert walked.locate(steps_per_epoch) == (1, 0)
    assert sequence[0] != sequence[steps_per_epoch]
