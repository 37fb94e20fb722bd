"""Dataset files as people have them: JSON arrays and JSONL by content, the "image" alias,
absolute paths and data.image_root, audio errors, file lists and weighted mixtures."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.images import save_png
from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, train_losses, write_job
from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.data.dataset import load_samples, validate_data
from vlmcp.data.mixture import draws_per_epoch, epoch_draws
from vlmcp.data.sources import DataFile, data_files, iter_records
from vlmcp.errors import ConfigError, DataError, DataSpecError

QUESTION = "What digit is this?"


def _record(answer: str = "7", **images) -> dict:
    return {"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                         {"role": "assistant", "content": answer}], **images}


def _write_array(path: Path, records: list) -> Path:
    """A JSON array with "[" on line 1 and record i on line i + 2."""
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
    return path


# --------------------------------------------------------------------------- reading files


def test_json_array_is_detected_by_content_whatever_the_extension(tmp_path):
    records = [{"a": 1}, {"b": [1, 2]}, {"c": "x"}]
    path = tmp_path / "data.jsonl"
    path.write_text("  \n" + json.dumps(records, indent=2))
    got = list(iter_records(path))
    assert [record for _, record in got] == records
    # indent=2 after a blank line: "[" on line 2, the records open on lines 3, 6 and 12
    assert [label for label, _ in got] == [f"{path}[0] (line 3)", f"{path}[1] (line 6)",
                                           f"{path}[2] (line 12)"]


def test_jsonl_with_a_json_extension_is_read_line_by_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('\n{"a": 1}\n\n{"b": 2}\n')
    assert list(iter_records(path)) == [(f"{path}:2", {"a": 1}), (f"{path}:4", {"b": 2})]


def test_malformed_json_array_is_one_error_with_line_and_column(tmp_path):
    path = tmp_path / "data.json"
    good = json.dumps([_record()] * 6, indent=2).splitlines()
    good[30] = good[30] + " oops"  # inside the third record: still the only item of the file
    path.write_text("\n".join(good))
    ((label, error),) = list(iter_records(path))
    assert label == str(path) and isinstance(error, DataError)
    assert str(error).startswith(f"{path}:31:") and "malformed JSON array" in str(error)


def test_unclosed_json_array_names_the_end_of_the_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"a": 1},\n {"b": 2}\n')
    label, error = list(iter_records(path))[-1]
    assert "the array is not closed" in str(error) and str(error).startswith(f"{path}:3:1")


def test_pretty_printed_object_is_one_error_not_one_per_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(_record(), indent=2))
    ((label, error),) = list(iter_records(path))
    assert "spread over several lines" in str(error)


def test_jsonl_with_a_cut_first_line_still_reports_each_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [\n{"a": 1}\n')
    got = list(iter_records(path))
    assert [label for label, _ in got] == [f"{path}:1", f"{path}:2"]
    assert isinstance(got[0][1], DataError) and got[1][1] == {"a": 1}


def test_array_record_that_is_not_an_object_names_its_index(tmp_path):
    path = _write_array(tmp_path / "data.json", [{"a": 1}, [1, 2]])
    (_, first), (label, error) = iter_records(path)
    assert first == {"a": 1}
    assert str(error) == f"{path}[1] (line 3): a record must be a JSON object, got an array"


def test_empty_array_and_missing_file_are_one_error_each(tmp_path):
    (tmp_path / "empty.json").write_text(" [ ] ")
    ((_, error),) = list(iter_records(tmp_path / "empty.json"))
    assert str(error).endswith("empty.json: no samples")
    ((_, error),) = list(iter_records(tmp_path / "nope.json"))
    assert "nope.json: cannot open" in str(error)


def test_validate_names_every_bad_record_of_an_array_by_index(tmp_path, tiny_processor):
    save_png(tmp_path / "img" / "a.png", 32, 32)
    records = [_record(images=["img/a.png"]), _record(images=["img/missing.png"]),
               _record(images=["img/a.png"]), {"text": "hi"}]
    path = _write_array(tmp_path / "data.txt", records)
    problems = validate_data(path, tiny_processor, max_seq_len=64)
    assert [p.split(": ")[0] for p in problems] == [f"{path}[1] (line 3)", f"{path}[3] (line 5)"]
    assert "image not found" in problems[0] and "unknown format" in problems[1]


# --------------------------------------------------------------------------- record fields


def test_image_alias_string_and_list_equal_images(tmp_path, tiny_processor):
    save_png(tmp_path / "img" / "a.png", 32, 32)
    path = _write_array(tmp_path / "data.json", [
        _record(images=["img/a.png"]), _record(image="img/a.png"), _record(image=["img/a.png"])])
    samples = load_samples(path, tiny_processor, max_seq_len=256)
    for other in samples[1:]:
        assert other.input_ids == samples[0].input_ids
        assert other.pixel_values.equal(samples[0].pixel_values)


def test_image_and_images_together_is_an_error_naming_the_sample(tmp_path, tiny_processor):
    save_png(tmp_path / "img" / "a.png", 32, 32)
    path = _write_array(tmp_path / "data.json", [_record(image="img/a.png", images=["img/a.png"])])
    with pytest.raises(DataError, match=r'data.json\[0\] \(line 2\): both "image" and "images"'):
        load_samples(path, tiny_processor, max_seq_len=256)


def test_absolute_image_paths_and_image_root(tmp_path, tiny_processor):
    image = save_png(tmp_path / "pictures" / "a.png", 32, 32)
    data = tmp_path / "data"
    data.mkdir()
    absolute = _write_array(data / "abs.json", [_record(image=str(image))])
    relative = _write_array(data / "rel.json", [_record(image="a.png")])
    (sample,) = load_samples(absolute, tiny_processor, max_seq_len=256)
    assert sample.image_paths == [str(image)]
    (sample,) = load_samples(relative, tiny_processor, 256, image_root=tmp_path / "pictures")
    assert sample.image_paths == [str(image)]
    with pytest.raises(DataError, match=f"image not found: {data}/a.png"):
        load_samples(relative, tiny_processor, max_seq_len=256)


@pytest.mark.parametrize("record,expected", [
    ({**_record(), "audios": ["a.wav"]}, '"audios": audio is not supported'),
    ({**_record(), "audio": "a.wav"}, '"audio": audio is not supported'),
    ({"messages": [{"role": "user", "content": "<audio>What is said?"},
                   {"role": "assistant", "content": "hi"}]}, "<audio> marker: audio"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]},
                   {"role": "assistant", "content": "hi"}]}, 'type "audio": audio'),
])
def test_audio_records_are_clear_errors(record, expected, tmp_path, tiny_processor):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"data.jsonl:1: .*{expected}"):
        load_samples(path, tiny_processor, max_seq_len=256)


# --------------------------------------------------------------------------- file lists


def test_data_files_accepts_a_path_a_list_and_weighted_objects():
    assert data_files("a.jsonl") == [DataFile("a.jsonl", 1.0, "data.train")]
    assert data_files(["a.jsonl", {"path": "b.json", "weight": 2}, {"path": "c.json"}]) == [
        DataFile("a.jsonl", 1.0, "data.train[0]"), DataFile("b.json", 2.0, "data.train[1]"),
        DataFile("c.json", 1.0, "data.train[2]")]


def test_data_files_names_every_bad_key():
    with pytest.raises(DataSpecError) as info:
        data_files(["a.jsonl", {"path": "b", "weight": -1}, {"weight": 2}, 3,
                    {"path": "c", "wieght": 2}])
    assert info.value.problems == [
        "config key 'data.train[1].weight': must be a finite number > 0, got -1",
        "missing required config key 'data.train[2].path'",
        "config key 'data.train[3]': expected a path string or an object "
        '{"path": ..., "weight": ...}, got 3',
        "unknown config key 'data.train[4].wieght'"]


def test_job_config_validates_data_lists_and_rejects_eval_weights():
    base = {"model": {"path": "ckpt"}}
    job = job_from_dict({**base, "data": {"train": ["a.jsonl", {"path": "b.json", "weight": 0.5}],
                                          "eval": ["c.json", {"path": "d.json"}],
                                          "image_root": "/images"}})
    assert job.data.train[1] == {"path": "b.json", "weight": 0.5}
    assert job.data.image_root == "/images"
    with pytest.raises(ConfigError) as info:
        job_from_dict({**base, "data": {"train": [{"path": "a", "weight": "2"}], "eval": [
            {"path": "e", "weight": 2}]}})
    assert info.value.problems[0] == \
        "config key 'data.train[0].weight': expected a number, got \"2\""
    assert info.value.problems[1].startswith("unknown config key 'data.eval[0].weight'")
    with pytest.raises(ConfigError, match=r"'data.train': the list names no file"):
        job_from_dict({**base, "data": {"train": []}})


# --------------------------------------------------------------------------- mixtures


def test_mixture_draws_round_w_times_n_of_each_file():
    counts, weights = [10, 4, 3], [0.5, 2.5, 1.0]
    assert draws_per_epoch(counts, weights) == [5, 10, 3]
    draws = epoch_draws(counts, weights, seed=0, epoch=0, shuffle=True)
    per_file = Counter(f for f, _ in draws)
    assert per_file == {0: 5, 1: 10, 2: 3}
    half = [i for f, i in draws if f == 0]
    assert len(set(half)) == 5  # a subset: no sample twice
    times = Counter(i for f, i in draws if f == 1)
    assert sorted(times.values()) == [2, 2, 3, 3]  # two copies plus a 2-sample remainder
    assert Counter(i for f, i in draws if f == 2) == {0: 1, 1: 1, 2: 1}


def test_mixture_order_is_a_pure_function_of_seed_and_epoch():
    args = ([10, 4, 3], [0.5, 2.5, 1.0])
    assert epoch_draws(*args, seed=3, epoch=1, shuffle=True) == \
        epoch_draws(*args, seed=3, epoch=1, shuffle=True)
    assert epoch_draws(*args, seed=3, epoch=1, shuffle=True) != \
        epoch_draws(*args, seed=3, epoch=2, shuffle=True)
    subsets = {tuple(i for f, i in epoch_draws(*args, seed=3, epoch=e, shuffle=False) if f == 0)
               for e in range(4)}
    assert len(subsets) > 1  # the seeded half changes from epoch to epoch


def test_one_file_of_weight_one_keeps_the_earlier_order():
    assert epoch_draws([5], [1.0], seed=0, epoch=0, shuffle=False) == [(0, i) for i in range(5)]
    import torch

    permutation = torch.randperm(5, generator=torch.Generator().manual_seed(7 * 1_000_003 + 2))
    assert epoch_draws([5], [1.0], seed=7, epoch=2, shuffle=True) == \
        [(0, i) for i in permutation.tolist()]


def test_unshuffled_mixture_lists_files_in_order():
    draws = epoch_draws([2, 3], [1.0, 2.0], seed=0, epoch=0, shuffle=False)
    assert draws == [(0, 0), (0, 1)] + [(1, i) for i in range(3)] * 2


# --------------------------------------------------------------------------- whole jobs


@pytest.fixture
def mixture_job(tiny_checkpoint, digits_jsonl, tmp_path):
    """A JSON-array file of 8 digits records with "image" paths relative to data.image_root,
    mixed with the 64-record digits JSONL at weight 0.25: 8 + 16 samples per epoch."""
    lines = (digits_jsonl / "train.jsonl").read_text().splitlines()[:8]
    records = [{"messages": r["messages"], "image": r["images"][0]} for r in map(json.loads, lines)]
    (tmp_path / "data").mkdir()
    array = _write_array(tmp_path / "data" / "digits.txt", records)
    job = tiny_job(tiny_checkpoint, array, tmp_path / "out", train={"max_steps": 2, "log_every": 1})
    job["data"].update({"train": [str(array), {"path": str(digits_jsonl / "train.jsonl"),
                                               "weight": 0.25}],
                        "eval": [{"path": str(array)}], "image_root": str(digits_jsonl)})
    return write_job(tmp_path / "job.json", job)


def test_validate_accepts_a_json_array_mixture_job(mixture_job, capsys):
    assert main(["validate", str(mixture_job)]) == 0
    assert "72 train (24 per epoch), 8 eval samples" in capsys.readouterr().out


def test_validate_lists_every_bad_file_and_record_of_a_mixture(mixture_job, tmp_path, capsys):
    job = json.loads(mixture_job.read_text())
    broken = tmp_path / "broken.json"
    broken.write_text('[\n {"messages": []},\n {"messages": [}\n]\n')
    job["data"]["train"] += [str(broken), {"path": str(mixture_job.parent / "data" / "digits.txt"),
                                           "weight": 0.01}, "missing.jsonl"]
    mixture_job.write_text(json.dumps(job))
    assert main(["validate", str(mixture_job)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {broken}:3:16: malformed JSON array: Expecting value",
        "error: config key 'data.train[4]': file not found: 'missing.jsonl' (looked in "
        f"{tmp_path} and in {Path.cwd()})",
        "error: config key 'data.train[3].weight': 0.01 x 8 samples rounds to 0 samples per epoch"]


def test_a_missing_image_root_is_one_problem(mixture_job, tmp_path, capsys):
    assert main(["validate", str(mixture_job), "--set", "data.image_root=nowhere"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: config key 'data.image_root': directory not found: 'nowhere' "
                      f"(looked in {tmp_path} and in {Path.cwd()})"]


@pytest.mark.e2e
def test_a_json_array_mixture_job_trains(mixture_job, tmp_path):
    result = run_vlmcp(["train", str(mixture_job)])
    assert_ok(result)
    assert "mixture, samples per epoch: [0] 8 x 1 -> 8, [1] 64 x 0.25 -> 16" in result.stderr
    assert len(train_losses(tmp_path / "out")) == 2
