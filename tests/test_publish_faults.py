"""A background, rank-parallel publish that fails in a real run (`vlmcp train` under torchrun, 2
CPU ranks over gloo, ZeRO-3, publish every step): a write that fails on a full disk stops the run
at the next step on every rank with one error naming the disk, a checkpoint of the steps trained
and no half-written step. (A write abandoned at a stop: tests/test_publish_sharded.py; SIGTERM
with background publishes in a rollout run: tests/test_rl_loop.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.disks import small_tmpfs
from tests.helpers.launching import REPO, run_vlmcp, tiny_job, write_job
from vlmcp.data.rollouts import STABLE
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.hf_format import INDEX_NAME, read_hf_weights

pytestmark = pytest.mark.e2e


def _job(checkpoint, digits, out, weights) -> dict:
    return tiny_job(checkpoint, digits / "train.jsonl", out, data={"max_seq_len": 64},
                    deepspeed={"zero_optimization": {"stage": 3}},
                    train={"max_steps": 4},
                    publish={"dir": str(weights)})


def _assert_every_stable_step_is_whole(weights: Path) -> None:
    """Every directory holding STABLE is a published step whose index names files that are all
    there and load."""
    for stable in weights.rglob(STABLE):
        step = stable.parent
        assert step.name.startswith("step_"), f"{step} holds {STABLE}"
        names = set(json.loads((step / INDEX_NAME).read_text())["weight_map"].values())
        assert names <= {p.name for p in step.iterdir()}, step
        assert read_hf_weights(step), step


def test_a_background_write_on_a_full_disk_stops_the_run_at_the_next_step_with_a_checkpoint(
        tiny_checkpoint, digits_jsonl, tmp_path):
    # One published step of the tiny model takes about 1.3 MB: the first fits, the second not.
    with small_tmpfs(tmp_path / "small", "2m") as small:
        out, weights = tmp_path / "out", small / "weights"
        job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, out, weights))
        result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=400)
        assert result.returncode == 1, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and f"no space left on {small}" in errors[0], errors
        assert f'File "{REPO / "vlmcp"}' not in result.stderr, "a traceback from vlmcp"
        assert newest_complete(out / "checkpoints")[0] == "step3"
        assert f"a checkpoint of step 3 is in {out / 'checkpoints'}" in errors[0], errors
        assert sorted(p.name for p in weights.iterdir()) == ["step_1"]
        _assert_every_stable_step_is_whole(weights)
