"""`vlmcp rl JOB.json`: the engines, the orchestrator and the trainer's ranks on one host.

0. The checks of `vlmcp validate` on the rl section (`vlmcp.rl.preflight`): every prompt
   rendered, every reward loaded, the environment loaded; a problem stops it before anything
   starts, one line each.
1. The engines: rl.engines, or rl.num_engines vLLM servers started from the engine venv
   (`vlmcp.rl.parts.start_engines`), each ending with this process.
2. The trainer: `vlmcp rl JOB.json --part trainer` on `--nproc` ranks (torchrun; one rank runs
   without it), its output in OUT/rl/trainer.log, told the engines' URLs, ending with this
   process.
3. The orchestrator, in this process, until the last step; then it waits for the trainer to
   finish (the last step, its push or publish, the final export) and evaluates the final policy.

Stopping and faults, each reported in one line:

- SIGTERM, SIGINT or SIGUSR1 to this process: the orchestrator abandons the step it samples (its
  prompts were not consumed), the trainer gets SIGTERM and stops after a checkpoint
  (OUTPUT_DIR/stopped.json), the engines stop; the exit code is 128 + the signal. With
  train.resume the next `vlmcp rl` continues both where they stopped: the trainer at its
  checkpoint, the orchestrator after its last written step, at the same prompt stream position.
- The trainer ends by itself (a signal to its ranks, a failure): the orchestrator stops at its
  next wait for weights; a clean stop exits 128 + N like a signal here, a failure exits 1 with the
  trainer's `error:` lines from its log.
- The orchestrator fails (no engine left, a reward failure under rl.on_reward_error "error", a
  prompt that cannot be rendered): its error, then the trainer stops after a checkpoint; exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from vlmcp.config.schema import JobConfig
from vlmcp.demo.image import torchrun_command
from vlmcp.engine.vllm_http import VllmServer, end_with_parent
from vlmcp.errors import JobError, OrchestratorError
from vlmcp.rl.parts import build_orchestrator, rl_dir, start_engines
from vlmcp.rl.preflight import rl_problems_before_start

#: Signals that stop an RL run cleanly.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: The trainer's clean-stop marker in OUTPUT_DIR (vlmcp.training.signals.STOP_MARKER).
STOP_MARKER = "stopped.json"
#: How long the trainer may take to checkpoint and exit after SIGTERM before it is killed.
TRAINER_STOP_S = 600.0


class StopFlag:
    """Records the first stop signal in an Event, in place of the default handlers."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def trainer_command(job_path: Path, overrides: Sequence[str], nproc: int,
                    engines: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of the trainer's ranks: `vlmcp rl JOB --part trainer` told the
    engines' URLs, under torchrun for more than one rank."""
    args = ["rl", str(job_path), "--part", "trainer",
            *(arg for item in overrides for arg in ("--set", item)),
            *(["--engine-urls", *engines] if engines else [])]
    if nproc > 1:
        return torchrun_command(nproc, args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    return [sys.executable, "-m", "vlmcp", *args], env


def _trainer_errors(log: Path) -> list[str]:
    """The `error:` lines of the trainer's log (what it said when it failed)."""
    if not log.is_file():
        return []
    return [line[len("error: "):] for line in log.read_text(errors="replace").splitlines()
            if line.startswith("error: ")]


def _stop_trainer(trainer: subprocess.Popen) -> None:
    """SIGTERM (the ranks checkpoint and exit), then SIGKILL after TRAINER_STOP_S."""
    if trainer.poll() is None:
        trainer.send_signal(signal.SIGTERM)
    try:
        trainer.wait(timeout=TRAINER_STOP_S)
    except subprocess.TimeoutExpired:
        trainer.kill()
        trainer.wait()


def _report(lines: Sequence[str]) -> None:
    for line in lines:
        print(f"error: {line}", file=sys.stderr, flush=True)


def _trainer_outcome(job: JobConfig, code: int, log: Path, signum: int | None = None) -> int:
    """The exit code after the trainer ended with `code`, its ending reported in one line;
    `signum`: the stop signal this process passed on to it."""
    marker = Path(job.output_dir) / STOP_MARKER
    if marker.is_file():
        stopped = json.loads(marker.read_text())
        print(f"vlmcp rl: the trainer stopped on {stopped['stopped']} after step "
              f"{stopped['step']} (checkpoint {stopped['checkpoint']}); resume with "
              "--set train.resume=true", file=sys.stderr, flush=True)
        return int(stopped["exit_code"])
    if signum is not None:  # stopped while it started, before it could checkpoint anything
        print(f"vlmcp rl: the trainer stopped on {signal.Signals(signum).name} before its "
              "first step; resume with --set train.resume=true", file=sys.stderr, flush=True)
        return 128 + signum
    if code:
        _report(_trainer_errors(log) or [f"the trainer failed (exit {code}); its log: {log}"])
        return 1
    return 0


def run_all(job: JobConfig, job_path: Path, overrides: Sequence[str], nproc: int) -> int:
    """`vlmcp rl JOB.json` (see the module docstring); the exit code."""
    out = rl_dir(job)
    out.mkdir(parents=True, exist_ok=True)
    problems = rl_problems_before_start(job)
    if problems:  # before anything starts, as `vlmcp validate` reports them
        raise OrchestratorError(problems)
    flag = StopFlag()
    flag.install()
    servers: list[VllmServer] = []
    trainer: subprocess.Popen | None = None
    orchestrator = None
    log = out / "trainer.log"
    try:
        if not job.rl.engines:
            started = time.perf_counter()
            servers = start_engines(job, out)
            print(f"vlmcp rl: {len(servers)} engine(s) at {', '.join(s.url for s in servers)} "
                  f"in {time.perf_counter() - started:.0f} s (logs {out}/engine_*.log)",
                  flush=True)
        urls = list(job.rl.engines) or [server.url for server in servers]
        if flag.event.is_set():
            return 128 + flag.signum
        command, env = trainer_command(job_path, overrides, nproc, urls)
        with log.open("w") as out_log:
            trainer = subprocess.Popen(command, env=env, stdout=out_log, stderr=subprocess.STDOUT,
                                       preexec_fn=end_with_parent)
        print(f"vlmcp rl: trainer on {nproc} rank(s), its log {log}", flush=True)
        alive = trainer.poll
        orchestrator = build_orchestrator(
            job, urls, stop=flag.event, trainer_alive=lambda: alive() is None,
            trainer_metrics=Path(job.output_dir) / "metrics.jsonl")
        try:
            finished = orchestrator.run()
        except JobError as exc:
            if trainer.poll() is not None:
                return _trainer_outcome(job, trainer.returncode, log)
            _report(exc.problems)
            _stop_trainer(trainer)
            return 1
        if not finished:
            _stop_trainer(trainer)
            _trainer_outcome(job, trainer.returncode, log, flag.signum)
            return 128 + flag.signum
        return _trainer_outcome(job, trainer.wait(), log)
    finally:  # a JobError from here on is the command's one error line (vlmcp.cli)
        if orchestrator is not None:
            orchestrator.close()
        if trainer is not None and trainer.poll() is None:
            _stop_trainer(trainer)
        for server in servers:
            server.stop()
        flag.restore()


def run_engines(job: JobConfig) -> int:
    """`vlmcp rl JOB.json --part engines`: start them, print their URLs, wait for a signal."""
    out = rl_dir(job)
    out.mkdir(parents=True, exist_ok=True)
    flag = StopFlag()
    flag.install()
    servers: list[VllmServer] = []
    try:
        servers = start_engines(job, out)
        for server in servers:
            print(server.url, flush=True)
        while not flag.event.wait(1.0):
            dead = [s for s in servers if s.process is not None and s.process.poll() is not None]
            if dead:
                _report([f"the engine at {s.url} exited ({s.process.returncode}); its log "
                         f"{s.log}" for s in dead])
                return 1
        return 128 + flag.signum
    finally:
        for server in servers:
            server.stop()
        flag.restore()


def run_orchestrator(job: JobConfig) -> int:
    """`vlmcp rl JOB.json --part orchestrator`: against rl.engines, the trainer elsewhere (its
    end is seen as no new weights within rollouts.timeout_s)."""
    if not job.rl.engines:
        _report(["--part orchestrator needs rl.engines: the URLs of the running engines "
                 "(`vlmcp rl JOB --part engines` prints them)"])
        return 1
    flag = StopFlag()
    flag.install()
    orchestrator = None
    try:
        orchestrator = build_orchestrator(job, job.rl.engines, stop=flag.event,
                                          trainer_metrics=Path(job.output_dir) / "metrics.jsonl")
        finished = orchestrator.run()
        return 0 if finished else 128 + flag.signum
    finally:
        if orchestrator is not None:
            orchestrator.close()
        flag.restore()
