"""One vLLM server's HTTP API: its requests, its errors, its pause and its prefix-cache reset.

`VllmHttp(url, timeout_s=..., pause_mode=...)` is what every vlmcp caller of a vLLM server speaks
through: `vllm_http.VllmHttpClient` (reload a published step from disk) and
`weight_push_http.VllmPushControl` (the control plane of a weight push). Every failure is one
EngineError line naming the server's URL: an HTTP error with vLLM's message and the status, a
server that is unreachable (nothing answers the connection), or a request that timed out after
`timeout_s` (the server may still finish it: a /pause may complete later and leave it paused).

Standard library only (and `vlmcp.errors`): the trainer, which never imports vLLM, uses it too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from vlmcp.errors import EngineError

#: vLLM's pause modes: finish the requests in flight, freeze them (they go on after /resume), or
#: abort them.
PAUSE_MODES = ("wait", "keep", "abort")


def error_message(body: bytes) -> str:
    """vLLM's error message in an HTTP error `body`, on one line: `{"error": {"message": ...}}`
    (the OpenAI-style errors), `{"error": "..."}` (/pause, /resume) or `{"detail": "..."}` (a
    route the server lacks); else the body's text."""
    text = body.decode(errors="replace")
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if isinstance(found, dict):
        error = found.get("error", found.get("detail"))
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str):
            text = error
    return " ".join(text.split())[:1000] or "(no body)"


class VllmHttp:
    """The HTTP API of the vLLM server at `url` (see the module docstring).

    timeout_s: per request (one that takes longer is an EngineError saying it timed out).
    pause_mode: how `pause` treats the requests in flight, one of PAUSE_MODES; it decides how
    `reset_prefix_cache` resets.
    """

    def __init__(self, url: str, *, timeout_s: float, pause_mode: str = "wait"):
        if pause_mode not in PAUSE_MODES:
            raise EngineError(f"pause_mode={pause_mode!r}: vLLM pauses with wait, keep or abort")
        self.url, self.timeout_s, self.pause_mode = url.rstrip("/"), timeout_s, pause_mode

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST `body` (JSON) to the server's `path`; the decoded answer (None when empty).
        Raises EngineError: the server unreachable, the request timed out after `timeout_s`, or
        the server's error message with the HTTP status."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"})
        return self._send(request, path)

    def get(self, path: str) -> Any:
        """GET the server's `path`; the decoded answer (errors as for `post`)."""
        return self._send(urllib.request.Request(self.url + path), path)

    def _send(self, request: urllib.request.Request, path: str) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                payload = answer.read()
        except urllib.error.HTTPError as exc:
            hint = (" (the development endpoints need the server started with "
                    "VLLM_SERVER_DEV_MODE=1)" if exc.code == 404 else "")
            raise EngineError(f"vLLM server {self.url}{path}: HTTP {exc.code}: "
                              f"{error_message(exc.read())}{hint}") from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise EngineError(
                    f"vLLM server {self.url}: {request.get_method()} {path} timed out after "
                    f"{self.timeout_s:g} s; the server may still be doing it (a /pause may "
                    "complete later and leave it paused): GET /is_paused tells, POST /resume "
                    "resumes it, or restart the server (a longer timeout_s waits longer)") from exc
            raise EngineError(f"vLLM server {self.url} is unreachable ({reason}) on {path}: is "
                              "it running there?") from exc
        return json.loads(payload) if payload.strip() else None

    def pause(self) -> None:
        """Pause generation in `pause_mode`. vLLM 0.32's router marks the pause's `clear_cache`
        parameter deprecated, so it is not sent: vLLM clears its caches after draining (its
        default; ignored for mode=keep), and the caller resets them again once the new weights
        are in (`reset_prefix_cache`, /reset_encoder_cache), which keep mode needs."""
        self.post(f"/pause?mode={self.pause_mode}")

    def reset_prefix_cache(self) -> None:
        """Leave no KV of the old weights reusable. vLLM's reset is all or nothing and fails while
        requests hold blocks: in keep mode the frozen ones do, so it is asked to preempt them
        (`reset_running_requests`): they are recomputed under the new weights after /resume. An
        answer without `success` (older servers answer nothing) counts as done; one with
        `success` false is an EngineError."""
        query = "?reset_running_requests=true" if self.pause_mode == "keep" else ""
        answer = self.post(f"/reset_prefix_cache{query}")
        if isinstance(answer, dict) and not answer.get("success", True):
            raise EngineError(f"vLLM server {self.url}/reset_prefix_cache{query} answered "
                              f"{json.dumps(answer)} (blocks still held)")
