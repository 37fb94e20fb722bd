"""`verifiers` environments as the source of an RL job's groups (`rl.environment`).

verifiers 0.4 (`verifiers.v1`, PrimeRL's environment library, the `rl` extra) describes an
environment as a taskset (its dataset: tasks with prompts), a task's rubric (`@vf.reward`
methods, weighted), an `Env` whose `run` is the protocol (single-turn, or multi-turn with the
environment's own replies between the model's turns) and a harness that plays the model's side,
every model call through verifiers' interception endpoint. `rl.environment` names it:

    {"id": "my_env",            an installed environment (its taskset's module id), or
                                "path/to/my_env.py" (a module file, relative to the job file)
     "args": {...}}             the environment's config fields (verifiers' EnvConfig)

A group is `rl.group_size` episodes of one task (`Env.run_episode`, concurrently, on an asyncio
loop of a thread of its own), with verifiers' train client (`TrainClientConfig`: it renders each
turn with the checkpoint's chat template and generates token-in/token-out). Its requests reach
the engines through `EngineFront`, a local endpoint that hands them to the orchestrator's
`EnginePool` (balanced, a dead engine's requests retried) and records each answer's policy
versions (vLLM's `weight_versions`); it also adds the `token_id:N` form renderers 0.1.12 reads
in each logprob entry, which vLLM 0.32's token output leaves out.

Each episode's trace becomes samples, one per branch (`Branch.token_ids`, `sampled_mask`, each
sampled node's `logprobs`): the environment's messages and the template between turns are prompt
tokens (no loss), every model turn's tokens and logprobs are the engine's. Where each turn's
prompt extends the turn before it token for token, the trace is one branch; where the chat
template re-renders the history (the default renderer re-tokenises earlier answers as text), each
turn is a branch of its own, its earlier answers then prompt tokens; every branch carries the
episode's advantage. Its reward is the
trace's weighted reward, each rubric entry's score its per-function value. An episode that
failed (an error of the environment or of its harness) makes the group's rewards missing, a
reward failure for rl.on_reward_error.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from vlmcp.config.schema import JobConfig
from vlmcp.data.processor import VLProcessor
from vlmcp.errors import ConfigError, JobError, OrchestratorError
from vlmcp.rl.engines import GENERATE, EnginePool, engine_version
from vlmcp.rl.generation import sampling_mask
from vlmcp.rl.groups import Group
from vlmcp.rl.rewards import GroupRewards
from vlmcp.rl.steps import Sample

#: How many answers' versions the front keeps (the oldest go first).
KEPT_ANSWERS = 100_000
#: The environment variable of the engines' API key verifiers' train client sends (none here).
API_KEY_VAR = "VLMCP_ENGINE_API_KEY"


class EngineFront:
    """A local HTTP endpoint in front of the `EnginePool`: POST /inference/v1/generate (see the
    module docstring); anything else 404. The first error of the pool (no engine left) is kept
    in `error` and answered with 502."""

    def __init__(self, engines: EnginePool):
        self.engines = engines
        self.error: JobError | None = None
        self._versions: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self._lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # requests are the orchestrator's own
                return

            def do_GET(self) -> None:
                self._send(404, {"error": {"message": f"no {self.path} here"}})

            def do_POST(self) -> None:
                if self.path != GENERATE:
                    self._send(404, {"error": {"message": f"no {self.path} here"}})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    reply, url = front.engines.generate(body)
                except JobError as exc:
                    front.error = front.error or exc
                    self._send(502, {"error": {"message": exc.problems[0]}})
                    return
                front.record(reply, url)
                self._send(200, reply)

            def _send(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name="vlmcp-engine-front")
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def record(self, reply: dict[str, Any], url: str) -> None:
        """Keep each answer's versions (by its token ids) and add renderers' token form."""
        for choice in reply.get("choices", []):
            tokens = list(choice.get("token_ids") or [])
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                entry.setdefault("token", f"token_id:{entry['token_id']}")
            versions: list[int] = [0] * len(tokens)
            for span in choice.get("weight_versions") or []:
                versions[span["start"]:span["end"]] = \
                    [engine_version(str(span["version"]), url)] * (span["end"] - span["start"])
            with self._lock:
                self._versions[tuple(tokens)] = versions
                while len(self._versions) > KEPT_ANSWERS:
                    self._versions.popitem(last=False)

    def versions(self, tokens: Sequence[int]) -> list[int]:
        """The versions of the answer whose tokens are `tokens` (of the newest `KEPT_ANSWERS`;
        branches that share a turn ask twice)."""
        with self._lock:
            found = self._versions.get(tuple(tokens))
        if found is None:
            raise OrchestratorError([f"an environment's model turn of {len(tokens)} tokens did "
                                     "not come from the engines (no record of it)"])
        return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class TaskRow:
    """One task of the environment's taskset, as a row of the prompt stream."""

    index: int
    source: str
    task: Any


def _environment_id(spec: dict[str, Any], job: JobConfig) -> str:
    """The taskset id verifiers resolves; a `.py` path is imported as a module of its stem."""
    name = str(spec["id"])
    if not name.endswith(".py"):
        return name
    path = job.resolve_input(name)
    module_name = path.stem
    if module_name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or not path.is_file():
            raise ConfigError([f"rl.environment.id: no module file {path}"])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    return module_name


def load_environment(job: JobConfig) -> tuple[Any, list[Any]]:
    """(the verifiers `Env` of rl.environment, its taskset's tasks). Raises ConfigError naming
    the environment when verifiers is missing or the environment does not load."""
    try:
        from verifiers.v1.utils.loaders import load_environment as load, resolve_env_config
    except ImportError as exc:
        raise ConfigError([f"rl.environment needs verifiers: pip install 'vlmcp[rl]' "
                           f"({exc})"]) from exc
    spec = job.rl.environment
    args = dict(spec.get("args") or {})
    args["taskset"] = {**(args.get("taskset") or {}), "id": _environment_id(spec, job)}
    try:
        env = load(resolve_env_config(args))
        return env, list(env.taskset)
    except Exception as exc:  # the user's environment: any failure is reported as such
        raise ConfigError([f"rl.environment {spec['id']!r}: {type(exc).__name__}: "
                           f"{exc}"]) from exc


class EnvironmentGroups:
    """Groups of a `verifiers` environment's episodes (see the module docstring)."""

    def __init__(self, job: JobConfig, processor: VLProcessor, engines: EnginePool,
                 model_dir: Path):
        import verifiers.v1 as vf
        from renderers import DefaultRendererConfig

        spec, rl = job.rl.environment, job.rl
        self.env, tasks = load_environment(job)
        self.rows = [TaskRow(i, f"{spec['id']}[{i}]", task) for i, task in enumerate(tasks)]
        self.names = sorted({fn.__name__ for task in tasks[:1] for fn in task.hooks("reward")})
        self.front = EngineFront(engines)
        sampling = {"top_p": rl.top_p, "max_tokens": rl.max_new_tokens}
        if rl.top_k:
            sampling["top_k"] = rl.top_k
        if rl.sampling_mask == "text":
            sampling["allowed_token_ids"] = sampling_mask(processor)
        self._vf, self._sampling = vf, sampling
        self._client = vf.TrainClientConfig(
            base_url=self.front.url + "/v1", renderer=DefaultRendererConfig(),
            renderer_model_name=str(model_dir), api_key_var=API_KEY_VAR)
        self._model = str(model_dir)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="vlmcp-environment")
        self._thread.start()
        self._serving = self.env.serving()
        self._run(self._serving.__aenter__())

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _samples(self, trace: Any) -> list[Sample]:
        """One episode's trace as samples, one per branch (see the module docstring)."""
        truncated = any(call.finish_reason == "length" for call in trace.calls)
        samples = []
        for branch in trace.branches:
            logprobs: list[float] = []
            versions: list[int] = []
            for node in branch.nodes:
                completion = [t for t, m in zip(node.token_ids, node.mask) if m]
                if completion:
                    logprobs += list(node.logprobs)
                    versions += self.front.versions(completion)
            if versions:
                samples.append(Sample(list(branch.token_ids), list(branch.sampled_mask),
                                      logprobs, versions, truncated))
        return samples

    def group(self, row: TaskRow, position: int, *, n: int, temperature: float,
              seed: int | None) -> Group:
        """`n` episodes of the row's task, as samples with the rubric's rewards."""
        vf = self._vf
        ctx = vf.ModelContext(model=self._model, client=self._client,
                              sampling=vf.SamplingConfig(temperature=temperature,
                                                         **self._sampling))

        async def episodes() -> list[Any]:
            return await asyncio.gather(*(self.env.run_episode(row.task, ctx)
                                          for _ in range(n)))

        done = self._run(episodes())
        if self.front.error is not None:
            raise self.front.error
        group = Group(position, row.source)
        failed = next((e for e in done if not e.ok), None)
        if failed is not None:
            errors = [*failed.errors, *(err for t in failed.traces for err in t.errors)]
            reason = f"{errors[0].type}: {errors[0].message}" if errors else "no trace"
            group.failure = f"{row.source}: an episode failed: {reason}"
            return group
        per_function: dict[str, list[float | None]] = {name: [] for name in self.names}
        totals = []
        for index, episode in enumerate(done):
            traces = [t for t in episode.traces if t.branches]
            if len(traces) != 1:
                raise OrchestratorError([f"{row.source}: an episode with {len(traces)} model "
                                         "traces; vlmcp rl trains environments of one seat"])
            trace = traces[0]
            samples = self._samples(trace)
            group.samples += samples
            group.owners += [index] * len(samples)
            totals.append(trace.reward)
            for name in self.names:
                reward = trace.rewards.get(name)
                per_function[name].append(None if reward is None else reward.score)
        group.rewards = GroupRewards(per_function, totals)
        return group

    def close(self) -> None:
        """Leave the environment's serving context, stop its loop and the front."""
        try:
            self._run(self._serving.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.front.close()

