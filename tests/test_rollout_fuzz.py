"""The rollout fuzzer: malformed rollout steps, each a valid step changed by one mutation
(tests/helpers/rollout_mutations.py, seeded), give one clear error or a counted skip, never a
traceback, and never leave a rank alone.

* In process, every mutation (over 200) through rank 0's index pass (`RolloutSteps._index`, the
  code rank 0 runs before it broadcasts the step), under `rollouts.on_bad_sample` "error" and
  "skip": it returns (it raises nothing, which would leave the other ranks in the broadcast);
  under "error" its problems are single lines, each naming the step, and one names
  step_N/file[:line] where the mutation is; under "skip" a bad record is dropped and counted and
  the rest of its file trains, a file that cannot be read as records is dropped and counted, and
  a step that cannot be read is still an error.
* End to end, a handful against a 2-rank rollout job (`vlmcp train` under torchrun, DP 2): under
  "skip" one run trains through steps that each hold one bad sample (a byte that is not UTF-8, a
  5000-digit integer, an advantage of 400 digits, a missing image, a second data file that is
  empty) and counts each; under "error" a bad line, a meta.json that is not an object, and a step
  directory that is a file each stop the run with one `error:` line naming step_2/file[:line],
  no traceback from vlmcp, within the job's time, with a checkpoint of step 1.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.helpers.images import save_png
from tests.helpers.launching import run_vlmcp, tiny_job, write_job
from tests.helpers.rollout_mutations import (FILE, RECORD, STEP, BaseStep, Expect,
                                             base_step, mutations)
from tests.helpers.videos import write_video
from vlmcp.config import job_from_dict
from vlmcp.data.rollouts import step_dir
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.metrics import read_metrics
from vlmcp.training.steps.rollout_steps import RolloutSteps

pytestmark = pytest.mark.e2e

SEED = 0
#: Enough tokens for the video record whole.
MAX_SEQ_LEN = 512
#: A frame of vlmcp's own code in a traceback.
VLMCP_FRAME = re.compile(r'File "[^"]*vlmcp/')


@pytest.fixture(scope="module")
def base(tiny_processor, tmp_path_factory) -> BaseStep:
    """Three image records and one video record, tokens format with per-token arrays."""
    media = tmp_path_factory.mktemp("fuzz_media")
    images = [save_png(media / f"{i}.png", 32, 32, seed=i) for i in range(3)]
    return base_step(tiny_processor, images, write_video(media / "clip.mp4", 9, 25, 64, 48), SEED)


def _rollout_job(checkpoint: Path, root: Path, out: Path, **sections) -> dict:
    job = tiny_job(checkpoint, Path("unused"), out, data={"max_seq_len": MAX_SEQ_LEN},
                   loss={"type": "policy_gradient"},
                   rollouts={"dir": str(root), "timeout_s": 60, "poll_s": 0.1})
    del job["data"]["train"]
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def _check(expect: Expect, step: Path, outcome, setting: str, total: int) -> str | None:
    """Why rank 0's outcome of a mutated step breaks the contract (None: it holds)."""
    problems = outcome.problems
    for problem in problems:
        if "\n" in problem or "Traceback" in problem or str(step) not in problem:
            return f"not one clear line naming {step}: {problem!r}"
    named = f"{step}/{expect.names}" if expect.names else str(step)
    clean = not problems and outcome.skip is None \
        and outcome.row.get("rollout_skipped_samples") == 0
    if not expect.sure and clean:
        return None
    if expect.where == STEP or setting == "error":
        if not problems:
            return f"no error (row {outcome.row}, skip {outcome.skip})"
        if not any(named in problem for problem in problems):
            return f"no error names {named}: {problems}"
        return None
    if problems:
        return f"an error under skip: {problems}"
    row = outcome.row
    if row.get("rollout_skipped_samples", 0) < 1:
        return f"nothing counted as skipped: {row}"
    if expect.where == RECORD and row["rollout_skipped_samples"] != 1:
        return f"more than the bad record skipped: {row}"
    if expect.kept == 0:
        return None if outcome.skip == "no usable sample" else f"the step not skipped: {row}"
    if row.get("rollout_samples") != expect.kept:
        return f"{row.get('rollout_samples')} samples kept of {total}, expected {expect.kept}"
    return None


def test_every_mutation_of_a_rollout_step_is_one_error_or_a_counted_skip_in_rank_0s_index_pass(
        base, tiny_checkpoint, tiny_processor, tmp_path, capsys):
    found = mutations(base, tiny_processor.tokenizer, SEED)
    assert len(found) >= 200
    assert {m.expect.where for m in found} == {RECORD, FILE, STEP}
    rollouts = tmp_path / "rollouts"
    for number, mutation in enumerate(found, start=1):
        mutation.write(step_dir(rollouts, number))
    started = time.perf_counter()
    failures = []
    for setting in ("error", "skip"):
        steps = RolloutSteps(job_from_dict(_rollout_job(
            tiny_checkpoint, rollouts, tmp_path / "out", rollouts={"on_bad_sample": setting})),
            tiny_processor, sp=None)
        for number, mutation in enumerate(found, start=1):
            try:
                outcome = steps._index(number)
            except Exception as exc:  # the contract: rank 0 never raises before its broadcast
                failures.append(f"[{setting}] {mutation.name}: raised {type(exc).__name__}: "
                                f"{exc}")
                continue
            why = _check(mutation.expect, step_dir(rollouts, number), outcome, setting,
                         len(base.lines))
            if why:
                failures.append(f"[{setting}] {mutation.name}: {why}")
    seconds = time.perf_counter() - started
    with capsys.disabled():
        print(f"\nrollout fuzzer: {len(found)} mutations x 2 settings through the index pass in "
              f"{seconds:.1f} s, {len(failures)} failures")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- end to end


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _train(tmp_path: Path, tiny_checkpoint: Path, steps: list, setting: str):
    """`vlmcp train` on 2 ranks (DP 2) over the rollout steps `steps` (each a write function),
    killed after 300 s (a rank left waiting fails the test): (result, output_dir, ROLLOUTS)."""
    rollouts, out = tmp_path / "rollouts", tmp_path / "out"
    for number, write in enumerate(steps, start=1):
        write(step_dir(rollouts, number))
    job = write_job(tmp_path / "job.json", _rollout_job(
        tiny_checkpoint, rollouts, out, train={"max_steps": len(steps)},
        data={"num_workers": 0}, rollouts={"on_bad_sample": setting, "timeout_s": 30}))
    return run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=300), out, rollouts


def test_a_2_rank_rollout_job_under_skip_trains_through_bad_samples_counting_each(
        base, tiny_checkpoint, tiny_processor, tmp_path):
    found = mutations(base, tiny_processor.tokenizer, SEED)
    picks = [next(m for m in found if m.expect.where == RECORD and pattern in m.name)
             for pattern in ("inside a string", "a 5000-digit integer beside",
                             "(a target) is an integer of 400 digits", "images/0.png missing")]
    picks.append(next(m for m in found if m.name == "a second data file: empty"))
    result, out, rollouts = _train(
        tmp_path, tiny_checkpoint, [base.write, *(m.write for m in picks), base.write], "skip")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert not VLMCP_FRAME.search(result.stderr), result.stderr[-4000:]
    rows = {row["step"]: row for row in read_metrics(out / "metrics.jsonl") if "loss" in row}
    assert sorted(rows) == list(range(1, len(picks) + 3))
    for number, mutation in enumerate(picks, start=2):
        assert rows[number]["rollout_skipped_samples"] == 1, (mutation.name, rows[number])
        assert rows[number]["rollout_samples"] == mutation.expect.kept, mutation.name
        assert f"{step_dir(rollouts, number)}/{mutation.expect.names}" in result.stderr
    assert rows[1]["rollout_skipped_samples"] == 0 and rows[1]["rollout_samples"] == len(base.lines)
    assert (out / "final" / "model.safetensors.index.json").is_file()  # one shard per rank


@pytest.mark.parametrize("name", ["a NUL byte in a string", "the step directory an empty file"])
def test_a_2_rank_rollout_job_under_error_stops_at_a_bad_step_with_one_line_and_a_checkpoint(
        name, base, tiny_checkpoint, tiny_processor, tmp_path):
    found = mutations(base, tiny_processor.tokenizer, SEED)
    mutation = next(m for m in found if m.name.endswith(name))
    result, out, rollouts = _train(tmp_path, tiny_checkpoint,
                                   [base.write, mutation.write], "error")
    assert result.returncode == 1, (result.stdout + result.stderr)[-4000:]
    assert not VLMCP_FRAME.search(result.stderr), result.stderr[-4000:]
    errors = _errors(result.stderr)
    named = f"{step_dir(rollouts, 2)}/{mutation.expect.names}".rstrip("/")
    assert len(errors) == 1 and named in errors[0], (named, errors, result.stderr[-3000:])
    assert "rollouts.timeout_s" not in errors[0]  # the step was read and refused, not waited for
    assert newest_complete(out / "checkpoints")[0] == "step1"
