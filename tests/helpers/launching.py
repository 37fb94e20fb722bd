"""Running `vlmcp` the way users do: a subprocess, alone or under one of the three launchers.

Every run gets one OpenMP thread per rank (VLMCP_TEST_RANK_THREADS, tests/distributed.py, sets
another count), DeepSpeed's CPU accelerator, a free rendezvous port
and this checkout on PYTHONPATH, and is killed after `timeout` seconds so that a hang fails the
test instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.helpers.distributed import rank_threads
from vlmcp.training.checkpoint import newest_complete

REPO = Path(__file__).resolve().parents[2]
ACCELERATE_YAML = REPO / "launch" / "accelerate" / "deepspeed_2proc.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tool(name: str) -> str:
    beside_python = Path(sys.executable).parent / name
    return str(beside_python) if beside_python.exists() else (shutil.which(name) or name)


def launcher_prefix(launcher: str | None, nproc: int,
                    accelerate_yaml: Path = ACCELERATE_YAML) -> list[str]:
    """The command that starts `nproc` ranks of `-m vlmcp` (None: one plain process); accelerate
    takes its process count from `accelerate_yaml`."""
    port = str(free_port())
    if launcher is None:
        return [sys.executable, "-m", "vlmcp"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", port, "-m", "vlmcp"]
    if launcher == "deepspeed":
        return [_tool("deepspeed"), "--num_gpus", str(nproc), "--master_port", port,
                "--module", "vlmcp"]
    if launcher == "accelerate":
        if accelerate_yaml == ACCELERATE_YAML and nproc != 2:
            raise ValueError("the accelerate test config starts 2 ranks")
        return [_tool("accelerate"), "launch", "--config_file", str(accelerate_yaml),
                "--main_process_port", port, "-m", "vlmcp"]
    raise ValueError(f"unknown launcher {launcher!r}")


def vlmcp_env() -> dict[str, str]:
    """The environment of every run: one OpenMP thread (`rank_threads`), CPU DeepSpeed, this
    checkout first."""
    return {**os.environ, "OMP_NUM_THREADS": str(rank_threads()), "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_vlmcp(args: list[str], *, launcher: str | None = None, nproc: int = 1,
              timeout: float = 240, cwd: Path = REPO,
              accelerate_yaml: Path = ACCELERATE_YAML) -> subprocess.CompletedProcess:
    """Run `vlmcp ARGS` (under `launcher` with `nproc` ranks); output captured as text."""
    command = [*launcher_prefix(launcher, nproc, accelerate_yaml), *args]
    return subprocess.run(command, cwd=cwd, env=vlmcp_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


@contextlib.contextmanager
def launched(args: list[str], log: Path, *, launcher: str = "torchrun", nproc: int = 2,
             wait_s: float = 120, **popen: Any) -> Iterator[subprocess.Popen]:
    """`vlmcp ARGS` under `launcher` in the background, its output in `log`: the block acts on the
    running process, then it is waited for (at most `wait_s`); it is killed when still running."""
    proc = subprocess.Popen([*launcher_prefix(launcher, nproc), *args], cwd=REPO, env=vlmcp_env(),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, **popen)
    try:
        yield proc
        proc.wait(timeout=wait_s)
    finally:
        if proc.poll() is None:
            proc.kill()


def stop_by_sigterm_then_resume(job: Path, out: Path, log: Path) -> None:
    """`vlmcp train JOB` on two torchrun ranks (output in `log`), sent SIGTERM once its first
    metrics row (`out`/metrics.jsonl) is written; its newest checkpoint must come before
    `train.max_steps`; then the same job with `train.resume=true` runs to the end."""
    with launched(["train", str(job)], log, wait_s=60) as proc:
        rows = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (rows.exists() and rows.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    tag, _ = newest_complete(out / "checkpoints")
    steps = json.loads(job.read_text())["train"]["max_steps"]
    assert tag is not None and int(tag.removeprefix("step")) < steps, log.read_text()[-3000:]
    assert_ok(run_vlmcp(["train", str(job), "--set", "train.resume=true"], launcher="torchrun",
                        nproc=2))


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_nodes(commands: list[list[str]], *, timeout: float = 300, grace: float = 30,
              cwd: Path = REPO) -> list[subprocess.CompletedProcess]:
    """Start every command at once, one launcher per "node", and wait for all of them.

    Each command runs in a process group of its own. Once one exits non-zero, the others get
    `grace` seconds before they are stopped (a node left waiting in a rendezvous or a collective
    for a dead peer would otherwise wait out its own timeout); so is every command still running
    after `timeout` seconds. Stopping sends SIGTERM to the launcher's group (torchrun then stops
    its workers, which run in groups of their own) and SIGKILL 40 s later.
    """
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    procs = [subprocess.Popen(command, cwd=cwd, env=vlmcp_env(), stdout=out, stderr=err,
                              text=True, start_new_session=True)
             for command, (out, err) in zip(commands, outputs)]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes:
                break
            if any(code not in (None, 0) for code in codes):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.2)
    finally:
        _stop([p for p in procs if p.poll() is None])
    results = []
    for command, proc, (out, err) in zip(commands, procs, outputs):
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


def tiny_job(checkpoint: Path, train_file: Path, output_dir: Path,
             **sections: dict[str, Any]) -> dict:
    """A small, fast job on a tiny checkpoint; `sections` update the defaults key by key."""
    job: dict[str, Any] = {
        "model": {"path": str(checkpoint)},
        "data": {"train": str(train_file), "max_seq_len": 96},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "train": {"max_steps": 2, "seed": 0},
        "deepspeed": {"zero_optimization": {"stage": 0}},
        "output_dir": str(output_dir),
    }
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(job.get(name), dict):
            job[name] = {**job[name], **values}
        else:
            job[name] = values
    return job


def write_job(path: Path, job: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job, indent=1))
    return path


def train_losses(output_dir: Path) -> list[float]:
    """The `loss` of every training row of a run's metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    """Fail with the run's output tail when it exited non-zero."""
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-6000:]
        raise AssertionError(f"exit {result.returncode}:\n{tail}")


def vlmcp_frames(text: str) -> list[str]:
    """The traceback lines of `text` (a launcher may prefix them with "[rankN]:") that are frames
    in vlmcp's own files; a launcher's own traceback, such as torchrun's ChildFailedError after a
    rank exits 1, has none."""
    return [line for line in text.splitlines()
            if re.search(rf'File "[^"]*{re.escape(os.sep)}vlmcp{re.escape(os.sep)}', line)]
