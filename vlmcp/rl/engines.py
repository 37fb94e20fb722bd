"""The orchestrator's engines: vLLM servers, load-balanced, a dead one's requests retried.

Every generation request goes to the token-in/token-out endpoint `/inference/v1/generate` of
the engine with the fewest requests in flight (ties: the first). The prompt travels as vlmcp's
own token ids, its images beside them as data URLs (`content_parts`, which the engine's own
processor turns into pixels), and the engine returns its prompt token ids after placeholder
expansion (`return_token_ids`), which must equal vlmcp's: so the rollout line holds exactly the
tokens the engine attended to.

An engine that does not answer (the connection refused or reset: it died) or times out is dead
for the rest of the run. With `on_error` "retry" its request goes to another engine, counted in
`retries`; when none is left, or with "error", the request raises `OrchestratorError` naming the
engine. An HTTP error is the request's own problem (a prompt too long for the engine, a bad
parameter) and raises at once.

`versions()` reads each live engine's weight-version label (GET /weight_info); the trainer's
push (publish.engines) sets it to the step pushed, `serve` (rl.weights "files") to the step it
reloaded. `busy_s` accumulates, per engine, the time it had a request in flight: the rest of the
wall time is its idle time.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmcp.engine.vllm_api import VllmHttp
from vlmcp.engine.vllm_http import VllmHttpClient
from vlmcp.errors import EngineError, OrchestratorError

logger = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
#: The longest a control request (the weight version, its label) may take: far less than a
#: generation, so that a hung engine is seen soon.
CONTROL_TIMEOUT_S = 30.0


def engine_version(label: str, url: str) -> int:
    """A weight-version label as a policy version ("default": a fresh engine's, 0)."""
    if label == "default":
        return 0
    try:
        return int(label)
    except ValueError:
        raise OrchestratorError([f"engine {url} serves weight version {label!r}, not a policy "
                                 "step: is it another run's engine?"]) from None


def _engine_died(exc: EngineError) -> bool:
    """Whether a request failed because the engine is gone or hangs (not an HTTP error)."""
    cause = exc.__cause__
    return isinstance(cause, (urllib.error.URLError, ConnectionError, TimeoutError)) \
        and not isinstance(cause, urllib.error.HTTPError)


@dataclass
class Engine:
    """One engine: its HTTP API, requests in flight, whether it is alive, its busy time."""

    url: str
    http: VllmHttp
    control: VllmHttp
    in_flight: int = 0
    alive: bool = True
    busy_s: float = 0.0
    busy_since: float | None = None
    client: VllmHttpClient | None = field(default=None, repr=False)


class EnginePool:
    """The engines at `urls` (see the module docstring). `weights_dir` and `model_dir` (rl.weights
    "files"): each engine also gets a `VllmHttpClient` that reloads published steps."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float, on_error: str = "retry",
                 weights_dir: str | Path | None = None, model_dir: str | Path | None = None):
        if not urls:
            raise OrchestratorError(["no engine to generate with"])
        self.on_error = on_error
        self.engines = [Engine(url.rstrip("/"), VllmHttp(url, timeout_s=timeout_s),
                               VllmHttp(url, timeout_s=min(timeout_s, CONTROL_TIMEOUT_S)))
                        for url in urls]
        self.retries = 0
        self._lock = threading.Lock()
        self._weights_dir, self._model_dir = weights_dir, model_dir

    def _alive(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.alive]

    def _take(self) -> Engine:
        with self._lock:
            alive = self._alive()
            if not alive:
                raise OrchestratorError(["every engine died: no engine left to generate with "
                                         f"({', '.join(e.url for e in self.engines)})"])
            engine = min(alive, key=lambda e: e.in_flight)
            if engine.in_flight == 0:
                engine.busy_since = time.perf_counter()
            engine.in_flight += 1
            return engine

    def _give_back(self, engine: Engine) -> None:
        with self._lock:
            engine.in_flight -= 1
            if engine.in_flight == 0 and engine.busy_since is not None:
                engine.busy_s += time.perf_counter() - engine.busy_since
                engine.busy_since = None

    def _dead(self, engine: Engine, exc: EngineError) -> None:
        with self._lock:
            was_alive, engine.alive = engine.alive, False
            left = len(self._alive())
        if was_alive:
            logger.warning("engine %s is gone (%s); %d engine(s) left", engine.url, exc, left)
        if self.on_error == "error" or not left:
            raise OrchestratorError([f"engine {engine.url} died: {exc}" + (
                "; no engine left" if not left else " (rl.on_engine_error \"error\")")]) from exc

    def generate(self, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(the reply, the engine's URL) of the first live engine that answers `body` (see the
        module docstring)."""
        while True:
            engine = self._take()
            try:
                return engine.http.post(GENERATE, body), engine.url
            except EngineError as exc:
                if not _engine_died(exc):
                    raise OrchestratorError([f"engine {engine.url}: {exc}"]) from exc
                self._dead(engine, exc)
                with self._lock:
                    self.retries += 1
            finally:
                self._give_back(engine)

    def busy_seconds(self) -> list[float]:
        """Each engine's time with a request in flight so far (also the current stretch)."""
        now = time.perf_counter()
        with self._lock:
            return [e.busy_s + (now - e.busy_since if e.busy_since is not None else 0.0)
                    for e in self.engines]

    def versions(self) -> list[int]:
        """The weight version each live engine serves (an engine that does not answer is dead:
        see `generate`)."""
        return [version for _, version in self._versions()]

    def _versions(self) -> list[tuple[Engine, int]]:
        found = []
        for engine in self._alive():
            try:
                label = str(engine.control.get("/weight_info")["weight_version"])
            except EngineError as exc:
                if not _engine_died(exc):
                    raise OrchestratorError([f"engine {engine.url}: {exc}"]) from exc
                self._dead(engine, exc)
                continue
            found.append((engine, engine_version(label, engine.url)))
        if not found:
            raise OrchestratorError(["every engine died: no engine left to generate with"])
        return found

    def label_fresh(self) -> None:
        """A fresh run's start: every engine serves model.path, labelled version 0 (an engine
        labelled with a step already serves another run's weights: an error)."""
        for engine, version in self._versions():
            if version != 0:
                raise OrchestratorError([f"engine {engine.url} serves weight version {version} "
                                         "at the start of a fresh run (train.resume false): "
                                         "restart it on model.path"])
            engine.control.post("/update_weight_version", {"new_version": "0"})

    def serve(self, step: int) -> float:
        """rl.weights "files": reload WEIGHTS/step_`step` into every live engine (in place,
        both caches reset, labelled `step`); returns the seconds it took."""
        started = time.perf_counter()
        for engine in self._alive():
            if engine.client is None:
                engine.client = VllmHttpClient(engine.url, self._weights_dir, self._model_dir,
                                               version=0, timeout_s=engine.http.timeout_s)
            try:
                engine.client.serve(step)
            except EngineError as exc:
                if not _engine_died(exc):
                    raise OrchestratorError([f"engine {engine.url}: {exc}"]) from exc
                self._dead(engine, exc)
        return time.perf_counter() - started
