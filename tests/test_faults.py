"""Faults lose nothing: atomic checkpoints with fallback resume, stop signals (a clean stop leaves
OUTPUT_DIR/stopped.json and a stop row), non-finite steps, a frozen rank, a full disk, a pack that
fails on one rank with any exception, a metrics file rank 0 cannot write. Every run is `vlmcp train` under torchrun, 2 CPU ranks over gloo,
SP 2, a tiny model, a few steps of 64-token packs, and runs under a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.helpers.disks import small_tmpfs
from tests.helpers.images import save_png
from tests.helpers.launching import (REPO, assert_ok, launched, launcher_prefix, run_vlmcp,
                                     tiny_job, train_losses, vlmcp_frames, write_job)
from vlmcp.cli import main
from vlmcp.training.atomic import write_text_atomic
from vlmcp.training.checkpoint import MANIFEST, incomplete_reason, newest_complete
from vlmcp.training.signals import STOP_MARKER

STEPS = 8


def _job(checkpoint, digits, out, zero=2, parallel=None, **train):
    return tiny_job(checkpoint, digits / "train.jsonl", out,
                    data={"max_seq_len": 64, "shuffle": True},
                    parallel=parallel or {"sp_size": 2},
                    optimizer={"type": "adamw", "lr": 2e-3, "weight_decay": 0.01},
                    deepspeed={"zero_optimization": {"stage": zero}},
                    train={"seed": 3, "max_steps": STEPS, **train})


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _start(job: Path, log: Path) -> subprocess.Popen:
    """torchrun with 2 ranks in the background; output to `log`."""
    command = [*launcher_prefix("torchrun", 2), "train", str(job)]
    return subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _wait_for_rows(out: Path, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {rows} metrics rows in {metrics} (exit {proc.poll()})")


@contextlib.contextmanager
def _after_the_first_row(job: Path, out: Path, log: Path
                         ) -> Iterator[tuple[subprocess.Popen, list[psutil.Process]]]:
    """`_start(job, log)`, waited for until its first metrics row: yields the launcher and its
    descendants (ranks, loader workers); kills whatever of them is left on the way out."""
    proc = _start(job, log)
    workers: list[psutil.Process] = []
    try:
        _wait_for_rows(out, 1, proc)
        workers = psutil.Process(proc.pid).children(recursive=True)
        yield proc, workers
    finally:
        for worker in workers:
            if worker.is_running():
                worker.kill()
        if proc.poll() is None:
            proc.kill()


def _rank(processes: list[psutil.Process], rank: int) -> psutil.Process:
    return next(p for p in processes if p.environ().get("RANK") == str(rank))


def _strict_rows(path: Path) -> list[dict]:
    def refuse(constant: str) -> None:
        raise ValueError(f"bare {constant} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, digits_jsonl, tmp_path_factory):
    """An uninterrupted run: checkpoints every 2 steps, the newest 2 kept."""
    out = tmp_path_factory.mktemp("reference") / "out"
    job = write_job(out.parent / "job.json", _job(tiny_checkpoint, digits_jsonl, out,
                                                  save_every=2, keep_checkpoints=2))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2))
    return out


@pytest.mark.e2e
def test_checkpoints_are_published_with_a_manifest_and_only_the_newest_are_kept(reference):
    checkpoints = reference / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step6", "step8"]
    assert (checkpoints / "latest").read_text() == "step8"
    manifest = json.loads((checkpoints / "step8" / MANIFEST).read_text())
    assert manifest["step"] == 8
    assert {name: (checkpoints / "step8" / name).stat().st_size for name in manifest["files"]} \
        == manifest["files"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in manifest["files"]
    assert not list(reference.glob(".tmp-*")) and not list(checkpoints.glob(".tmp-*"))


@pytest.mark.e2e
def test_resume_skips_an_incomplete_newest_checkpoint_and_is_exact_from_the_previous(
        reference, tiny_checkpoint, digits_jsonl, tmp_path, caplog):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "checkpoints" / "step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, out, save_every=2,
                                                keep_checkpoints=2, resume=True))
    assert main(["validate", str(job), "--world-size", "2"]) == 0
    assert "optim_states.pt is missing" in caplog.text

    result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2)
    assert_ok(result)
    assert "skipping an incomplete checkpoint" in result.stderr
    assert "resumed from" in result.stderr and "at step 6" in result.stderr
    assert train_losses(out) == train_losses(reference)
    assert incomplete_reason(out / "checkpoints" / "step8") is None

    truncated = out / "checkpoints" / "step6" / "mp_rank_00_model_states.pt"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    (out / "checkpoints" / "step8" / MANIFEST).unlink()
    tag, skipped = newest_complete(out / "checkpoints")
    assert tag is None and len(skipped) == 2
    assert f"has no {MANIFEST}" in skipped[0] and f"{truncated} has 1000 bytes" in skipped[1]
    assert main(["validate", str(job), "--world-size", "2"]) == 1


@pytest.mark.e2e
def test_sigterm_mid_run_saves_a_checkpoint_and_resume_is_exact(
        reference, tiny_checkpoint, digits_jsonl, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, out))
    log = tmp_path / "log"
    proc = _start(job, log)
    try:
        _wait_for_rows(out, 1, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stopped on a signal after step" in text, text[-3000:]
    assert "exitcode  : 143" in text or "exit 143" in text, text[-3000:]
    tag, skipped = newest_complete(out / "checkpoints")
    assert tag is not None and not skipped
    stopped_at = int(tag.removeprefix("step"))
    assert 1 <= stopped_at < STEPS
    assert not (out / "final").exists()
    # what tells the launcher's caller that this was a clean stop (torchrun itself exits 1)
    stop = {"step": stopped_at, "stopped": "SIGTERM", "exit_code": 143,
            "checkpoint": str(out / "checkpoints" / tag)}
    assert json.loads((out / STOP_MARKER).read_text()) == stop
    assert _strict_rows(out / "metrics.jsonl")[-1] == stop

    assert_ok(run_vlmcp(["train", str(job), "--set", "train.resume=true"], launcher="torchrun",
                        nproc=2))
    assert train_losses(out) == train_losses(reference)
    assert not (out / STOP_MARKER).exists()


@pytest.mark.e2e
@pytest.mark.parametrize("zero,mode", [(0, "abort"), (3, "skip")])
def test_a_huge_lr_stops_the_run_without_nan_weights_and_metrics_stay_strict_json(
        zero, mode, tiny_checkpoint, digits_jsonl, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(
        tiny_checkpoint, digits_jsonl, out, zero=zero, nonfinite=mode, max_skipped_steps=1))
    result = run_vlmcp(["train", str(job), "--set", "optimizer.lr=1e6"], launcher="torchrun",
                       nproc=2, timeout=180)
    assert result.returncode != 0
    assert "non-finite" in result.stderr and "train.jsonl:" in result.stderr
    rows = _strict_rows(out / "metrics.jsonl")
    bad = [row for row in rows if row.get("nonfinite")]
    assert bad and all(row["skipped_step"] for row in bad)
    assert len(bad) == (1 if mode == "abort" else 2)
    assert not (out / "final").exists()
    tag, _ = newest_complete(out / "checkpoints")
    assert tag == f"step{bad[-1]['step'] - 1}"
    exported = tmp_path / "exported"
    assert main(["export", str(job), "--out", str(exported)]) == 0
    for path in exported.glob("*.safetensors"):
        for key, value in load_file(path).items():
            assert value.float().isfinite().all(), key


@pytest.mark.e2e
@pytest.mark.parametrize("checkpoint, parallel", [
    ("tiny_checkpoint", {"sp_size": 2}),
    # MoE at expert parallelism 2: every step's MoE layers exchange tokens by all-to-all
    ("tiny_moe_checkpoint", {"ep_size": 2}),
], ids=["sp2", "moe_ep2"])
def test_a_frozen_rank_ends_the_whole_job_naming_the_collective(checkpoint, parallel, digits_jsonl,
                                                                tmp_path, request):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(request.getfixturevalue(checkpoint), digits_jsonl,
                                                out, parallel=parallel, max_steps=100000,
                                                collective_timeout_s=15))
    log = tmp_path / "log"
    # After the first rank exits, torchrun SIGTERMs the others and SIGKILLs them 30 s later (a
    # fixed grace in torch 2.13's agent): a stopped rank would pay those 30 s. Once torchrun sent
    # it SIGTERM the test resumes it, and the pending SIGTERM ends it at once.
    with _after_the_first_row(job, out, log) as (proc, workers):
        frozen = _rank(workers, 1)
        frozen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        closing = f"Sending process {frozen.pid} closing signal SIGTERM"
        while closing not in log.read_text() and proc.poll() is None:
            assert time.monotonic() - stopped_at < 90, log.read_text()[-3000:]
            time.sleep(0.2)
        frozen.resume()
        proc.wait(timeout=90)
        gone = psutil.wait_procs(workers, timeout=max(1.0, 90 - (time.monotonic() - stopped_at)))
        assert not gone[1], f"still alive: {gone[1]}"
        elapsed = time.monotonic() - stopped_at
    text = log.read_text()
    assert elapsed < 90
    assert proc.returncode != 0
    lines = [line for line in text.splitlines() if "did not finish within" in line]
    assert lines, text[-3000:]
    assert "step " in lines[0] and "train.collective_timeout_s=15 s: waiting in collective " \
        "torch.distributed." in lines[0], lines[0]
    # the peer waits in whichever collective comes first: an SP or EP group's, ZeRO's reduction
    # over the world, or the agreement on a stop signal between two steps (the world's)
    groups = ["group of ranks [0, 1]", "the default group (ranks 0..1)"]
    assert any(group in lines[0] for group in groups), lines[0]
    print(f"frozen rank: all processes gone {elapsed:.1f} s after SIGSTOP; {lines[0]}",
          file=sys.stderr)


@pytest.mark.e2e
def test_a_rank_killed_mid_run_ends_its_peer_at_once_with_one_line_naming_the_collective(
        tiny_moe_checkpoint, digits_jsonl, tmp_path):
    """MoE at EP 2, so every step's MoE layers exchange tokens by all-to-all. Rank 1 is killed
    (SIGKILL, as the OOM killer does): rank 0's collective with it fails, and rank 0 exits 1 by
    itself (torchrun never has to SIGKILL it, its loader worker included, which ignores SIGTERM)
    with one error line naming the step, the collective and its group; no traceback."""
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(tiny_moe_checkpoint, digits_jsonl, out,
                                                parallel={"ep_size": 2}, max_steps=100000,
                                                collective_timeout_s=60))
    log = tmp_path / "log"
    with _after_the_first_row(job, out, log) as (proc, workers):
        _rank(workers, 1).kill()
        proc.wait(timeout=120)
        assert not psutil.wait_procs(workers, timeout=30)[1]
    text = log.read_text()
    survivor = text.split("rank      : 0 (local_rank: 0)")[1].splitlines()[1]
    assert "exitcode  : 1 " in survivor and "Unable to shutdown" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    # the phase: a step, or the agreement on a stop signal between two steps
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: "), text[-3000:]
    assert "step " in errors[0].split(": collective ")[0], errors
    assert "failed: " in errors[0] and "collective torch.distributed." in errors[0]
    assert "on group of ranks [0, 1]" in errors[0] or "the default group" in errors[0], errors
    assert vlmcp_frames(text) == [] and "Traceback" not in text.split("error: ")[0], text[-3000:]


@pytest.mark.e2e
def test_a_frozen_rank_in_vlmcp_score_routes_at_ep2_ends_its_peer_naming_the_round(
        tiny_moe_checkpoint, tmp_path):
    """`vlmcp score --routes` at EP 2 (R2: every round's MoE layers exchange tokens by
    all-to-all) over 1000 rounds; once rank 0's progress bar counts a round, rank 1 is frozen
    (SIGSTOP). Rank 0's watchdog ends it with one line naming the round and the collective;
    the test then ends the frozen rank itself rather than wait for torchrun's 30 s SIGKILL."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(_tokens_line() + "\n" for _ in range(2000)))
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_moe_checkpoint, data, tmp_path / "out", data={"max_seq_len": 6},
        parallel={"ep_size": 2}, train={"collective_timeout_s": 15}))
    log = tmp_path / "log"
    with launched(["score", str(job), "--routes"], log, wait_s=90) as proc:
        deadline = time.monotonic() + 150
        while not re.search(r"score:\s+\d+%.*\b[1-9]\d*/1000", log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        ranks = psutil.Process(proc.pid).children()
        first, frozen = _rank(ranks, 0), _rank(ranks, 1)
        frozen.send_signal(signal.SIGSTOP)
        assert not psutil.wait_procs([first], timeout=75)[1]
        frozen.kill()
    text = log.read_text()
    lines = [line for line in text.splitlines() if "did not finish within" in line]
    assert len(lines) == 1 and "rank 0: score round " in lines[0], text[-3000:]
    assert " of 1000 did not finish within train.collective_timeout_s=15 s: waiting in " \
        "collective torch.distributed." in lines[0], lines[0]
    assert proc.returncode != 0 and not (tmp_path / "out" / "scores.jsonl").exists()


@pytest.mark.e2e
def test_a_full_disk_is_named_and_the_previous_checkpoint_stays_intact(
        tiny_checkpoint, digits_jsonl, tmp_path):
    # One checkpoint of this job takes about 3.7 MB: the first fits, the second does not.
    with small_tmpfs(tmp_path / "small", "6m") as small:
        out = small / "out"
        job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, out,
                                                    save_every=2, max_steps=4))
        result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2)
        assert result.returncode != 0
        assert f"no space left on {small}" in result.stderr, result.stderr[-3000:]
        assert "iostream error" not in result.stderr.split("error: no space")[-1]
        assert newest_complete(out / "checkpoints") == ("step2", [])
        assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.e2e
def test_an_export_to_a_full_disk_leaves_no_half_written_model_and_names_the_disk(
        reference, tiny_checkpoint, digits_jsonl, tmp_path, capsys):
    # The exported tiny model takes about 1 MB.
    with small_tmpfs(tmp_path / "small", "256k") as small:
        job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, reference))
        assert main(["export", str(job), "--out", str(small / "model")]) == 1
        assert f"no space left on {small}" in capsys.readouterr().err
        assert list(small.iterdir()) == []
        assert newest_complete(reference / "checkpoints") == ("step8", [])


def test_validate_rejects_a_non_finite_lr_and_an_unwritable_output_dir(
        tiny_checkpoint, digits_jsonl, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, blocker / "out"))
    assert main(["validate", str(job), "--set", "optimizer.lr=NaN"]) == 1
    assert "config key 'optimizer.lr': must be a finite number, got nan" in capsys.readouterr().err
    assert main(["validate", str(job), "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert f"config key 'output_dir': cannot write to {blocker / 'out'}" in err


_SIGNAL_SCRIPT = """
import logging, os, signal, time
from vlmcp.training.signals import StopSignals
logging.basicConfig()
with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
    assert stop.signum == signal.SIGUSR1
    os.kill(os.getpid(), signal.SIGTERM)  # within 1 s of the first: counts once
    time.sleep(1.2)
    print("still running", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
"""


@pytest.mark.e2e
def test_a_second_signal_stops_at_once_with_128_plus_its_number():
    result = subprocess.run([sys.executable, "-c", _SIGNAL_SCRIPT], env=_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout == "still running\n", result.stderr
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "received SIGTERM again: stopping at once" in result.stderr


def _tokens_line(advantage: str = "1.0", width: int = 600) -> str:
    """A tokens-format sample padded with spaces to `width` bytes (its advantage as JSON text)."""
    text = ('{"input_ids": [1, 10, 11, 12, 13, 2], "labels": [-100, -100, 11, 12, 13, 2], '
            f'"advantages": [null, null, {advantage}, 1, 1, 1]' + "}")
    return text[:-1] + " " * (width - len(text)) + "}"


@pytest.mark.e2e
def test_a_pack_that_fails_with_any_exception_on_one_rank_stops_every_rank_with_one_line(
        tiny_checkpoint, tmp_path):
    """DP 2: the last sample (rank 1's last pack) is rewritten after the index was built, with a
    finite integer too large for a float: loading it raises an OverflowError on rank 1 alone.
    Every rank stops with one error line naming the sample, no traceback, no watchdog. The new
    file is swapped in whole (a rename), so the live run never reads a half-written file."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(_tokens_line() + "\n" for _ in range(32)))
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, data, out, data={"max_seq_len": 6, "num_workers": 0},
        optimizer={"type": "sgd", "lr": 1e-3},
        train={"max_steps": 16, "collective_timeout_s": 90}))
    log = tmp_path / "log"
    with launched(["train", str(job)], log, wait_s=200) as proc:
        _wait_for_rows(out, 1, proc)
        lines = data.read_text().splitlines(keepends=True)
        lines[-1] = _tokens_line("9" * 400) + "\n"
        write_text_atomic(data, "".join(lines))
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{data}:32" in errors[0] and "step 16" in errors[0], errors
    assert vlmcp_frames(text) == [] and "exitcode  : 124" not in text, text[-3000:]
    assert len(_strict_rows(out / "metrics.jsonl")) == 15


@pytest.mark.e2e
def test_a_metrics_file_rank_0_cannot_write_stops_every_rank_with_one_line(
        tiny_checkpoint, digits_jsonl, tmp_path):
    out = tmp_path / "out"
    (out / "metrics.jsonl").mkdir(parents=True)
    job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, out, max_steps=1,
                                                collective_timeout_s=90))
    result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=200)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(out / "metrics.jsonl") in errors[0], errors
    assert vlmcp_frames(result.stderr) == [] and "exitcode  : 124" not in result.stderr


@pytest.mark.e2e
def test_sigterm_to_the_deepspeed_launchers_group_stops_every_rank_cleanly_despite_loader_workers(
        tiny_checkpoint, digits_jsonl, tmp_path):
    """The `deepspeed` runner dies of the signal at once (exit -15) and its launch.py sends SIGTERM
    to each rank's whole process tree, loader workers included: the workers ignore it, so the ranks
    finish the step, checkpoint and exit 143, leaving stopped.json, with no traceback."""
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(tiny_checkpoint, digits_jsonl, out,
                                                max_steps=100000))
    log = tmp_path / "log"
    proc = subprocess.Popen([*launcher_prefix("deepspeed", 2), "train", str(job)], cwd=REPO,
                            env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_for_rows(out, 1, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                (out / STOP_MARKER).exists() and log.read_text().count("(exit 143)") == 2):
            time.sleep(0.2)
    finally:
        left = [p for p in psutil.process_iter(["cmdline"])
                if str(job) in " ".join(p.info["cmdline"] or [])]
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    text = log.read_text()
    assert text.count("(exit 143)") == 2 and vlmcp_frames(text) == [], text[-3000:]
    marker = json.loads((out / STOP_MARKER).read_text())
    assert marker["checkpoint"] == str(out / "checkpoints" / newest_complete(out / "checkpoints")[0])


@pytest.mark.e2e
def test_a_pack_vlmcp_score_cannot_load_on_one_rank_stops_every_rank_with_one_line(
        tiny_checkpoint, tmp_path):
    """DP 2: one image is cut after its header (the index reads only headers), so one rank's
    pack fails to decode while the other rank would wait for it in the next collective."""
    lines = []
    for k in range(4):
        save_png(tmp_path / f"img{k}.png", 32, 32, seed=k)
        lines.append(json.dumps({"messages": [{"role": "user", "content": "<image>Which digit?"},
                                              {"role": "assistant", "content": str(k)}],
                                 "images": [f"img{k}.png"]}))
    cut = tmp_path / "img3.png"
    cut.write_bytes(cut.read_bytes()[:60])
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, data, tmp_path / "out", data={"max_seq_len": 24},
        train={"collective_timeout_s": 60}))
    result = run_vlmcp(["score", str(job)], launcher="torchrun", nproc=2, timeout=200)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{data}:4" in errors[0] and str(cut) in errors[0], errors
    assert vlmcp_frames(result.stderr) == []
