"""The rollout directory and the publish directory without processes: a step is complete only
with its STABLE marker, meta.json gives the policy lag (a bad one is an error naming it), a step's
data files are its *.jsonl / *.json in name order; the rollout and publish keys are checked (the
ones that need rollouts.dir, data.train optional with it, loss.reference_logps refused with it);
per-token temperatures must be > 0 on targets, and a pack fills in the temperatures (1) and
inference logprobs (NaN) of samples without them (a loss that needs inference logprobs still
needs them on every sample); the mismatch sums are exact for tiny differences; published steps are listed newest
first, complete ones only; waiting for a step sleeps between looks (no spinning), logs, and ends
on the step, a stop signal or rollouts.timeout_s (no process group: the agreement is the
identity)."""

from __future__ import annotations

import json
import logging
import math
import time

import pytest
import torch

from tests.helpers.launching import tiny_job, write_job
from vlmcp.cli import main
from vlmcp.config import LossTerm, job_from_dict
from vlmcp.data.dataset import load_samples
from vlmcp.data.index import build_index
from vlmcp.data.pack import build_batch
from vlmcp.data.rollouts import PUBLISHED_BY, STABLE, is_complete, read_meta, step_dir, step_files
from vlmcp.errors import ConfigError, DataError
from vlmcp.model.loss_terms import Loss
from vlmcp.model.mismatch import mismatch_count, mismatch_sums
from vlmcp.training.steps.rollout_steps import RolloutSteps, WaitOutcome
from vlmcp.training.watchdog import Watchdog
from vlmcp.training.weights.publish import published_steps

IDS = [1, 10, 11, 12, 13, 2]
LABELS = [-100, -100, 11, 12, 13, 2]


def test_a_step_is_complete_only_with_its_stable_marker(tmp_path):
    step = step_dir(tmp_path, 3)
    assert step == tmp_path / "step_3" and not is_complete(step)
    step.mkdir()
    (step / "rollouts.jsonl").write_text("{}\n")
    assert not is_complete(step)
    (step / STABLE).write_text("")
    assert is_complete(step)


def test_meta_json_gives_the_policy_lag_and_a_bad_one_names_its_file(tmp_path):
    assert read_meta(tmp_path).lag(5) is None
    (tmp_path / "meta.json").write_text(json.dumps({"policy_step": 2, "reward": 0.5}))
    meta = read_meta(tmp_path)
    assert meta.policy_step == 2 and meta.fields["reward"] == 0.5
    assert [meta.lag(step) for step in (3, 4, 7)] == [0, 1, 4]
    for text, expected in [('{"policy_step": -1}', "integer >= 0"), ("[1]", "a JSON object"),
                           ('{"policy_step": 1', "malformed JSON"),
                           ('{"policy_step": true}', "integer >= 0")]:
        (tmp_path / "meta.json").write_text(text)
        with pytest.raises(DataError) as info:
            read_meta(tmp_path)
        assert str(info.value).startswith(str(tmp_path / "meta.json")) and expected in str(info.value)


def test_step_data_files_are_its_jsonl_and_json_files_in_name_order(tmp_path):
    with pytest.raises(DataError, match="no data file"):
        step_files(tmp_path)
    for name in ("b.jsonl", "a.json", "meta.json", STABLE, "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "images").mkdir()
    assert [p.name for p in step_files(tmp_path)] == ["a.json", "b.jsonl"]


def _job(checkpoint, tmp_path, **sections):
    raw = tiny_job(checkpoint, tmp_path / "train.jsonl", tmp_path / "out", **sections)
    return raw


def test_rollout_keys_need_rollouts_dir_and_data_train_is_optional_with_it(tiny_checkpoint,
                                                                          tmp_path):
    raw = _job(tiny_checkpoint, tmp_path, rollouts={"dir": str(tmp_path / "rollouts")},
               publish={"dir": str(tmp_path / "weights"), "keep": 2})
    del raw["data"]["train"]
    job = job_from_dict(raw)
    assert job.rollouts.dir and job.publish.keep == 2 and job.data.train == ""
    del raw["rollouts"]
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    assert info.value.problems == ["missing required config key 'data.train'"]
    raw = _job(tiny_checkpoint, tmp_path, rollouts={"timeout_s": 5, "on_bad_sample": "skip"})
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    assert info.value.problems == [
        "config key 'rollouts.timeout_s' is set but 'rollouts.dir' is not",
        "config key 'rollouts.on_bad_sample' is set but 'rollouts.dir' is not"]
    raw = _job(tiny_checkpoint, tmp_path, train={"grad_accum": 4},
               rollouts={"dir": "r", "on_stale": "skip"})
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "config key 'train.grad_accum' does not apply with 'rollouts.dir'",
        "config key 'rollouts.on_stale' is set but 'rollouts.max_staleness' is not, so no step "
        "is ever stale"]
    raw = _job(tiny_checkpoint, tmp_path, rollouts={"dir": "r"},
               loss={"type": "dpo", "reference_logps": "initial"})
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "config key 'loss.reference_logps' does not apply with 'rollouts.dir'"]


def test_publish_keys_need_publish_dir_or_engines(tiny_checkpoint, tmp_path):
    raw = _job(tiny_checkpoint, tmp_path, publish={"every": 5, "keep": 2})
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    assert info.value.problems == [
        "config key 'publish.every' is set but neither 'publish.dir' nor 'publish.engines' is",
        "config key 'publish.keep' is set but neither 'publish.dir' nor 'publish.engines' is"]


def test_validate_checks_a_rollout_job_and_refuses_data_train_or_a_zero2_offload_beside_it(
        tiny_checkpoint, tmp_path, capsys):
    raw = _job(tiny_checkpoint, tmp_path, rollouts={"dir": str(tmp_path / "rollouts")},
               publish={"dir": str(tmp_path / "weights")})
    del raw["data"]["train"]
    assert main(["validate", str(write_job(tmp_path / "job.json", raw))]) == 0
    assert "rollout steps from" in capsys.readouterr().out
    raw["data"]["train"] = str(tmp_path / "train.jsonl")
    raw["deepspeed"] = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert main(["validate", str(write_job(tmp_path / "job.json", raw))]) == 1
    err = capsys.readouterr().err
    assert "config key 'data.train' is set but 'rollouts.dir' is too" in err
    assert "a rollout job cannot run ZeRO-1/2 with offload_optimizer" in err


def _record(**arrays) -> dict:
    return {"input_ids": IDS, "labels": LABELS, "advantages": [None, None, 1, 1, 1, 1], **arrays}


def test_temperatures_must_be_positive_on_targets(make_jsonl, tiny_processor):
    path = make_jsonl([_record(temperatures=[0, None, 0.7, 1.0, 0.0, 1.3])])
    with pytest.raises(DataError) as info:
        load_samples(path, tiny_processor, max_seq_len=64)
    assert str(info.value).startswith(f"{path}:1: ") and '"temperatures"[4] is 0.0' in str(info.value)


def test_a_pack_fills_in_temperatures_and_inference_logprobs_of_samples_without_them(
        make_jsonl, tiny_processor):
    path = make_jsonl([_record(temperatures=[None, None, 0.5, 0.75, 1.5, 1.25],
                               inference_logprobs=[None, None, -1, -2, -3, -4]), _record()])
    with_arrays, without = load_samples(path, tiny_processor, max_seq_len=64)
    batch = build_batch([with_arrays, without])
    assert set(batch.token_arrays) == {"advantages", "temperatures", "inference_logprobs"}
    assert batch.token_arrays["temperatures"].tolist() == [0, 0.5, 0.75, 1.5, 1.25, 0] + [1] * 5 + [0]
    mu = batch.token_arrays["inference_logprobs"].tolist()
    assert mu[:6] == [0, -1, -2, -3, -4, 0] and all(math.isnan(v) for v in mu[6:11])
    index, problems = build_index([path], tiny_processor, max_seq_len=64)
    assert problems == [] and index.lacking("temperatures").tolist() == [1]
    assert len(index.without([1])) == 1 and index.without([0]).line.tolist() == [2]
    assert index.without([0]).array_names == index.array_names
    # a loss that needs inference_logprobs needs them on every sample: the fill does not count
    Loss.of(LossTerm("policy_gradient")).check_batch(batch)
    with pytest.raises(ValueError, match=r"needs per-token \['inference_logprobs'\]"):
        Loss.of(LossTerm("dppo")).check_batch(batch)


#: Producer-controlled inputs Python's parser or float() cannot take as they are: (line of a
#: tokens record, what the error says).
UNREADABLE_LINES = {
    "an integer of 5000 digits": ('{"input_ids": [1, 10, 11, 12, 13, ' + "9" * 5000 + '], '
                                  '"labels": [-100, -100, 11, 12, 13, 2]}',
                                  "an integer of 5000 digits, more than the 4300 Python reads"),
    "a per-token value beyond the float range": (
        json.dumps(_record(advantages=[None, None, 1, 10**400, 1, 1])),
        '"advantages"[3] is an integer of 401 digits on a target token'),
    "a temperature beyond the float range": (
        json.dumps(_record(temperatures=[None, None, 1, 1, -(10**309), 1])),
        '"temperatures"[4] is an integer of 310 digits on a target token'),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE_LINES))
def test_an_input_python_cannot_read_as_is_is_one_error_of_its_line_and_validate_reports_it(
        case, make_jsonl, tiny_checkpoint, tiny_processor, tmp_path, capsys):
    line, expected = UNREADABLE_LINES[case]
    path = make_jsonl([_record(), line, _record()])
    index, problems = build_index([path], tiny_processor, max_seq_len=64)
    assert index.line.tolist() == [1, 3] and len(problems) == 1
    assert problems[0].startswith(f"{path}:2: ") and expected in problems[0], problems
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, path, tmp_path / "out",
                                                    loss={"type": "policy_gradient"}))
    assert main(["validate", str(job)]) == 1
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}:2: "), errors


def test_a_byte_that_is_not_utf8_is_the_error_of_its_line_or_array_element_only(
        make_jsonl, tiny_processor, tmp_path):
    good = json.dumps(_record()).encode()
    lines = tmp_path / "rollouts.jsonl"
    lines.write_bytes(good + b"\n" + good.replace(b'"labels"', b'"lab\xffels"') + b"\n" + good
                      + b"\n")
    index, problems = build_index([lines], tiny_processor, max_seq_len=64)
    assert index.line.tolist() == [1, 3]
    at = good.index(b"labels") + 3  # the byte's index in its line
    assert problems == [f"{lines}:2: not UTF-8 text (byte 0xff at column {at + 1}, byte "
                        f"{len(good) + 1 + at} of the file)"]
    array = tmp_path / "rollouts.json"
    array.write_bytes(b"[\n" + good + b",\n" + good.replace(b"advantages", b"adv\x80antages")
                      + b",\n" + good + b"\n]\n")
    index, problems = build_index([array], tiny_processor, max_seq_len=64)
    assert index.record.tolist() == [0, 2] and index.line.tolist() == [2, 4]
    assert len(problems) == 1 and problems[0].startswith(f"{array}[1] (line 3): not UTF-8 text "
                                                         "(line 3, byte 0x80 at column"), problems


def test_a_step_that_is_a_file_or_holds_a_data_file_that_is_not_one_is_an_error_naming_it(
        tmp_path):
    step = step_dir(tmp_path, 1)
    step.write_text("")
    assert is_complete(step)  # arrived: read, and refused, rather than waited for
    with pytest.raises(DataError, match=r"step_1: not a directory"):
        read_meta(step)
    other = step_dir(tmp_path, 2)
    (other / "rollouts.jsonl").mkdir(parents=True)
    (other / STABLE).write_text("")
    with pytest.raises(DataError, match=r"step_2/rollouts.jsonl: not a file"):
        step_files(other)
    (other / "meta.json").mkdir()
    with pytest.raises(DataError, match=r"step_2/meta.json: cannot read"):
        read_meta(other)


def test_mismatch_sums_skip_absent_inference_logprobs_and_keep_a_tiny_kl():
    d = 2.0**-20  # exact in fp32 next to 1: k3 = exp(d) - 1 - d = d^2 / 2 + d^3 / 6 + ...
    logp = torch.tensor([-1.0 + d, -2.0, -3.0])
    mu = torch.tensor([-1.0, float("nan"), -2.5])
    diff, kl = mismatch_sums(logp, mu).tolist()
    assert mismatch_count(mu) == 2
    assert mismatch_sums(logp, None).tolist() == [0.0, 0.0] and mismatch_count(None) == 0
    assert diff == pytest.approx(-d + 0.5, rel=1e-12)
    assert kl == pytest.approx(d * d / 2 + math.exp(-0.5) - 1 + 0.5, rel=1e-9)
    tiny = mismatch_sums(logp[:1], mu[:1])
    assert float(tiny[1]) == pytest.approx(d * d / 2, rel=1e-5)


def test_published_steps_are_the_complete_ones_newest_first(tmp_path):
    assert published_steps(tmp_path / "missing") == []
    for name, stable in [("step_2", True), ("step_10", True), ("step_11", False),
                         (".tmp-step_12", True), ("step_x", True)]:
        (tmp_path / name).mkdir()
        if stable:
            (tmp_path / name / STABLE).write_text(json.dumps({"written_by": PUBLISHED_BY}))
    assert published_steps(tmp_path) == [10, 2]


def _waiting_steps(checkpoint, tmp_path, **rollouts):
    raw = _job(checkpoint, tmp_path, rollouts={"dir": str(tmp_path / "rollouts"), **rollouts})
    del raw["data"]["train"]
    return RolloutSteps(job_from_dict(raw), processor=None, sp=None)


def test_waiting_for_a_step_sleeps_ends_on_a_signal_or_the_timeout_and_logs(
        tiny_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    steps = _waiting_steps(tiny_checkpoint, tmp_path, timeout_s=1.0, poll_s=0.1)
    with Watchdog(60, rank=0) as watchdog:
        cpu, wall = time.process_time(), time.monotonic()
        outcome = steps.wait(0, lambda: 0, watchdog)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert outcome.timed_out and outcome.signum == 0 and outcome.waited_s >= 1.0
        assert wall >= 1.0 and cpu < 0.3 * wall, (cpu, wall)  # it slept, it did not spin
        assert f"waiting for rollout step {step_dir(tmp_path / 'rollouts', 1)}" in caplog.text
        assert steps.wait(0, lambda: 15, watchdog) == WaitOutcome(15, False, pytest.approx(0, abs=0.5))
        (step_dir(tmp_path / "rollouts", 1)).mkdir(parents=True)
        (step_dir(tmp_path / "rollouts", 1) / STABLE).write_text("")
        arrived = steps.wait(0, lambda: 15, watchdog)
        assert arrived.signum == 0 and not arrived.timed_out
    assert "rollouts.timeout_s=1: no complete" in steps.timeout_problem(0, 1.0)
