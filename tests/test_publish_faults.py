"""A background, rank-parallel publish that fails in a real run (2 CPU ranks over gloo, ZeRO-3,
publish every step): a write that fails on a full disk (`vlmcp train` under torchrun), or one
rank's copy of the weights off the live model (the training loop on 2 real ranks, the copy made
to fail on rank 1), stops the run at the next step on every rank with one error naming it, a
checkpoint of the steps trained and no half-written step; the failed copy's fence does not hold
the training. (A write abandoned at a stop: tests/test_publish_sharded.py; SIGTERM with
background publishes in a rollout run: tests/test_rl_loop.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.disks import small_tmpfs
from tests.helpers.distributed import run_ranks
from tests.helpers.launching import REPO, run_vlmcp, tiny_job, write_job
from vlmcp.data.rollouts import STABLE
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.weights.hf_format import INDEX_NAME, read_hf_weights

pytestmark = pytest.mark.e2e


def _job(checkpoint, digits, out, weights, max_steps: int = 4) -> dict:
    return tiny_job(checkpoint, digits / "train.jsonl", out, data={"max_seq_len": 64},
                    deepspeed={"zero_optimization": {"stage": 3}},
                    train={"max_steps": max_steps},
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
        # rank 0's progress bar may end on the line rank 1's error starts
        errors = [line[line.index("error: "):] for line in result.stderr.splitlines()
                  if "error: " in line]
        assert len(errors) == 1 and f"no space left on {small}" in errors[0], errors
        assert f'File "{REPO / "vlmcp"}' not in result.stderr, "a traceback from vlmcp"
        assert newest_complete(out / "checkpoints")[0] == "step3"
        assert f"; a checkpoint of step 3 is in {out / 'checkpoints'}" in errors[0], errors
        assert sorted(p.name for p in weights.iterdir()) == ["step_1"]
        _assert_every_stable_step_is_whole(weights)


def _train_with_rank1s_copy_failing(job: dict) -> list[str] | None:
    """On every rank: the training loop, rank 1's publish threads failing to copy the weights
    to host memory (as when it runs out); returns the lines of the CheckpointError it raised."""
    from vlmcp.config import job_from_dict
    from vlmcp.errors import CheckpointError
    from vlmcp.parallel import comm
    from vlmcp.training.weights import shards
    from vlmcp.training.loop import train

    if comm.rank() == 1:
        def out_of_memory(self):
            raise MemoryError("simulated: no host memory left")

        shards.StagedShare.stage = out_of_memory
    try:
        train(job_from_dict(job))
    except CheckpointError as exc:
        return exc.problems
    return None


def test_a_copy_that_fails_on_one_rank_stops_the_run_at_the_next_step_with_a_checkpoint(
        tiny_checkpoint, digits_jsonl, tmp_path):
    out, weights = tmp_path / "out", tmp_path / "weights"
    rank0, rank1 = run_ranks(_train_with_rank1s_copy_failing, 2,
                             _job(tiny_checkpoint, digits_jsonl, out, weights, max_steps=2))
    assert rank0 == [], "the error's line is printed once, by the rank that failed"
    (line,) = rank1
    assert f"writing the published weights to {weights / 'step_1'}: copying rank 1's share in " \
           "host memory: MemoryError: simulated: no host memory left" in line, line
    assert f"; a checkpoint of step 2 is in {out / 'checkpoints'}; continue with " \
           "train.resume=true" in line, line
    assert newest_complete(out / "checkpoints")[0] == "step2"
    assert not any(weights.iterdir()), "no step, and no .tmp- directory"
