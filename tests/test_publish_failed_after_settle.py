"""A publish that fails once it has settled the background publish before it (here: publish.dir's
`step_2` is a foreign non-empty directory, refused at the write's begin) still hands that earlier
publish's row to the caller (`Publisher.unreturned_rows`, which the training loop writes before it
stops on the error), once. At world 1: the real DeepSpeed engine on one gloo rank."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import tiny_job
from vlmcp.model.tiny import build_tiny_checkpoint

pytestmark = [pytest.mark.e2e]


def _publish_twice(checkpoint: str, train_file: str, out: str) -> dict:
    from vlmcp.config import job_from_dict
    from vlmcp.errors import CheckpointError
    from vlmcp.training.loop import start_run, train_step
    from vlmcp.training.weights.publish import Publisher

    root = Path(out) / "weights"
    job = job_from_dict(tiny_job(Path(checkpoint), Path(train_file), Path(out) / "run",
                                 data={"max_seq_len": 64}, publish={"dir": str(root)},
                                 train={"max_steps": 2}))
    run = start_run(job)
    run.engine.train()
    train_step(run, 0)
    publisher = Publisher(dataclasses.replace(job, publish=dataclasses.replace(
        job.publish, background=True)), run.engine, run.module)
    first = publisher.publish(1)  # in the background: no row yet
    (root / "step_2").mkdir(parents=True)
    (root / "step_2" / "foreign.txt").write_text("not a publish")
    try:
        publisher.publish(2)
    except CheckpointError as exc:
        error = "; ".join(exc.problems)
    else:
        error = None
    return {"first": first, "error": error, "unreturned": publisher.unreturned_rows(),
            "again": publisher.unreturned_rows()}


def test_a_publish_failing_after_settling_the_one_before_still_hands_over_its_row_once(
        digits_jsonl, tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "checkpoint")
    (result,) = run_ranks(_publish_twice, 1, str(checkpoint),
                          str(digits_jsonl / "train.jsonl"), str(tmp_path))
    assert result["first"] == []
    assert result["error"] is not None and "step_2" in result["error"], result["error"]
    assert [row["step"] for row in result["unreturned"]] == [1]
    assert result["unreturned"][0]["published"].endswith("step_1")
    assert result["again"] == []
