"""How a run ends with a background publish in flight, in the training loop on 2 real ranks over
gloo (tiny model, publish every step). Each case holds the write of a step on the disk for a few
seconds (a slow disk, in the ranks' processes only), so that only the loop's own waiting, never
the speed of the machine, decides whether the step gets published:

- a resumed run whose start step is due and unpublished, with no step left to train, finishes
  that publish before it returns (no `.tmp-` directory, a publish row, no writer thread left);
- a rollout step that cannot train (an error every rank raises together) finishes the healthy
  write in flight before the run stops;
- SIGTERM right after a background publish completed, while the ranks wait for the next rollout
  step: every rank writes the publish row and the stop row in step, `stopped.json` is written,
  and every rank stops cleanly (StopRequested), none left in a collective.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import tiny_job
from tests.helpers.rollout_producer import write_step
from vlmcp.data.rollouts import STABLE, step_dir
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.metrics import read_metrics
from vlmcp.training.signals import STOP_MARKER

pytestmark = pytest.mark.e2e

#: Seconds each shard write is held on the disk: longer than anything the loop does after it.
HELD_S = 4.0
IDS = [1, 10, 11, 12, 13, 2]
LABELS = [-100, -100, 11, 12, 13, 2]
LINE = {"input_ids": IDS, "labels": LABELS, "advantages": [None, None, 1.0, 1.0, -0.5, 0.25]}


def _slow_shard_writes(failing: str | None) -> None:
    """Every shard write of this process first waits HELD_S seconds (a slow disk); with
    `failing`, the write into that directory fails instead (a disk error)."""
    from vlmcp.training.weights import sharded_write

    real = sharded_write.write_shard

    def held(tensors, path):
        if failing is not None and path.parent.name == failing:
            raise OSError(5, "Input/output error (simulated)")
        time.sleep(HELD_S)
        real(tensors, path)

    sharded_write.write_shard = held


def _writer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("vlmcp-write")]


def _train(raw: dict, held: bool = True, failing: str | None = None
           ) -> tuple[list[str], list[str]]:
    """On every rank: `vlmcp train` of `raw`, the shard writes slowed (`held`, `failing`:
    `_slow_shard_writes`); (the lines of the JobError it raised, or StopRequested's exit code,
    the writer threads still alive)."""
    from vlmcp.config import job_from_dict
    from vlmcp.errors import JobError
    from vlmcp.training.loop import train
    from vlmcp.training.signals import StopRequested

    if held:
        _slow_shard_writes(failing)
    try:
        train(job_from_dict(raw))
        outcome: list[str] = []
    except StopRequested as exc:
        outcome = [f"StopRequested {exc.exit_code}"]
    except JobError as exc:
        outcome = exc.problems or ["JobError on another rank"]
    return outcome, _writer_threads()


def _published(weights: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in weights.glob("step_*") if (p / STABLE).is_file())


def _publish_rows(out: Path) -> list[int]:
    return [row["step"] for row in read_metrics(out / "metrics.jsonl") if "published" in row]


def test_a_resume_with_no_step_left_finishes_the_publish_of_its_start_step_before_it_returns(
        tiny_checkpoint, digits_jsonl, tmp_path):
    out, weights = tmp_path / "out", tmp_path / "weights"
    raw = tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", out, data={"max_seq_len": 64},
                   train={"max_steps": 2}, publish={"dir": str(weights)})
    # 1. the write of the last step fails: step 2 is kept, not published
    first = run_ranks(_train, 2, raw, True, ".tmp-step_2")
    assert any("the resumed run publishes step 2 first" in line
               for line in first[0][0] + first[1][0]), first
    assert newest_complete(out / "checkpoints")[0] == "step2" and _published(weights) == [1]
    # 2. the resume at max_steps publishes step 2 in the background and trains nothing
    for outcome, threads in run_ranks(_train, 2, {**raw, "train": {**raw["train"],
                                                                    "resume": True}}):
        assert outcome == [] and threads == [], (outcome, threads)
    assert _published(weights) == [1, 2]
    assert sorted(p.name for p in weights.iterdir()) == ["step_1", "step_2"]
    assert _publish_rows(out) == [1, 2]


def _rollout_job(checkpoint: Path, tmp_path: Path) -> dict:
    raw = tiny_job(checkpoint, Path("unused"), tmp_path / "out",
                   data={"max_seq_len": len(IDS), "num_workers": 0},
                   loss={"type": "policy_gradient"}, optimizer={"type": "sgd", "lr": 1e-2},
                   train={"max_steps": 3, "collective_timeout_s": 90},
                   rollouts={"dir": str(tmp_path / "rollouts"), "timeout_s": 300, "poll_s": 0.05},
                   publish={"dir": str(tmp_path / "weights"), "every": 1})
    del raw["data"]["train"]
    return raw


def test_a_rollout_step_that_cannot_train_finishes_the_healthy_write_in_flight_first(
        tiny_checkpoint, tmp_path):
    rollouts = tmp_path / "rollouts"
    write_step(step_dir(rollouts, 1), [LINE] * 2, 0, 0.0)
    write_step(step_dir(rollouts, 2), [LINE] * 2, 0, 0.0)
    (step_dir(rollouts, 2) / "meta.json").write_text('{"policy_step": "zero"}')
    rank0, rank1 = run_ranks(_train, 2, _rollout_job(tiny_checkpoint, tmp_path))
    (line,) = rank0[0]
    assert str(step_dir(rollouts, 2)) in line and rank1[0] == ["JobError on another rank"], line
    assert rank0[1] == rank1[1] == []
    assert newest_complete(tmp_path / "out" / "checkpoints")[0] == "step1"
    weights = tmp_path / "weights"
    assert _published(weights) == [1] and [p.name for p in weights.iterdir()] == ["step_1"]
    assert _publish_rows(tmp_path / "out") == [1]


def _stop_once_published(raw: dict) -> tuple[list[str], list[str]]:
    """`_train`, this rank sending itself SIGTERM once step 1's publish is complete (its
    directory renamed into place) while the ranks wait for rollout step 2."""
    step_1 = Path(raw["publish"]["dir"]) / "step_1" / STABLE

    def signal_when_published() -> None:
        deadline = time.monotonic() + 300
        while not step_1.is_file() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_when_published, daemon=True).start()
    return _train(raw, held=False)


def test_sigterm_right_after_a_background_publish_completed_stops_every_rank_cleanly(
        tiny_checkpoint, tmp_path):
    write_step(step_dir(tmp_path / "rollouts", 1), [LINE] * 2, 0, 0.0)
    out = tmp_path / "out"
    for outcome, threads in run_ranks(_stop_once_published, 2,
                                      _rollout_job(tiny_checkpoint, tmp_path)):
        assert outcome == ["StopRequested 143"] and threads == [], (outcome, threads)
    marker = json.loads((out / STOP_MARKER).read_text())
    assert marker["step"] == 1 and marker["stopped"] == "SIGTERM", marker
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows if "published" in row] == [1]
    assert rows[-1] == marker
