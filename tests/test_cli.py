"""The command line: help on every command, `validate` naming each problem on its own line, and
`train` failing on every rank with the same clear error instead of hanging."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import REPO, assert_ok, run_vlmcp, tiny_job, write_job
from tests.helpers.videos import write_video
from vlmcp.cli import build_parser, main
from vlmcp.errors import PreflightError

COMMANDS = ["train", "validate", "inspect", "export", "score", "bench", "demo"]
USER = {"role": "user", "content": "<image>What digit is this?"}
ANSWER = {"role": "assistant", "content": "7"}

#: Expected problem text per bad line, in file order (line 1 and 2 are good).
BAD_LINES = {
    3: "image not found",
    4: "cannot decode image",
    5: "has 2 placeholders",
    6: "more than max_seq_len",
    7: "no target tokens",
    8: "vid/corrupt.mp4: cannot open",
    9: '"videos"[0] is an empty frame list',
    10: '1 video markers (<video> or typed video entries) but the record has no "videos"',
    11: "2 video markers (<video> or typed video entries) for 1 videos",
}
VIDEO_USER = {"role": "user", "content": "<video>What happens?"}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_answers_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"] if command else ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vlmcp") and len(out.splitlines()) > 5


#: Run in a fresh interpreter where the demo extra's packages cannot be imported.
_WITHOUT_DEMO_EXTRA = """
import sys
sys.modules["sklearn"] = sys.modules["matplotlib"] = None  # import fails, find_spec gives None
import vlmcp
from vlmcp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_import_and_help_need_no_demo_extra_and_demo_names_it():
    for command in (["--help"], ["train", "--help"], ["bench", "--help"]):
        result = subprocess.run([sys.executable, "-c", _WITHOUT_DEMO_EXTRA, *command],
                                capture_output=True, text=True, timeout=120, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: vlmcp")
    result = subprocess.run([sys.executable, "-c", _WITHOUT_DEMO_EXTRA, "demo"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 1
    assert "error: vlmcp demo needs scikit-learn and matplotlib (the demo extra): " \
           "pip install 'vlmcp[demo]'" in result.stderr


def test_train_help_documents_every_job_key_and_launcher():
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for key in ("model.path", "data.truncate", "parallel.sp_size", "parallel.deltanet_cp",
                "train.grad_accum", "optimizer.betas", "scheduler.warmup_steps", "deepspeed"):
        assert key in text
    for launcher in ("torchrun", "deepspeed --num_gpus", "accelerate launch"):
        assert launcher in text


@pytest.fixture
def bad_data(make_jsonl, digits_jsonl, tmp_path):
    """Two good lines, then one line per kind of bad input (see BAD_LINES)."""
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    (tmp_path / "vid").mkdir(exist_ok=True)
    (tmp_path / "vid" / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x17" * 200)
    write_video(tmp_path / "vid" / "clip.mp4", 4, 25, 32, 32)
    digit = str(digits_jsonl / json.loads(
        (digits_jsonl / "train.jsonl").read_text().splitlines()[0])["images"][0])
    lines = [
        {"messages": [USER, ANSWER], "images": [digit]},
        {"conversations": [{"from": "human", "value": "Describe the picture."},
                           {"from": "gpt", "value": "A digit."}]},
        {"messages": [USER, ANSWER], "images": ["img/missing.png"]},
        {"messages": [USER, ANSWER], "images": ["img/corrupt.png"]},
        {"input_ids": [1, 3, 5, 5, 4, 20, 21, 2], "labels": [-100] * 5 + [20, 21, 2],
         "images": [digit]},
        {"messages": [{"role": "user", "content": "count " * 200}, ANSWER]},
        {"messages": [USER], "images": [digit]},
        {"messages": [VIDEO_USER, ANSWER], "videos": ["vid/corrupt.mp4"]},
        {"messages": [VIDEO_USER, ANSWER], "videos": [[]]},
        {"messages": [VIDEO_USER, ANSWER]},
        {"messages": [{"role": "user", "content": "<video><video>Same?"}, ANSWER],
         "videos": ["vid/clip.mp4"]},
    ]
    return make_jsonl(lines)


def _bad_job(tiny_checkpoint, data, tmp_path):
    return write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, data, tmp_path / "out",
                                                     data={"max_seq_len": 128}))


def _check_one_line_per_bad_input(stderr: str, data) -> None:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == len(BAD_LINES), stderr
    for line, (number, expected) in zip(lines, BAD_LINES.items()):
        assert line.startswith(f"error: {data}:{number}: ") and expected in line, line


def test_validate_reports_each_bad_input_on_its_own_line(tiny_checkpoint, bad_data, tmp_path,
                                                         capsys):
    assert main(["validate", str(_bad_job(tiny_checkpoint, bad_data, tmp_path))]) == 1
    _check_one_line_per_bad_input(capsys.readouterr().err, bad_data)


#: Nested deeper than Python's JSON parser (json.loads raises RecursionError on it).
_DEEP = 5000
#: JSON that Python's parser cannot read: (the value, what the error says).
_UNREADABLE = {"nested too deeply": ("[" * _DEEP + "]" * _DEEP,
                                     "levels deep, deeper than the JSON parser can read"),
               "an integer too long": ("7" * 5000, "an integer of 5000 digits, more than the 4300 "
                                                   "Python reads")}


@pytest.mark.parametrize("what", sorted(_UNREADABLE))
@pytest.mark.parametrize("where", ["data_jsonl", "data_json_array", "job", "deepspeed_json"])
def test_json_python_cannot_read_is_one_error_line_naming_the_file(where, what, tiny_checkpoint,
                                                                   digits_jsonl, tmp_path, capsys):
    deep, expected = _UNREADABLE[what]
    data = digits_jsonl / "train.jsonl"
    job = tiny_job(tiny_checkpoint, data, tmp_path / "out")
    if where == "data_jsonl":
        good = json.loads((digits_jsonl / "train.jsonl").read_text().splitlines()[0])
        good["images"] = [str(digits_jsonl / image) for image in good["images"]]
        data = tmp_path / "deep.jsonl"
        data.write_text(json.dumps(good) + "\n" + '{"messages": ' + deep + "}\n")
        job["data"]["train"] = str(data)
    elif where == "data_json_array":
        data = tmp_path / "deep.json"
        data.write_text("[" + deep + "]")
        job["data"]["train"] = str(data)
    elif where == "deepspeed_json":
        data = tmp_path / "ds.json"
        data.write_text('{"zero_optimization": ' + deep + "}")
        job["deepspeed"] = str(data)
    path = write_job(tmp_path / "job.json", job)
    if where == "job":
        data = path
        path.write_text('{"model": ' + deep + "}")
    assert main(["validate", str(path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert str(data) in errors[0], errors[0]
    assert expected in errors[0], errors[0]


def test_validate_accepts_a_clean_job_and_names_the_world(tiny_checkpoint, digits_jsonl,
                                                          tmp_path, capsys):
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl",
                                                    tmp_path / "out", parallel={"sp_size": 2}))
    assert main(["validate", str(job), "--world-size", "4"]) == 0
    assert "64 train" in capsys.readouterr().out
    assert main(["validate", str(job), "--world-size", "3"]) == 1
    assert "parallel.sp_size" in capsys.readouterr().err


def test_validate_names_every_violated_sp_constraint_of_the_model(tiny_checkpoint, digits_jsonl,
                                                                   tmp_path, capsys):
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
        parallel={"sp_size": 3, "deltanet_cp": "heads"}))
    assert main(["validate", str(job), "--world-size", "6"]) == 1
    err = capsys.readouterr().err
    for expected in ("num_attention_heads=4", "num_key_value_heads=2", "linear_num_key_heads=2",
                     "linear_num_value_heads=4"):
        assert expected in err, err


def test_a_fresh_run_refuses_an_output_dir_holding_earlier_checkpoints(tiny_checkpoint, digits_jsonl,
                                                                       tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step4")
    job = write_job(tmp_path / "job.json", tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", out))
    assert main(["validate", str(job)]) == 1
    err = capsys.readouterr().err
    assert "config key 'output_dir'" in err and "train.resume=true" in err
    assert (out / "checkpoints" / "latest").read_text() == "step4"


def test_unknown_config_key_fails_validate_and_train_naming_the_key(tiny_checkpoint, digits_jsonl,
                                                                   tmp_path, capsys):
    raw = tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out")
    raw["train"]["max_stepz"] = 3
    job = write_job(tmp_path / "job.json", raw)
    for command in ("validate", "train"):
        assert main([command, str(job)]) == 1
        assert capsys.readouterr().err == "error: unknown config key 'train.max_stepz'\n"


def test_deepspeed_config_problems_name_the_deepspeed_key(tiny_checkpoint, digits_jsonl, tmp_path,
                                                          capsys):
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
        deepspeed={"gradient_accumulation_steps": 8}))
    assert main(["validate", str(job)]) == 1
    err = capsys.readouterr().err
    assert "deepspeed.gradient_accumulation_steps" in err and "train.grad_accum" in err


@pytest.mark.e2e
def test_train_under_torchrun_fails_on_every_rank_with_the_validate_lines(
        tiny_checkpoint, bad_data, tmp_path):
    result = run_vlmcp(["train", str(_bad_job(tiny_checkpoint, bad_data, tmp_path))],
                       launcher="torchrun", nproc=2, timeout=120)
    assert result.returncode != 0
    _check_one_line_per_bad_input(result.stderr, bad_data)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def _problems_on_rank_one_only():
    from vlmcp.parallel import comm
    from vlmcp.parallel.agree import fail_together

    try:
        fail_together(["data.train: only rank 1 sees this"] if comm.rank() == 1 else [],
                      PreflightError)
    except PreflightError as exc:
        return exc.problems
    return None


@pytest.mark.e2e
def test_a_problem_on_one_rank_stops_every_rank_and_is_reported_once():
    assert run_ranks(_problems_on_rank_one_only, 2) == [[], ["data.train: only rank 1 sees this"]]


@pytest.mark.e2e
def test_console_script_and_module_share_the_cli():
    result = run_vlmcp(["--help"])
    assert_ok(result)
    assert "validate" in result.stdout
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'vlmcp = "vlmcp.cli:main"' in pyproject


@pytest.mark.e2e
def test_bench_reports_throughput_and_memory_per_length_under_sp2(tmp_path):
    out = tmp_path / "bench.json"
    result = run_vlmcp(["bench", "--seq-lens", "64,128", "--steps", "1", "--warmup", "0",
                        "--out", str(out)], launcher="torchrun", nproc=2)
    assert_ok(result)
    report = json.loads(out.read_text())
    assert report["sp_size"] == 2 and report["world_size"] == 2
    assert [row["seq_len"] for row in report["results"]] == [64, 128]
    for row in report["results"]:
        assert row["tokens_per_s"] > 0 and row["peak_memory_mb"] >= row["model_memory_mb"] > 0
        assert not row["fresh_process"] and [r["rank"] for r in row["per_rank"]] == [0, 1]
