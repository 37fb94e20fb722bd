"""Faults of the RL loop lose no trained step and leave no rank alone (docs/rl-loop.md, docs/faults.md):
one rollout job, `vlmcp train` under torchrun on 2 CPU ranks (DP 2, ZeRO-0), over three launches
on the same output, publish and rollout directories. The rollout steps are written by the test.

1. SIGTERM during step 1 (a step of many small packs; the signal follows rank 0's log line of the
   step): the ranks finish the step, agree on the stop and checkpoint it before anything optional,
   so step 1 is not published; the run exits 143, with a `stopped` metrics row and
   OUTPUT_DIR/stopped.json naming the step and its checkpoint (torchrun itself exits 1).
2. The resume publishes step 1 first (due, and not in publish.dir), trains step 2, then the publish
   of step 3 fails (a stray directory in its place): a checkpoint of step 3 is written first, one
   error line says so, every rank exits 1 and no stop marker is left.
3. The next resume publishes step 3 first; step 4 holds a sample whose per-token value is a finite
   JSON integer too large for a float (an OverflowError in rank 0's index pass): under
   `on_bad_sample: "skip"` it is dropped and counted; step 5's meta.json holds an integer of 5,000
   digits (a ValueError in rank 0's index pass): one error line naming step_5 on every rank, a
   checkpoint of step 4, no traceback, and no rank waits for the collective watchdog. Step 4's
   background write, in flight when step 5's index fails, is finished before the run stops (the
   error is one every rank raised together), whatever the speed of the machine.
Every step that was trained and is due ends up published, each exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.launching import launched, run_vlmcp, tiny_job, vlmcp_frames, write_job
from vlmcp.data.rollouts import STABLE, step_dir
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.metrics import read_metrics
from vlmcp.training.signals import STOP_MARKER

pytestmark = pytest.mark.e2e

IDS = [1, 10, 11, 12, 13, 2]
LABELS = [-100, -100, 11, 12, 13, 2]
#: Seconds a rank may wait in a collective: a rank left alone would end with exit 124 after it.
WATCHDOG_S = 90


def _line(advantage: int | float = 1.0) -> str:
    return json.dumps({"input_ids": IDS, "labels": LABELS,
                       "advantages": [None, None, advantage, 1.0, -0.5, 0.25]})


def _write_step(rollouts: Path, number: int, lines: list[str], meta: str = '{"policy_step": 0}'
                ) -> Path:
    path = step_dir(rollouts, number)
    path.mkdir(parents=True)
    (path / "rollouts.jsonl").write_text("".join(line + "\n" for line in lines))
    (path / "meta.json").write_text(meta)
    (path / STABLE).write_text("")
    return path


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen (exit {proc.poll()})")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _published(weights: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in weights.glob("step_*") if (p / STABLE).is_file())


def test_a_stop_a_failed_publish_and_a_bad_index_keep_the_trained_steps_and_publish_every_due_step(
        tiny_checkpoint, tmp_path):
    rollouts, weights, out = tmp_path / "rollouts", tmp_path / "weights", tmp_path / "out"
    rollouts.mkdir()
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, Path("unused"), out, data={"max_seq_len": len(IDS), "num_workers": 0},
        loss={"type": "policy_gradient"}, optimizer={"type": "sgd", "lr": 1e-2},
        train={"max_steps": 6, "collective_timeout_s": WATCHDOG_S},
        rollouts={"dir": str(rollouts), "timeout_s": 120, "poll_s": 0.1,
                  "on_bad_sample": "skip"},
        publish={"dir": str(weights), "every": 1}))
    raw = json.loads(job.read_text())
    del raw["data"]["train"]
    job.write_text(json.dumps(raw))

    # 1. SIGTERM in the middle of a step of 80 one-sample packs (40 micro-batches per rank: long
    # enough to be signalled in, short enough to end well within torchrun's 30 s before SIGKILL)
    _write_step(rollouts, 1, [_line() for _ in range(80)])
    log = tmp_path / "run1.log"
    with launched(["train", str(job)], log) as proc:
        _wait_for(lambda: f"rollout step {step_dir(rollouts, 1)}: 80 samples" in log.read_text(),
                  proc, "step 1's log line")
        proc.send_signal(signal.SIGTERM)
    text = log.read_text()
    assert text.count("(exit 143)") == 2 and "stopped on a signal after step 1" in text, text[-3000:]
    assert newest_complete(out / "checkpoints")[0] == "step1"
    assert _published(weights) == [], "step 1 was published before its stop checkpoint"
    marker = json.loads((out / STOP_MARKER).read_text())
    assert marker == {"step": 1, "stopped": "SIGTERM", "exit_code": 143,
                      "checkpoint": str(out / "checkpoints" / "step1")}
    assert read_metrics(out / "metrics.jsonl")[-1] == marker

    # 2. the resume publishes step 1, trains step 2; the publish of step 3 fails
    _write_step(rollouts, 2, [_line() for _ in range(4)])
    log = tmp_path / "run2.log"
    with launched(["train", str(job), "--set", "train.resume=true"], log) as proc:
        _wait_for(lambda: _published(weights) == [1, 2], proc, "the publish of steps 1 and 2")
        (weights / "step_3").mkdir()
        (weights / "step_3" / "stray.txt").write_text("not a published step")
        _write_step(rollouts, 3, [_line() for _ in range(4)])
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    errors = _errors(text)
    assert len(errors) == 1 and str(weights / "step_3") in errors[0] \
        and f"a checkpoint of step 3 is in {out / 'checkpoints'}" in errors[0] \
        and "the resumed run publishes step 3 first" in errors[0], errors
    assert newest_complete(out / "checkpoints")[0] == "step3"
    assert not (out / STOP_MARKER).exists()

    # 3. the next resume publishes step 3; a sample of step 4 is dropped, step 5's index fails
    (weights / "step_3" / "stray.txt").unlink()
    (weights / "step_3").rmdir()
    _write_step(rollouts, 4, [_line(), _line(int("9" * 400)), _line()])
    step_5 = _write_step(rollouts, 5, [_line()], meta='{"policy_step": 0, "note": ' + "7" * 5000 + "}")
    started = time.monotonic()
    result = run_vlmcp(["train", str(job), "--set", "train.resume=true"], launcher="torchrun",
                       nproc=2, timeout=400)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    errors = _errors(result.stderr)
    assert len(errors) == 1 and str(step_5) in errors[0], errors
    assert "rollout step 5 cannot train; a checkpoint of step 4 is in" in result.stderr
    assert vlmcp_frames(result.stderr) == [] and "exitcode  : 124" not in result.stderr
    assert elapsed < 400 and newest_complete(out / "checkpoints")[0] == "step4"
    rows = {row["step"]: row for row in read_metrics(out / "metrics.jsonl") if "loss" in row}
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[4]["rollout_samples"] == 2 and rows[4]["rollout_skipped_samples"] == 1
    assert f"{step_dir(rollouts, 4) / 'rollouts.jsonl'}:2: " in result.stderr
    assert _published(weights) == [1, 2, 3, 4]
    published = [row["step"] for row in read_metrics(out / "metrics.jsonl") if "published" in row]
    assert published == [1, 2, 3, 4]
