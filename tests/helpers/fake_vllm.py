"""A stand-in vLLM server for the HTTP clients' tests, without vLLM.

`FakeVllm` is the standard library's HTTP server in a thread on 127.0.0.1: it answers vLLM 0.32's
development and weight-transfer endpoints as vLLM does (the bodies read in vLLM's
`entrypoints/serve/dev` and `entrypoints/rl/online` routers) and records every request. A hung
endpoint holds its answer for at most `HANG_S`, and leaving the `with` block stops the server and
releases what still hangs.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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
    /collective_rpc by "/collective_rpc:METHOD": (HTTP status, JSON body or raw text), HANG, or a
    callable of the request's JSON body returning such a pair (it runs on the request's thread).
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
        if callable(answer):
            answer = answer(body)
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
#: extension's count, as text; a uni-executor engine has one worker).
_SUCCESS: dict[str, tuple[int, Any]] = {
    "/pause": (200, {"status": "paused"}),
    "/resume": (200, {"status": "resumed"}),
    "/collective_rpc:reload_weights": (200, {"results": [None]}),
    "/collective_rpc:repack_cpu_moe_experts": (200, {"results": ["4"]}),
    "/collective_rpc:padded_cpu_moe_experts": (200, {"results": [[]]}),
    "/reset_prefix_cache": (200, {"success": True}),
    "/reset_encoder_cache": (200, ""),
    "/update_weight_version": (200, {"success": True}),
    "/get_world_size": (200, {"world_size": 1}),
    "/init_weight_transfer_engine": (200, {"message": "Weight transfer initialized"}),
    "/start_weight_update": (200, {"message": "Weight update started"}),
    "/update_weights": (200, {"message": "Weights updated"}),
    "/finish_weight_update": (200, {"message": "Weight update finished"}),
    "/shutdown_weight_transfer_engine": (200, {"message": "Weight transfer shut down"}),
}
