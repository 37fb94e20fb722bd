"""The trainer's control plane of one weight push into one vLLM server (vLLM 0.32's weight-transfer
routes, with vlmcp's "vlmcp_gloo" backend: the server started with VLLM_SERVER_DEV_MODE=1 and
`--weight-transfer-config '{"backend": "vlmcp_gloo"}'`).

Trainer rank 0 drives `VllmPushControl(url, timeout_s=...)` for a push of step N; the tensors
themselves go over the gloo group, not over HTTP:

    probe()            GET  /get_world_size?include_dp=true    the engine's worker count n, over
                                   every data-parallel replica (TP x PP x DP)
    init_transfer(i)   POST /init_weight_transfer_engine {"init_info": i}
                                   returns once the workers joined the group (the caller joins it
                                   on another thread meanwhile)
    begin(N)           POST /pause?mode=wait  (or keep, abort)
                       POST /start_weight_update
    update(u)          POST /update_weights {"update_info": u}  returns once every bucket the
                                   trainer sends is loaded
    end(N)             POST /finish_weight_update {"weight_version": "N"}
                       POST /reset_prefix_cache     (keep mode: ?reset_running_requests=true)
                       POST /reset_encoder_cache
                       POST /resume
    release()          POST /shutdown_weight_transfer_engine  (best effort)

Every failure is one EngineError line naming the server's URL (`vllm_api.VllmHttp`) and the step.
Until /start_weight_update succeeded the old weights are intact, so a failed start resumes the
server; after it, a failure leaves the server paused (a half-updated model is never resumed) until
the next push brings it to the latest version. `times` holds the seconds of each phase (pause,
start, update, finish, caches, resume); `downtime_s`, the seconds from the pause's request to the
resume's answer.

Standard library only (and vlmcp's own standard-library modules): the trainer never imports vLLM.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vlmcp.engine.vllm_api import VllmHttp
from vlmcp.errors import EngineError

logger = logging.getLogger(__name__)

#: What a push that failed after the engine's update started leaves behind, in words.
PAUSED_NOTE = ("the server stays paused (a half-updated model is never resumed); the next push "
               "brings it to the latest version (to serve before that: restart it, or reload a "
               "complete step and resume it, docs/rl-loop.md)")
#: What a server needs for a push (said when it lacks the weight-transfer backend).
SERVER_SETUP = ("start the server with --weight-transfer-config '{\"backend\": \"vlmcp_gloo\"}' "
                "and VLLM_SERVER_DEV_MODE=1")


class VllmPushControl:
    """The HTTP side of one push into the vLLM server at `url` (see the module docstring).

    timeout_s: per request, including the blocking /init_weight_transfer_engine and
    /update_weights. pause_mode: "wait" (finish the requests in flight first), "keep" (freeze
    them: they go on under the new weights) or "abort".
    """

    def __init__(self, url: str, *, timeout_s: float, pause_mode: str = "wait"):
        self.http = VllmHttp(url, timeout_s=timeout_s, pause_mode=pause_mode)
        self.times: dict[str, float] = {}
        self.downtime_s: float | None = None
        self._step: int | None = None
        self._paused_at = 0.0
        self._updating = False

    @property
    def updating(self) -> bool:
        """Whether the server is paused in an update this push started and did not end: it
        holds part of the new weights and is not resumed (PAUSED_NOTE)."""
        return self._updating

    @property
    def url(self) -> str:
        """The server's URL (without a trailing slash)."""
        return self.http.url

    def probe(self) -> int:
        """How many workers the engine has, over all its data-parallel replicas (tensor x
        pipeline x data parallel): the ranks it takes in the push's group, since vLLM's server
        hands the weight-transfer routes to every replica's workers and each numbers itself
        `data_parallel_index * world_size + rank` (vllm_gloo). Changes nothing on the engine."""
        try:
            answer = self.http.get("/get_world_size?include_dp=true")
        except EngineError as exc:
            raise EngineError(f"{exc} (checked before the weight push; nothing was sent)") from exc
        size = answer.get("world_size") if isinstance(answer, dict) else None
        if type(size) is not int or size < 1:
            raise EngineError(f"vLLM server {self.url}/get_world_size answered "
                              f"{json.dumps(answer)}, not a worker count (checked before the "
                              "weight push; nothing was sent)")
        return size

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Have the engine's workers join the push's gloo group (`init_info`: its address, rank
        offset and size); returns once they joined, which needs the trainer's ranks to join it
        meanwhile. An earlier group of the engine is replaced."""
        try:
            self.http.post("/init_weight_transfer_engine", {"init_info": init_info})
        except EngineError as exc:
            answer = str(exc).partition(": HTTP ")[2].lower()
            hint = f" ({SERVER_SETUP})" if "backend" in answer or "not configured" in answer \
                else ""
            raise EngineError(f"{exc}; the workers of {self.url} did not join the weight-transfer "
                              f"group, before any weights were sent{hint}") from exc

    def begin(self, step: int) -> None:
        """Pause generation (in `pause_mode`, the pause's own cache clearing off: `end` resets
        the caches) and start the engine's update for step `step`. When the start fails, the old
        weights are intact: the server is resumed (best effort) and the EngineError raised."""
        self._step = step
        self._paused_at = time.perf_counter()
        try:
            with self._phase("pause"):
                self.http.pause()
        except EngineError as exc:
            raise EngineError(f"{exc}; pausing {self.url} for the push of step {step} failed, "
                              "before any weights were sent") from exc
        try:
            with self._phase("start"):
                self.http.post("/start_weight_update")
        except EngineError as exc:
            raise EngineError(f"{exc}; the push of step {step} into {self.url} did not start: "
                              f"the old weights are intact and the server {self._resume()}"
                              ) from exc
        self._updating = True

    def update(self, update_info: dict[str, Any]) -> None:
        """Have the engine receive and load the buckets `update_info` lists (the trainer sends
        them over the group meanwhile); returns once every bucket is loaded."""
        try:
            with self._phase("update"):
                self.http.post("/update_weights", {"update_info": update_info})
        except EngineError as exc:
            raise self._left_paused(exc, self._step) from exc

    def end(self, step: int) -> None:
        """Finish the update (the engine's weights now labelled `step`), reset the prefix cache
        (keep mode: preempting the frozen requests, recomputed under the new weights) and the
        encoder cache, and resume generation. Any failure leaves the server paused."""
        try:
            with self._phase("finish"):
                self.http.post("/finish_weight_update", {"weight_version": str(step)})
            with self._phase("caches"):
                self.http.reset_prefix_cache()
                self.http.post("/reset_encoder_cache")
            with self._phase("resume"):
                self.http.post("/resume")
        except EngineError as exc:
            raise self._left_paused(exc, step) from exc
        self._updating = False
        self.downtime_s = time.perf_counter() - self._paused_at

    def release(self) -> None:
        """Have the engine drop the push's group (best effort: a failure is logged, not
        raised; the next `init_transfer` replaces the group anyway)."""
        try:
            self.http.post("/shutdown_weight_transfer_engine")
        except EngineError as exc:
            logger.warning("releasing the weight-transfer group of %s failed (ignored): %s",
                           self.url, exc)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Record the seconds of the enclosed requests in `times[name]` (when they succeed)."""
        started = time.perf_counter()
        yield
        self.times[name] = time.perf_counter() - started

    def _resume(self) -> str:
        """Resume the server after a push that changed no weight; what became of it, in words."""
        try:
            self.http.post("/resume")
        except EngineError as exc:
            return f"stays paused (its /resume failed too: {exc})"
        return "was resumed"

    def _left_paused(self, exc: EngineError, step: int | None) -> EngineError:
        """The error of the push of `step` that failed after its update started."""
        return EngineError(f"{exc}; the push of step {step} into {self.url} failed after "
                           f"its update started: {PAUSED_NOTE}")
