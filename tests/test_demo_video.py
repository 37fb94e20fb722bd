"""The video demo's job, shortened: mp4 clips streamed through loader workers, trained at SP 2
on 2 torchrun ranks with split vision, and evaluated by greedy generation on held-out clips."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launching import assert_ok, run_vlmcp, train_losses, write_job
from vlmcp.demo.image import DEMO_MODEL
from vlmcp.model.tiny import build_tiny_checkpoint
from vlmcp.demo.video import video_demo_job, write_digit_clips


@pytest.mark.e2e
def test_the_video_demo_job_trains_at_sp2_and_evaluates_by_generation(tmp_path):
    assets = tmp_path / "assets"
    build_tiny_checkpoint(assets / "checkpoint", seed=0, **DEMO_MODEL)
    train, _ = write_digit_clips(assets / "clips", n_train=48, n_eval=8, seed=0)
    records = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(records) == 48 and all((assets / "clips" / r["videos"][0]).is_file() for r in records)
    out = tmp_path / "out"
    job = video_demo_job(assets, out, sp_size=2)
    job["train"].update({"max_steps": 8, "eval_every": 8})
    assert_ok(run_vlmcp(["train", str(write_job(out / "job.json", job))], launcher="torchrun",
                        nproc=2, timeout=300))
    losses = train_losses(out)
    assert len(losses) == 8 and losses[-1] < losses[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluation,) = [row for row in rows if "eval_accuracy" in row]
    assert evaluation["eval_samples"] == 8 and 0.0 <= evaluation["eval_accuracy"] <= 1.0
