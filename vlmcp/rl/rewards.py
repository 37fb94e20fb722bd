"""Reward functions: loaded by name, run in worker processes beside generation, each call timed.

`rl.rewards` names each function as `module:function` (importable where `vlmcp rl` runs),
`path/to/file.py:function` (relative to the job file) or a built-in (`vlmcp.rl.builtin_rewards`),
with a weight. Every function has TRL's signature,

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

called once per group: `prompts` (the prompt, repeated per answer: messages or text),
`completions` (the answers' text, decoded without special tokens; a one-message list for a
conversational prompt), `completion_ids` (the engine's token ids) and every other column of the
prompt's row (one entry per answer). A None is "does not apply": it counts 0 in the weighted sum,
as TRL's nansum does, and is left out of the function's mean.

The functions run in `rl.reward_workers` processes of their own (spawned, so that a function
that hangs in C code or ignores signals can be ended), one group's call at a time per process,
on threads of this process, so generation never waits for them. A call that raises, returns
something other than one number (or None) per answer, or takes longer than `rl.reward_timeout_s`
(its process is then killed and a fresh one started) is a `RewardFailure` naming the function;
the orchestrator decides what it means (`rl.on_reward_error`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import multiprocessing
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.errors import ConfigError

#: How long a worker may take to import the reward functions before the first call.
LOAD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RewardSpec:
    """One entry of rl.rewards: its name in metrics, what it loads, its weight, and the directory
    a `file.py:function` is relative to."""

    name: str
    function: str
    weight: float
    base_dir: str = "."


def reward_specs(entries: Sequence[dict[str, Any]], base_dir: str | Path) -> list[RewardSpec]:
    """The specs of rl.rewards (entries already checked by `vlmcp.config.rl_checks`); a name is
    the function's own, or its full spec where two entries share one."""
    names = [entry["function"].rsplit(":", 1)[-1] for entry in entries]
    return [RewardSpec(name if names.count(name) == 1 else entry["function"], entry["function"],
                       float(entry.get("weight", 1.0)), str(base_dir))
            for name, entry in zip(names, entries)]


def load_reward(spec: RewardSpec) -> Callable[..., Any]:
    """The function `spec` names. Raises ConfigError naming the spec when it cannot be loaded."""
    from vlmcp.rl.builtin_rewards import BUILTINS

    if spec.function in BUILTINS:
        if spec.function == "math" and importlib.util.find_spec("math_verify") is None:
            raise ConfigError(["rl.rewards: the built-in \"math\" needs math-verify: pip "
                               "install 'vlmcp[rl]'"])
        return BUILTINS[spec.function]
    module_name, _, attr = spec.function.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            path = path if path.is_absolute() else Path(spec.base_dir) / path
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        function = getattr(module, attr)
    except Exception as exc:  # any failure of the user's module is reported, not raised as is
        raise ConfigError([f"rl.rewards: cannot load {spec.function!r}: "
                           f"{type(exc).__name__}: {exc}"]) from exc
    if not callable(function):
        raise ConfigError([f"rl.rewards: {spec.function!r} is not callable"])
    return function


def _last_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _checked(values: Any, count: int) -> list[float | None]:
    """The values a function returned, as floats (None kept); ValueError unless one number or
    None per answer."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise ValueError(f"returned {type(values).__name__}"
                         f"{f' of {len(values)}' if isinstance(values, (list, tuple)) else ''}, "
                         f"not a list of {count} rewards (one per answer)")
    out: list[float | None] = []
    for value in values:
        if value is None:
            out.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"returned {value!r}, not a number or None") from None
        if not math.isfinite(number):
            raise ValueError(f"returned {number}, not a finite reward")
        out.append(number)
    return out


def _worker_main(conn: Any, specs: list[RewardSpec]) -> None:
    """A reward process: load the functions, then answer each (function index, kwargs) with
    ("ok", values) or ("error", message), until it is killed."""
    try:
        functions = [load_reward(spec) for spec in specs]
    except ConfigError as exc:
        conn.send(("error", exc.problems[0]))
        return
    conn.send(("ok", None))
    while True:
        index, kwargs = conn.recv()
        try:
            values = _checked(functions[index](**kwargs), len(kwargs["completions"]))
            conn.send(("ok", values))
        except Exception as exc:  # the user's function: every failure goes back as a message
            conn.send(("error", f"{type(exc).__name__}: {exc}{_last_frame(exc)}"))


class RewardFailure(Exception):
    """A reward call that raised, returned something unusable or timed out."""

    def __init__(self, function: str, reason: str):
        self.function, self.reason = function, reason
        super().__init__(f"reward {function!r} {reason}")


class _Worker:
    """One reward process and its end of the pipe."""

    def __init__(self, specs: list[RewardSpec]):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, specs), daemon=True,
                                       name="vlmcp-reward")
        self.process.start()
        child.close()
        self.loaded = False
        self._stop_lock = threading.Lock()
        self._stopped = False

    def call(self, message: Any, timeout_s: float) -> tuple[str, Any]:
        """Send `message` and wait for the answer; ("timeout", None) after `timeout_s`, ("died",
        exit code) when the process ended."""
        if message is not None:
            self.conn.send(message)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(min(0.2, max(deadline - time.monotonic(), 0.0))):
                try:
                    return self.conn.recv()
                except EOFError:
                    break
            if not self.process.is_alive():
                break
        if self.process.is_alive():
            return "timeout", None
        self.process.join()
        return "died", self.process.exitcode

    def stop(self) -> None:
        """End the process (it holds no state worth a polite stop), once: the runner's close and
        a reward thread replacing a timed-out worker may both stop it."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self.process.kill()
            self.process.join()
            self.conn.close()


@dataclass
class GroupRewards:
    """One group's rewards: each function's values per answer (None: does not apply), and each
    answer's weighted sum."""

    per_function: dict[str, list[float | None]]
    total: list[float]


class RewardRunner:
    """Runs every reward function on groups, in `workers` processes, `timeout_s` per call."""

    def __init__(self, specs: Sequence[RewardSpec], workers: int, timeout_s: float):
        self.specs, self.timeout_s = list(specs), timeout_s
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        #: Guards `_all` and `_closed` between the reward threads and `close`.
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(workers):
            self._add_worker()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="vlmcp-reward")

    def _add_worker(self) -> None:
        worker = _Worker(self.specs)
        self._all.append(worker)
        self._idle.put(worker)

    def _replace(self, worker: _Worker) -> None:
        """Stop `worker` and start another in its place, unless the runner is closing (a reward
        thread still running when `close` came)."""
        worker.stop()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
            if not self._closed:
                self._add_worker()

    def submit(self, kwargs: dict[str, Any]) -> Future[GroupRewards]:
        """Score one group (`kwargs`: prompts, completions, completion_ids and the columns, one
        entry per answer) with every function, on a reward thread."""
        return self._pool.submit(self._score, kwargs)

    def _load(self, worker: _Worker) -> None:
        status, message = worker.call(None, LOAD_TIMEOUT_S)
        if status != "ok":
            self._replace(worker)
            raise RewardFailure(", ".join(s.name for s in self.specs),
                                f"could not be loaded in a reward process: {message}")
        worker.loaded = True

    def _score(self, kwargs: dict[str, Any]) -> GroupRewards:
        worker = self._idle.get()
        try:
            if not worker.loaded:
                self._load(worker)
            per_function: dict[str, list[float | None]] = {}
            for index, spec in enumerate(self.specs):
                status, values = worker.call((index, kwargs), self.timeout_s)
                if status == "ok":
                    per_function[spec.name] = values
                    continue
                if status in ("timeout", "died"):
                    self._replace(worker)
                    worker = None  # the replacement is already idle
                reason = {"timeout": f"timed out after {self.timeout_s:g} s (rl.reward_timeout_s)",
                          "died": f"ended its process (exit code {values})"}.get(
                    status, f"raised {values}")
                raise RewardFailure(spec.name, reason)
        finally:
            if worker is not None:
                self._idle.put(worker)
        total = [0.0] * len(kwargs["completions"])
        for spec in self.specs:
            for i, value in enumerate(per_function[spec.name]):
                if value is not None:
                    total[i] += spec.weight * value
        return GroupRewards(per_function, total)

    def close(self) -> None:
        """Stop every reward process (a call still running is cut off)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for worker in workers:
            worker.stop()
