"""Per-token arrays of the tokens format: read aligned with labels, shifted with the targets into
the pack, cut with the labels; each bad input is one clear error naming file:line before any rank
starts (`vlmcp validate` runs the same preflight every rank runs first), read from the length
index: a missing array (of an objective, of mis, of a term's weights), a single sample under a
preference loss or a pair under another, dpo without reference sums; an option that does not
apply to its loss type is a config error naming the key; a reference score file that does not
match the data names its line; `vlmcp score` writes one line per sample in data order."""

from __future__ import annotations

import json
import logging
import math

import pytest

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, write_job
from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.data.dataset import load_samples
from vlmcp.data.pack import build_batch
from vlmcp.errors import ConfigError, DataError
from vlmcp.training.objective_step import objective_of

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


@pytest.mark.parametrize("loss,key", [
    ({"type": "policy_gradient", "clip_high": 0.3}, "loss.clip_high"),
    ({"type": "cispo", "clip_ratio_c": 3.0}, "loss.clip_ratio_c"),
    ({"type": "dpo", "normalize": "sequence"}, "loss.normalize"),
    ({"type": "simpo", "reference_logps": "initial"}, "loss.reference_logps"),
    ({"type": "dppo", "gamma": 1.0}, "loss.gamma"),
    ({"type": "ce", "mismatch": "tis"}, "loss.mismatch"),
    ({"type": "policy_gradient", "mismatch": "tis", "mismatch_low": 0.5}, "loss.mismatch_low"),
    ({"type": "policy_gradient", "mismatch": "mis", "mismatch_reduce": "mean"},
     "loss.mismatch_reduce"),
    ({"type": "policy_gradient", "normalize": "constant"}, "loss.normalize_constant"),
    ({"type": "policy_gradient", "normalize_constant": 100.0}, "loss.normalize_constant"),
    ({"type": "ppo_clip", "clip_ratio_c": 1.0}, "loss.clip_ratio_c"),
    ({"type": "ce", "weights": "mask"}, "loss.weights"),
    ({"terms": [{"type": "ppo_clip"}], "kl_coef": 0.1}, "loss.kl_coef"),
    ({"terms": [{"type": "ce"}, {"type": "opd", "clip_low": 0.1}]}, "loss.terms[1].clip_low"),
    ({"terms": [{"type": "ce"}, {"type": "dpo"}]}, "loss.terms[1].type"),
    ({"terms": [{"type": "ce", "clip_lo": 0.1}]}, "loss.terms[0].clip_lo"),
    ({"type": "dppo", "mismatch": "tis"}, "loss.mismatch"),
    ({"terms": [{"type": "ce"}, {"type": "dppo", "mismatch": "mis"}]}, "loss.terms[1].mismatch"),
    ({"type": "opd", "opd_form": "importance", "mismatch": "tis"}, "loss.mismatch"),
    ({"type": "ppo_clip", "opd_form": "importance"}, "loss.opd_form"),
])
def test_an_option_that_does_not_apply_or_lacks_its_setting_is_a_config_error_naming_the_key(
        loss, key, tiny_checkpoint, tmp_path):
    raw = tiny_job(tiny_checkpoint, tmp_path / "d.jsonl", tmp_path / "out", loss=loss)
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    assert f"'{key}'" in str(info.value)


def test_a_mismatch_correction_on_an_objective_already_against_mu_is_refused_as_double(
        tiny_checkpoint, tmp_path):
    for loss in ({"type": "dppo", "mismatch": "tis"},
                 {"type": "opd", "opd_form": "importance", "mismatch": "mis"}):
        raw = tiny_job(tiny_checkpoint, tmp_path / "d.jsonl", tmp_path / "out", loss=loss)
        with pytest.raises(ConfigError, match="a second time"):
            job_from_dict(raw)


def test_gspo_normalizes_per_sample_by_default_and_warns_on_an_explicit_token(
        tiny_checkpoint, tmp_path, caplog):
    def normalizations(loss):
        job = job_from_dict(tiny_job(tiny_checkpoint, tmp_path / "d.jsonl", tmp_path / "out",
                                     loss=loss))
        return [term.normalize for term in objective_of(job).terms]

    with caplog.at_level(logging.WARNING, logger="vlmcp.config.load"):
        assert normalizations({"type": "gspo"}) == ["sequence"]
        assert normalizations({"terms": [{"type": "gspo"}, {"type": "ce"}]}) == ["sequence",
                                                                                  "token"]
        assert normalizations({"type": "ppo_clip"}) == ["token"]
        assert not caplog.records
        assert normalizations({"terms": [{"type": "ce"}, {"type": "gspo",
                                                          "normalize": "token"}]}) == [
            "token", "token"]
    (record,) = caplog.records
    assert "config key 'loss.terms[1].normalize'" in record.getMessage()
    assert "GSPO paper" in record.getMessage()


def _pair(**extra) -> dict:
    return {"prompt_input_ids": [1, 10, 11], "chosen_input_ids": [12, 2],
            "rejected_input_ids": [13, 2], **extra}


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def test_validate_names_each_sample_a_preference_loss_cannot_train(make_jsonl, tiny_checkpoint,
                                                                   tmp_path, capsys):
    data = make_jsonl([_pair(ref_chosen_logp=-1.0, ref_rejected_logp=-2.0), _pair(),
                       _record()])
    job = write_job(tmp_path / "dpo.json", tiny_job(tiny_checkpoint, data, tmp_path / "out",
                                                    loss={"type": "dpo"}))
    assert main(["validate", str(job)]) == 1
    errors = _errors(capsys)
    assert len(errors) == 2, errors
    assert errors[0].startswith(f"error: {data}:3: ") and "trains on preference pairs" in errors[0]
    assert errors[1].startswith(f"error: {data}:2: ") and "needs the reference logprob sums" \
        in errors[1] and "loss.reference_logps" in errors[1]
    scored = write_job(tmp_path / "initial.json", tiny_job(
        tiny_checkpoint, make_jsonl([_pair(), _pair()], name="pairs.jsonl"), tmp_path / "out",
        loss={"type": "dpo", "reference_logps": "initial"}))
    assert main(["validate", str(scored)]) == 0
    simpo = write_job(tmp_path / "simpo.json", tiny_job(
        tiny_checkpoint, make_jsonl([_pair()], name="one.jsonl"), tmp_path / "out",
        loss={"type": "simpo"}))
    assert main(["validate", str(simpo)]) == 0
    capsys.readouterr()
    ce = write_job(tmp_path / "ce.json", tiny_job(tiny_checkpoint, data, tmp_path / "out"))
    assert main(["validate", str(ce)]) == 1
    errors = _errors(capsys)
    assert [e.split(": ")[1] for e in errors] == [f"{data}:1", f"{data}:2"]
    assert all("trains with loss.type dpo, ipo or simpo, not 'ce'" in e for e in errors)


def test_validate_names_each_sample_without_the_arrays_of_mis_and_of_a_terms_weights(
        make_jsonl, tiny_checkpoint, tmp_path, capsys):
    with_mu = _record(inference_logprobs=[0, 0, -1.4, -2.1, -0.6, -2.9],
                      sft_weights=[0, 0, 1, 0, 1, 1])
    data = make_jsonl([with_mu, _record(), _record(sft_weights=[0, 0, 1, 1, 1, 1])])
    job = write_job(tmp_path / "mis.json", tiny_job(tiny_checkpoint, data, tmp_path / "out", loss={
        "terms": [{"type": "ppo_clip", "mismatch": "mis"},
                  {"type": "ce", "weights": "sft_weights"}]}))
    assert main(["validate", str(job)]) == 1
    errors = _errors(capsys)
    assert len(errors) == 3, errors
    mis = [e for e in errors if "'inference_logprobs'" in e]
    assert [e.split(": ")[1] for e in mis] == [f"{data}:2", f"{data}:3"]
    assert all("loss.terms[0].type 'ppo_clip' with loss.terms[0].mismatch 'mis'" in e for e in mis)
    (weights,) = [e for e in errors if "'sft_weights'" in e]
    assert weights.startswith(f"error: {data}:2: ") and "with loss.terms[1].weights" in weights
    capsys.readouterr()
    opd = write_job(tmp_path / "opd.json", tiny_job(tiny_checkpoint, data, tmp_path / "out", loss={
        "type": "opd", "opd_form": "importance"}))
    assert main(["validate", str(opd)]) == 1
    mu = [e for e in _errors(capsys) if "'inference_logprobs'" in e]
    assert [e.split(": ")[1] for e in mu] == [f"{data}:2", f"{data}:3"]
    assert all("loss.type 'opd' with loss.opd_form \"importance\"" in e for e in mu)


def test_a_reference_score_file_that_does_not_match_data_train_names_its_line(
        make_jsonl, tiny_processor, tmp_path):
    from vlmcp.data.index import build_index
    from vlmcp.training.reference import read_reference

    data = make_jsonl([_pair(), _record(), _pair()])
    index, _ = build_index([data], tiny_processor, 64)
    scores = tmp_path / "ref.jsonl"
    good = {"index": 0, "chosen": {"logprobs": [-1.0, -2.0], "logprob_sum": -3.0},
            "rejected": {"logprobs": [-0.5, -0.5], "logprob_sum": -1.0}}
    scores.write_text("\n".join(json.dumps(r) for r in [
        good, {**good, "index": 1}, {**good, "index": 2, "chosen": {"logprobs": [-1.0]}}]) + "\n")
    sums, problems = read_reference(scores, index)
    assert sums is None and len(problems) == 3, problems
    assert problems[0].startswith(f"config key 'loss.reference_logps': {scores}:2: row 1 ")
    assert "is not a preference pair" in problems[0]
    assert problems[1].startswith(f"config key 'loss.reference_logps': {scores}:3: ")
    assert f"has no scores of {data}:3" in problems[2]
    scores.write_text(json.dumps(good) + "\n" + json.dumps({**good, "index": 2}) + "\n")
    sums, problems = read_reference(scores, index)
    assert not problems and sums[0].tolist() == [-3.0, -1.0] and math.isnan(sums[1, 0])
