"""The vLLM server client (`vllm_http.VllmHttpClient`) against a stand-in server, without vLLM:
the calls of a reload and their order (wait and keep mode, dense and MoE), the keep mode's prefix
cache reset, and every failure as one EngineError line naming the server: an HTTP error with
vLLM's message and status, a refused connection, a request that hangs past the client's
timeout, a reload or a reset the server refused (the server stays paused, the version unchanged),
a repack answer that is not a count.

The stand-in (`FakeVllm`) is the standard library's HTTP server in a thread on 127.0.0.1: it
answers vLLM 0.32's development endpoints as vLLM does (the bodies read in vLLM's
`entrypoints/serve/dev` and `entrypoints/rl/online` routers) and records every request. A hung
endpoint holds its answer for at most `HANG_S`, and leaving the `with` block stops the server and
releases what still hangs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vlmcp.data.rollouts import STABLE
from vlmcp.engine.vllm_http import VllmHttpClient
from vlmcp.errors import EngineError
from vlmcp.parallel.comm import free_local_port

#: The longest a hung endpoint holds its answer.
HANG_S = 10.0
#: An answer that never comes (until the server stops, or HANG_S passed).
HANG = "hang"
#: An OpenAI-style vLLM error body (`ErrorResponse`), as its exception handlers write it.
VLLM_ERROR = {"error": {"message": "Failed to reload: weights_path has no safetensors",
                        "type": "Internal Server Error", "param": None, "code": 500}}


class FakeVllm:
    """A stand-in vLLM server on 127.0.0.1 (see the module docstring).

    answers: the answer of an endpoint, by its path without the query ("/pause"), or for
    /collective_rpc by "/collective_rpc:METHOD": (HTTP status, JSON body or raw text), or HANG.
    Others answer as vLLM does on success. calls: (path with its query, JSON body) of every
    request, in order.
    """

    def __init__(self, answers: dict[str, Any] | None = None):
        self.answers = answers or {}
        self.calls: list[tuple[str, Any]] = []
        self.released = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake._answer(self, None)

            def do_POST(self) -> None:  # noqa: N802
                size = int(self.headers.get("Content-Length") or 0)
                fake._answer(self, json.loads(self.rfile.read(size) or b"null"))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def paths(self) -> list[str]:
        """The calls as "PATH?QUERY", with the method for /collective_rpc ("/collective_rpc:M")."""
        return [f"{path}:{body['method']}" if path == "/collective_rpc" else path
                for path, body in self.calls]

    def _answer(self, handler: BaseHTTPRequestHandler, body: Any) -> None:
        self.calls.append((handler.path, body))
        path = handler.path.split("?")[0]
        key = f"{path}:{body['method']}" if path == "/collective_rpc" else path
        answer = self.answers.get(key, _SUCCESS.get(key, (200, {})))
        if answer == HANG:
            self.released.wait(HANG_S)
            return
        status, content = answer
        payload = (content if isinstance(content, str) else json.dumps(content)).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def __enter__(self) -> FakeVllm:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=HANG_S)


#: vLLM 0.32's answers on success (a reload returns None per worker; a repack, the worker
#: extension's count, as text).
_SUCCESS: dict[str, tuple[int, Any]] = {
    "/pause": (200, {"status": "paused"}),
    "/resume": (200, {"status": "resumed"}),
    "/collective_rpc:reload_weights": (200, {"results": [None]}),
    "/collective_rpc:repack_cpu_moe_experts": (200, {"results": ["4"]}),
    "/collective_rpc:padded_cpu_moe_experts": (200, {"results": [[]]}),
    "/reset_prefix_cache": (200, {"success": True}),
    "/reset_encoder_cache": (200, ""),
    "/update_weight_version": (200, {"success": True}),
}


def _published(root: Path, moe: bool = False) -> tuple[Path, Path]:
    """(model_dir, weights_dir): a served model's config.json and WEIGHTS/step_1 of the same
    model, marked STABLE (the client reads only config.json; the server would load the rest)."""
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"hidden_size": 64, **({"num_experts": 4} if moe else {})}}
    for folder in (root / "model", root / "weights" / "step_1"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
    (root / "weights" / "step_1" / STABLE).write_text("")
    return root / "model", root / "weights"


@contextmanager
def _client(tmp_path: Path, answers: dict[str, Any] | None = None, moe: bool = False,
            **kwargs: Any) -> Iterator[tuple[VllmHttpClient, FakeVllm]]:
    """A client built on a FakeVllm (its constructor's calls already made and forgotten)."""
    model, weights = _published(tmp_path, moe)
    with FakeVllm(answers) as fake:
        client = VllmHttpClient(fake.url, weights, model, **kwargs)
        fake.calls.clear()
        yield client, fake


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_a_reload_pauses_loads_resets_both_caches_labels_and_resumes_in_that_order(
        tmp_path, mode, moe):
    with _client(tmp_path, moe=moe, pause_mode=mode) as (client, fake):
        served = client.serve(1)
    reset = "/reset_prefix_cache" + ("?reset_running_requests=true" if mode == "keep" else "")
    assert fake.paths() == [f"/pause?mode={mode}&clear_cache=false",
                            "/collective_rpc:reload_weights",
                            *(["/collective_rpc:repack_cpu_moe_experts"] if moe else []),
                            reset, "/reset_encoder_cache", "/update_weight_version", "/resume"]
    assert fake.calls[1][1]["kwargs"] == {"weights_path": str(tmp_path / "weights" / "step_1")}
    assert fake.calls[-2][1] == {"new_version": "1"}
    assert (served.step, served.repacked_layers, client.version) == (1, 4 if moe else 0, 1)


@pytest.mark.parametrize("mode", ["wait", "keep"])
@pytest.mark.parametrize("answer", [(200, {"success": False}), (500, VLLM_ERROR)],
                         ids=["success-false", "http-500"])
def test_a_prefix_cache_reset_that_fails_is_an_error_and_the_server_stays_paused_on_the_old_label(
        tmp_path, mode, answer):
    with _client(tmp_path, {"/reset_prefix_cache": answer}, pause_mode=mode) as (client, fake):
        with pytest.raises(EngineError) as info:
            client.serve(1)
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {fake.url}/reset_prefix_cache")
    assert "the server stays paused, still labelled version 0" in message
    assert "prefix cache may hold KV of the old weights" in message
    assert client.version == 0
    assert fake.paths()[-1].startswith("/reset_prefix_cache")  # no label, no resume after it


def test_a_reload_the_server_refuses_is_an_error_with_its_message_and_the_server_stays_paused(
        tmp_path):
    with _client(tmp_path, {"/collective_rpc:reload_weights": (500, VLLM_ERROR)}) as (client,
                                                                                     fake):
        with pytest.raises(EngineError) as info:
            client.serve(1)
    (message,) = info.value.problems
    assert f"vLLM server {fake.url}/collective_rpc: HTTP 500: Failed to reload: weights_path " \
           "has no safetensors; the server stays paused" in message
    assert fake.paths()[-1] == "/collective_rpc:reload_weights" and client.version == 0


@pytest.mark.parametrize("results", [["None"], ["four"], "4"], ids=["none", "text", "no-list"])
def test_a_repack_answer_that_is_not_a_count_per_worker_is_an_error_naming_it(tmp_path, results):
    answers = {"/collective_rpc:repack_cpu_moe_experts": (200, {"results": results})}
    with _client(tmp_path, answers, moe=True) as (client, fake):
        with pytest.raises(EngineError) as info:
            client.serve(1)
    (message,) = info.value.problems
    assert f"repack_cpu_moe_experts answered {json.dumps({'results': results})}, not one layer " \
           "count per worker" in message
    assert "the server stays paused" in message and fake.url in message


@pytest.mark.parametrize("status, body, expected", [
    (400, {"error": {"message": "max_tokens must be at least 1", "type": "Bad Request",
                     "param": None, "code": 400}}, "HTTP 400: max_tokens must be at least 1"),
    (500, {"error": "Failed to pause generation: engine dead"},
     "HTTP 500: Failed to pause generation: engine dead"),
    (404, {"detail": "Not Found"}, "HTTP 404: Not Found (the development endpoints need the "
                                   "server started with VLLM_SERVER_DEV_MODE=1)"),
    (502, "Bad gateway\n  upstream\nclosed", "HTTP 502: Bad gateway upstream closed"),
], ids=["openai-400", "pause-500", "no-route-404", "text-502"])
def test_an_http_error_is_one_line_with_vllms_message_and_the_status(tmp_path, status, body,
                                                                      expected):
    with _client(tmp_path, {"/pause": (status, body)}) as (client, fake):
        with pytest.raises(EngineError) as info:
            client.post("/pause?mode=wait")
    assert info.value.problems == [f"vLLM server {fake.url}/pause?mode=wait: {expected}"]


def test_a_refused_connection_is_reported_unreachable(tmp_path):
    model, weights = _published(tmp_path)
    url = f"http://127.0.0.1:{free_local_port()}"
    with pytest.raises(EngineError) as info:
        VllmHttpClient(url, weights, model)
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {url} is unreachable (")
    assert "on /update_weight_version" in message


def test_a_hung_pause_is_a_timeout_error_within_the_clients_timeout_not_unreachable(tmp_path):
    with _client(tmp_path, {"/pause": HANG}, timeout_s=0.5) as (client, fake):
        started = time.perf_counter()
        with pytest.raises(EngineError) as info:
            client.serve(1)
        seconds = time.perf_counter() - started
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {fake.url}: POST /pause?mode=wait&clear_cache=false "
                              "timed out after 0.5 s; the server may still be doing it")
    assert "POST /resume" in message and "unreachable" not in message
    assert 0.5 <= seconds < 3.0 and client.version == 0
