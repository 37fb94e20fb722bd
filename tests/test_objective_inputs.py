"""Per-token arrays of the tokens format: read aligned with labels, shifted with the targets into
the pack, cut with the labels; each bad input is one clear error naming file:line before any rank
starts (`vlmcp validate` runs the same preflight every rank runs first); `vlmcp score` writes one
line per sample in data order."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, write_job
from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.data.dataset import load_samples
from vlmcp.data.pack import build_batch
from vlmcp.errors import ConfigError, DataError

IDS = [1, 10, 11, 12, 13, 2]
LABELS = [-100, -100, 11, 12, 13, 2]


def _record(**arrays) -> dict:
    full = {"advantages": [None, None, 0.5, -1.0, 2.0, 1.0],
            "old_logprobs": [0, 0, -1.5, -2.0, -0.5, -3.0]}
    full.update(arrays)
    return {"input_ids": IDS, "labels": LABELS, **{k: v for k, v in full.items() if v is not None}}


def test_arrays_align_with_labels_and_shift_with_the_targets(make_jsonl, tiny_processor):
    path = make_jsonl([_record(), _record(loss_weights=[9, 9, 1, 2, 3, 4])])
    samples = load_samples(path, tiny_processor, max_seq_len=64)
    assert samples[0].token_arrays["advantages"].tolist() == [0, 0, 0.5, -1.0, 2.0, 1.0]
    batch = build_batch(samples)
    # targets[t] = labels[t+1]; the arrays move with them, and a pack keeps only shared arrays
    assert batch.targets.tolist()[:6] == [-100, 11, 12, 13, 2, -100]
    assert batch.token_arrays["advantages"].tolist()[:6] == [0, 0.5, -1.0, 2.0, 1.0, 0]
    assert set(batch.token_arrays) == {"advantages", "old_logprobs"}


def test_truncation_cuts_the_arrays_with_the_labels(make_jsonl, tiny_processor):
    sample = load_samples(make_jsonl([_record()]), tiny_processor, max_seq_len=4, truncate=True)[0]
    assert len(sample.token_arrays["old_logprobs"]) == len(sample.labels) == 4


def test_bad_arrays_are_data_errors_naming_file_and_line(make_jsonl, tiny_processor):
    cases = {
        "has 5 entries for 6 labels": _record(advantages=[0, 0, 1, 1, 1]),
        '"old_logprobs"[3] is NaN on a target token': _record(
            old_logprobs=[0, 0, -1.0, math.nan, -1.0, -1.0]),
        '"advantages"[2] is null on a target token': _record(advantages=[0, 0, None, 1, 1, 1]),
        "need the tokens format": {"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "7"}],
                                   "advantages": [1.0]},
    }
    for expected, record in cases.items():
        with pytest.raises(DataError) as info:
            load_samples(make_jsonl([record]), tiny_processor, max_seq_len=64)
        assert str(info.value).startswith(f"{make_jsonl([record])}:1: ") and expected in str(info.value)


def test_validate_names_each_bad_sample_of_a_ppo_clip_job(make_jsonl, tiny_checkpoint, tmp_path, capsys):
    data = make_jsonl([
        _record(),
        _record(advantages=[0, 0, 1, 1]),
        _record(old_logprobs=[0, 0, -1.0, math.nan, -1.0, -1.0]),
        _record(old_logprobs=None),
    ])
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, data, tmp_path / "out",
                                                    loss={"type": "ppo_clip"}))
    assert main(["validate", str(job)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3, errors
    assert errors[0].startswith(f"error: {data}:2: ") and "4 entries for 6 labels" in errors[0]
    assert errors[1].startswith(f"error: {data}:3: ") and '"old_logprobs"[3] is NaN' in errors[1]
    assert errors[2].startswith(f"error: {data}:4: ") and "needs a per-token 'old_logprobs'" in errors[2]
    plain = write_job(tmp_path / "plain.json", tiny_job(tiny_checkpoint, make_jsonl([_record()]),
                                                        tmp_path / "out"))
    assert main(["validate", str(plain)]) == 0


def test_kl_penalty_outside_ppo_clip_is_a_config_error(tiny_checkpoint, tmp_path):
    raw = tiny_job(tiny_checkpoint, tmp_path / "d.jsonl", tmp_path / "out",
                   loss={"type": "policy_gradient", "kl_coef": 0.1})
    with pytest.raises(ConfigError, match="loss.kl_coef"):
        job_from_dict(raw)


@pytest.mark.e2e
def test_score_writes_one_line_per_sample_in_data_order(tiny_checkpoint, digits_jsonl, tmp_path):
    samples_file = digits_jsonl / "train.jsonl"
    lines = samples_file.read_text().splitlines()[:5]
    data = tmp_path / "five.jsonl"
    data.write_text("".join(
        json.dumps({**json.loads(line), "images": [str(digits_jsonl / p) for p in json.loads(line)["images"]]}) + "\n"
        for line in lines))
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, data, tmp_path / "out",
                                                    data={"max_seq_len": 64}))
    assert_ok(run_vlmcp(["score", str(job), "--entropy"]))
    records = [json.loads(line) for line in (tmp_path / "out" / "scores.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(5))
    for record in records:
        assert len(record["logprobs"]) == len(record["entropy"]) > 0
        assert all(lp <= 0 for lp in record["logprobs"]) and all(e >= 0 for e in record["entropy"])


def test_score_refuses_a_lora_job_whose_adapters_are_not_at_model_path(make_jsonl, tiny_checkpoint,
                                                                         tmp_path, capsys):
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, make_jsonl([_record()]),
                                                    tmp_path / "out", lora={"r": 4}))
    assert main(["score", str(job)]) == 1
    assert "config key 'lora.r'" in capsys.readouterr().err
