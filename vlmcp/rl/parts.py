"""The parts of an RL run, each startable on its own: engines, the orchestrator, the trainer.

`vlmcp rl JOB.json` starts all three on one host (`vlmcp.rl.launch`); on a cluster each part is
started by its own command against the others' addresses:

    vlmcp rl JOB.json --part engines         rl.num_engines vLLM servers from the engine venv on
                                             model.path; prints their URLs; runs until a signal
    torchrun ... -m vlmcp rl JOB.json --part trainer
                                             the trainer's ranks: `vlmcp train` on the trainer's
                                             view of the job (`vlmcp.config.rl_checks.trainer_job`:
                                             publish.engines = rl.engines with rl.weights "push")
    vlmcp rl JOB.json --part orchestrator    the orchestrator against rl.engines

This module builds the engines and the orchestrator; it imports nothing of the trainer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vlmcp.config.schema import JobConfig
from vlmcp.data.processor import load_processor
from vlmcp.data.sources import data_files
from vlmcp.engine.venv import engine_python, missing_engine, named_engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmServer
from vlmcp.errors import EngineError, OrchestratorError
from vlmcp.rl.engines import EnginePool
from vlmcp.rl.groups import GroupSource, PromptGroups
from vlmcp.rl.orchestrator import Orchestrator
from vlmcp.rl.prompts import PromptRow, read_prompts
from vlmcp.rl.rewards import RewardRunner, reward_specs


def rl_dir(job: JobConfig) -> Path:
    """OUTPUT_DIR/rl: the orchestrator's metrics, the engines' and the trainer's logs."""
    return Path(job.output_dir) / "rl"


def engine_server_args(job: JobConfig) -> list[str]:
    """The flags of a vLLM server `vlmcp rl` starts: the CPU flags, the push backend for
    rl.weights "push", a fixed seed, a context of data.max_seq_len, then rl.engine_args."""
    args = [*CPU_ARGS, *(PUSH_ARGS if job.rl.weights == "push" else ()),
            "--seed", str(job.train.seed)]
    if "--max-model-len" not in job.rl.engine_args:
        args += ["--max-model-len", str(job.data.max_seq_len)]
    return [*args, *job.rl.engine_args]


def start_engines(job: JobConfig, out_dir: Path) -> list[VllmServer]:
    """rl.num_engines vLLM servers from the engine venv on model.path, started side by side
    (logs OUT/rl/engine_I.log), each ending with this process. Raises OrchestratorError naming
    the missing venv or the server that did not start (the others are stopped)."""
    python = engine_python()
    if python is None:
        raise OrchestratorError([f"vlmcp rl starts its engines from the engine venv, but "
                                 f"{missing_engine(named_engine_python())}; or name running "
                                 "servers in rl.engines"])
    model = job.resolve_input(job.model.path)
    servers = [VllmServer(python, model, out_dir / f"engine_{i}.log",
                          args=engine_server_args(job),
                          start_timeout_s=job.rl.engine_start_timeout_s, die_with_parent=True)
               for i in range(job.rl.num_engines)]
    launched = time.perf_counter()
    for server in servers:  # on this thread: the servers end when it does (end_with_parent)
        server.launch()
    with ThreadPoolExecutor(len(servers)) as pool:
        started = [pool.submit(server.wait_ready, launched) for server in servers]
    problems = []
    for future in started:
        try:
            future.result()
        except EngineError as exc:
            problems += exc.problems
    if problems:
        for server in servers:
            server.stop()
        raise OrchestratorError(problems)
    return servers


def _prompt_rows(job: JobConfig, spec: object, key: str) -> list[PromptRow]:
    if spec is None:
        return []
    paths = [job.resolve_input(f.path) for f in data_files(spec, key, weighted=False)]
    return read_prompts(paths)


def build_orchestrator(job: JobConfig, engines: Sequence[str], *, stop: threading.Event,
                       trainer_alive: Callable[[], bool] = lambda: True,
                       trainer_metrics: Path | None = None) -> Orchestrator:
    """The orchestrator of `job` on the engines at `engines` (base URLs): its prompts read, its
    reward processes started. The caller closes it."""
    model = job.resolve_input(job.model.path)
    processor = load_processor(model, job.data.chat_template_kwargs, job.data.empty_think)
    pool = EnginePool(engines, timeout_s=job.rl.request_timeout_s,
                      on_error=job.rl.on_engine_error,
                      weights_dir=job.publish.dir if job.rl.weights == "files" else None,
                      model_dir=model)
    groups: GroupSource
    if job.rl.environment is not None:
        from vlmcp.rl.environments import EnvironmentGroups

        groups = EnvironmentGroups(job, processor, pool, model)
        rows, eval_rows = groups.rows, []
    else:
        rows = _prompt_rows(job, job.rl.prompts, "rl.prompts")
        eval_rows = _prompt_rows(job, job.rl.eval_prompts, "rl.eval_prompts")
        rewards = RewardRunner(reward_specs(job.rl.rewards, job.job_dir),
                               job.rl.reward_workers, job.rl.reward_timeout_s)
        groups = PromptGroups(job.rl, processor, pool, rewards)
    try:
        return Orchestrator(job, groups, rows, eval_rows, pool, out_dir=rl_dir(job),
                            trainer_alive=trainer_alive, stop=stop,
                            trainer_metrics=trainer_metrics)
    except BaseException:
        groups.close()
        raise
