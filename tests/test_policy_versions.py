"""Per-token policy versions (`vlmcp.data.policy_versions`): both forms parse to the same tokens,
malformed ones name their line, and a rollout step's staleness counts from its oldest token."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launching import tiny_job
from vlmcp.config import job_from_dict
from vlmcp.data.policy_versions import target_version_range, token_versions
from vlmcp.data.rollouts import META, STABLE, step_dir
from vlmcp.errors import DataError, RolloutError
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.steps.rollout_steps import RolloutSteps


def test_spans_and_per_token_lists_give_the_same_versions_and_the_oldest_target_counts():
    spans = [{"version": 3, "start": 2, "end": 4}, {"version": 4, "start": 4, "end": 5}]
    listed = [None, None, 3, 3, 4, None]
    assert token_versions(spans, 6, "f:1") == listed == token_versions(listed, 6, "f:1")
    assert target_version_range(listed, [-100, -100, 7, 8, 9, -100], "f:1") == (3, 4)
    assert target_version_range(listed, [-100] * 6, "f:1") is None


@pytest.mark.parametrize("value, message", [
    ([None, 1], "has 2 entries for 3 tokens"),
    ([None, -1, 2], "must be an integer >= 0"),
    ([{"version": 1, "start": 1, "end": 4}], "is not within the line's 3 tokens"),
    ([{"version": 1, "start": 0, "end": 2}, {"version": 2, "start": 1, "end": 3}], "overlaps"),
    ([{"version": 1, "begin": 0, "end": 2}], "a span is"),
    ("3", "must be a list"),
])
def test_a_malformed_policy_versions_names_its_line(value, message):
    with pytest.raises(DataError, match=message) as info:
        token_versions(value, 3, "step_1/rollouts.jsonl:7")
    assert str(info.value).startswith("step_1/rollouts.jsonl:7: policy_versions")


def test_a_target_token_without_a_version_is_an_error():
    with pytest.raises(DataError, match="no version for target token 2"):
        target_version_range([None, 1, None], [-100, 5, 6], "f:2")


def _line(versions, prompt=3, answer=2):
    ids = list(range(10, 10 + prompt + answer))
    return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:],
            "advantages": [None] * prompt + [1.0] * answer, "policy_versions": versions}


def _write_step(root, number, lines, policy_step):
    path = step_dir(root, number)
    path.mkdir(parents=True)
    (path / "rollouts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (path / META).write_text(json.dumps({"policy_step": policy_step}))
    (path / STABLE).write_text("")
    return path


def _steps(checkpoint, processor, tmp_path, data=None, **rollouts):
    raw = tiny_job(checkpoint, tmp_path / "unused.jsonl", tmp_path / "out",
                   data={"max_seq_len": 64, "num_workers": 0, **(data or {})},
                   loss={"type": "policy_gradient"},
                   rollouts={"dir": str(tmp_path / "rollouts"), **rollouts})
    del raw["data"]["train"]
    # One process: SP and DP rank 0 of 1 (the rollout index and packs need no process group).
    return RolloutSteps(job_from_dict(raw), processor, SequenceParallel.single())


def test_staleness_counts_from_the_oldest_token_version_and_the_row_gives_min_and_max_lag(
        tiny_checkpoint, tiny_processor, tmp_path):
    root = tmp_path / "rollouts"
    # Step 4 trains from the weights of step 3; meta.json says 2 (lag 1), but tokens of the first
    # line were sampled by version 0 (lag 3) and of the second by 2 and 3.
    lines = [_line([None, None, None, 0, 1]),
             _line([{"version": 2, "start": 3, "end": 4}, {"version": 3, "start": 4, "end": 5}])]
    for number in (1, 2, 3):
        _write_step(root, number, [_line(None) | {"policy_versions": [None] * 3 + [0, 0]}], 0)
    _write_step(root, 4, lines, 2)
    skipped = _steps(tiny_checkpoint, tiny_processor, tmp_path, max_staleness=2,
                     on_stale="skip").step_batches(3)
    assert skipped.skip == "stale"
    assert {k: skipped.row[k] for k in ("policy_step", "policy_lag", "policy_lag_min",
                                        "policy_lag_max", "policy_version_oldest",
                                        "policy_version_newest")} == {
        "policy_step": 2, "policy_lag": 3, "policy_lag_min": 0, "policy_lag_max": 3,
        "policy_version_oldest": 0, "policy_version_newest": 3}
    trained = _steps(tiny_checkpoint, tiny_processor, tmp_path, max_staleness=3).step_batches(3)
    assert trained.skip is None and trained.row["rollout_samples"] == 2
    with pytest.raises(RolloutError, match="policy version 0 .* is 3 steps behind"):
        _steps(tiny_checkpoint, tiny_processor, tmp_path, max_staleness=2).step_batches(3)


def test_a_malformed_policy_versions_is_a_bad_sample_of_its_line_under_either_setting(
        tiny_checkpoint, tiny_processor, tmp_path):
    path = _write_step(tmp_path / "rollouts", 1, [_line([None, None, None, 0, 0]),
                                                  _line([None, 0, 0])], 0)
    with pytest.raises(RolloutError) as info:
        _steps(tiny_checkpoint, tiny_processor, tmp_path).step_batches(0)
    assert info.value.problems == [f"{path / 'rollouts.jsonl'}:2: policy_versions has 3 entries "
                                   "for 5 tokens (one per token, null where none applies; or a "
                                   "list of spans)"]
    skipped = _steps(tiny_checkpoint, tiny_processor, tmp_path,
                     on_bad_sample="skip").step_batches(0)
    assert (skipped.skip, skipped.row["rollout_samples"], skipped.row["rollout_skipped_samples"],
            skipped.row["policy_version_oldest"]) == (None, 1, 1, 0)


def test_samples_without_per_token_versions_count_from_meta_json_beside_those_with_them(
        tiny_checkpoint, tiny_processor, tmp_path):
    root = tmp_path / "rollouts"
    for number in (1, 2):
        _write_step(root, number, [_line(None) | {"policy_versions": [None] * 3 + [0, 0]}], 0)
    plain = _line(None)
    del plain["policy_versions"]
    # step 3 trains from the weights of step 2: one line sampled by version 2, one by meta's 1
    _write_step(root, 3, [_line([None, None, None, 2, 2]), plain], 1)
    row = _steps(tiny_checkpoint, tiny_processor, tmp_path).step_batches(2).row
    assert {k: row[k] for k in ("policy_lag", "policy_lag_min", "policy_version_oldest")} == {
        "policy_lag": 1, "policy_lag_min": 0, "policy_version_oldest": 1}


def test_a_version_ahead_of_the_trainer_names_the_first_line_that_gives_it_and_counts_the_rest(
        tiny_checkpoint, tiny_processor, tmp_path):
    root = tmp_path / "rollouts"
    # step 4 trains from the weights of step 3: lines 2 and 3 give version 4, line 1 does not
    path = _write_step(root, 4, [_line([None, None, None, 3, 3]), _line([None, None, None, 3, 4]),
                                 _line([None, None, None, 4, 4])], 3)
    with pytest.raises(RolloutError) as info:
        _steps(tiny_checkpoint, tiny_processor, tmp_path).step_batches(3)
    assert info.value.problems == [
        f"{path / 'rollouts.jsonl'}:2: policy_versions give version 4, newer than the weights of "
        "step 3, which train step 4 (policy lag -1): a producer bug, or another run's "
        "rollouts.dir (1 more line(s) of the step are ahead too)"]


def test_truncation_drops_the_versions_of_the_tokens_it_cuts_from_the_step_and_its_lag(
        tiny_checkpoint, tiny_processor, tmp_path):
    root = tmp_path / "rollouts"
    # 20 tokens: a prompt of 3, targets 3..9 sampled by version 5, 10..19 by version 0 (an
    # in-flight update the other way round, so that the cut-away tokens hold the oldest version).
    line = _line([None] * 3 + [5] * 7 + [0] * 10, prompt=3, answer=17)
    _write_step(root, 7, [line], 5)
    row = _steps(tiny_checkpoint, tiny_processor, tmp_path, max_staleness=2,
                 data={"max_seq_len": 10, "truncate": True}).step_batches(6).row
    assert {k: row[k] for k in ("policy_lag", "policy_lag_min", "policy_lag_max",
                                "policy_version_oldest", "policy_version_newest")} == {
        "policy_lag": 1, "policy_lag_min": 1, "policy_lag_max": 1, "policy_version_oldest": 5,
        "policy_version_newest": 5}
