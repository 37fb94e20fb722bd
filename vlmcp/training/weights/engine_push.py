"""Pushing a published step straight into running vLLM engines (`publish.engines`), no files.

vLLM 0.32's weight-transfer protocol: HTTP for the control plane (vlmcp/engine/weight_push_http.py,
standard library: the trainer never imports vLLM) and a transport for the bytes. The transport is
vlmcp's gloo backend, a vLLM plugin (`vlmcp_gloo`, vlmcp/engine/vllm_gloo.py) that `make engine`
installs into the engine venv; vLLM's own backends (`nccl`, `ipc`) need CUDA and a single sender.

Every trainer rank sends the share it would write (training/weights/shards.py: whole tensors, HF
names as in the published safetensors, under ZeRO-3 gathered to their writer, under EP the experts
a rank holds), from its publish thread, straight from the host copy of step N:

    one push of step N into one engine of n workers, over rank 0's `Rendezvous` store, keys under
    push/<seq>/<engine>/:
      every rank   meta/<r>       its buckets: [{src, tag, names, dtype_names, shapes, bytes}]
      rank 0       GET /get_world_size (probe; an unreachable engine: abort, nobody waits)
                   POST /init_weight_transfer_engine (side thread) -> the engine's workers set
                   ready/<k> and join a gloo group of W + n: trainer r is member r, worker k
                   member W + k
      every rank   waits for ready/0 (or abort), joins the group
    staged (publish.push_staged, the default; init_info listed every rank's buckets, interleaved,
    and the workers receive them into host buffers while the engine serves on):
      every rank   sends each of its buckets to every worker: one [bytes] uint8 buffer, its
                   tensors' bytes in `names` order (tag: its index on that rank); sets sent/<r>
                   (ok, or its error)
      rank 0       once every sent/<r> is ok: POST /pause, /start_weight_update,
                   /update_weights {staged: true} (loads the received buffers)
    streamed (push_staged false: no extra engine memory, the transfer inside the pause):
      rank 0       POST /pause, /start_weight_update, sets send = ok (or error), then POST
                   /update_weights {buckets of all ranks, interleaved} (side thread, returns once
                   every bucket is loaded)
      every rank   waits for send; sends its buckets as above
    then
      rank 0       POST /finish_weight_update {version N} (the engine repacks CPU experts there),
                   prefix and encoder caches reset, /resume, then POST
                   /shutdown_weight_transfer_engine after the resume

So the engine serves step N whole or not at all: it is paused before the first byte is loaded
and resumed only after the last was loaded and labelled N; a failure after /start_weight_update
leaves it paused (never serving a half-updated model) and the next push brings it to the latest
step, also after a restart, since every push makes its group anew. Staged, a send that fails
fails the push before the pause: the engine serves on, unpaused. A rank that waits gives up after
publish.engine_timeout_s; so do the gloo sends and the HTTP requests: nothing hangs. Failures are
PushFailed naming the engine and the step (publish.on_engine_error "error": the run stops after a
checkpoint, as for a failed write), or logged and reported in the publish's row ("warn").
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vlmcp.engine.weight_push_http import VllmPushControl
from vlmcp.errors import EngineError
from vlmcp.parallel import comm
from vlmcp.training.weights.sharded_write import PushFailed

logger = logging.getLogger(__name__)

#: Seconds between two looks at the store while waiting for the engine's workers or an abort.
_POLL_S = 0.02


@dataclass(frozen=True)
class Bucket:
    """One send of one trainer rank: the tensors `names` (dtypes, shapes) packed back to back
    into `bytes` bytes; `tag` is its index among that rank's buckets."""

    src: int
    tag: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bytes: int


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` travels in: `dtype` (publish.push_dtype) for a floating tensor, else
    its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def buckets_of(share: dict[str, torch.Tensor], src: int, bucket_bytes: int,
               dtype: torch.dtype | None = None) -> list[Bucket]:
    """`share` ({HF name: whole tensor}, this rank's, in its order) cut into buckets of at most
    `bucket_bytes` bytes (a larger tensor is a bucket of its own), its floating tensors in
    `dtype` (None: their own)."""
    buckets: list[Bucket] = []
    names: list[str] = []
    size = 0

    def close() -> None:
        nonlocal names, size
        if names:
            buckets.append(Bucket(src, len(buckets), names,
                                  [str(wire_dtype(share[n], dtype)).removeprefix("torch.")
                                   for n in names],
                                  [list(share[n].shape) for n in names], size))
        names, size = [], 0

    for name, tensor in share.items():
        nbytes = tensor.numel() * torch.empty((), dtype=wire_dtype(tensor, dtype)).element_size()
        if names and size + nbytes > bucket_bytes:
            close()
        names.append(name)
        size += nbytes
    close()
    return buckets


def pack(bucket: Bucket, share: dict[str, torch.Tensor], out: torch.Tensor | None = None
         ) -> torch.Tensor:
    """The bucket's bytes: `[bucket.bytes]` uint8, its tensors' bytes in `names` order, each in
    its dtype of `bucket.dtype_names` (into `out`'s first bytes when given)."""
    buffer = out[:bucket.bytes] if out is not None else torch.empty(bucket.bytes, dtype=torch.uint8)
    offset = 0
    for name, dtype in zip(bucket.names, bucket.dtype_names):
        tensor = share[name].to(getattr(torch, dtype))
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat)
        offset += flat.numel()
    return buffer


def interleaved(per_rank: list[list[Bucket]]) -> list[Bucket]:
    """Every rank's buckets, round robin over the ranks (each rank's in its own order), so that
    the engine waits for the ranks' sends in turn while all of them are under way."""
    out: list[Bucket] = []
    for index in range(max((len(b) for b in per_rank), default=0)):
        out += [buckets[index] for buckets in per_rank if index < len(buckets)]
    return out


@dataclass
class EngineOutcome:
    """One engine's part of one push, as rank 0 saw it: `problem` None when it serves the step;
    `phases` {phase: seconds} of the engine's control plane; `downtime_s` pause to resume."""

    url: str
    problem: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    downtime_s: float | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class PushSettings:
    """What `publish.*` says of the push (config/schema.py)."""

    urls: tuple[str, ...]
    bucket_bytes: int
    timeout_s: float
    pause_mode: str
    on_error: str
    host: str | None
    #: The dtype floating tensors travel in (publish.push_dtype), None: as trained.
    dtype: torch.dtype | None = None
    #: publish.push_staged: the bytes go into the engine's host memory before its pause.
    staged: bool = True


class EnginePush:
    """The push of published steps into `settings.urls` (see the module docstring). Build it on
    every rank at the same point (it opens rank 0's store); `push` runs on every rank's publish
    thread."""

    def __init__(self, settings: PushSettings):
        self.settings = settings
        self.rendezvous = comm.Rendezvous.open(settings.timeout_s)
        self.world = comm.world_size()
        self.rank = comm.rank()
        self._seq = 0
        #: Rank 0: each engine's part of the latest push (read by the publish's row).
        self.outcomes: list[EngineOutcome] = []
        #: Bytes of one engine's copy of the latest push, over all ranks (rank 0).
        self.pushed_bytes = 0

    def push(self, step: int, share: dict[str, torch.Tensor]) -> None:
        """Push this rank's `share` of step `step` into every engine (every rank, its publish
        thread). Raises PushFailed naming the engines that failed and the step under
        publish.on_engine_error "error" (on rank 0; another rank raises only for its own sends);
        under "warn" it logs them and returns."""
        self._seq += 1
        buckets = buckets_of(share, self.rank, self.settings.bucket_bytes, self.settings.dtype)
        outcomes = [self._one_engine(step, index, url, share, buckets)
                    for index, url in enumerate(self.settings.urls)]
        self.outcomes = outcomes
        failed = [o for o in outcomes if o.problem]
        if not failed:
            return
        text = "; ".join(o.problem for o in failed)
        if self.settings.on_error == "error":
            raise PushFailed(f"pushing step {step} into the engines: {text} "
                             "(publish.on_engine_error=\"warn\" trains on and reports it instead)")
        logger.error("rank %d: pushing step %d into the engines failed, training on "
                     "(publish.on_engine_error=\"warn\"): %s", self.rank, step, text)

    def _one_engine(self, step: int, index: int, url: str, share: dict[str, torch.Tensor],
                    buckets: list[Bucket]) -> EngineOutcome:
        outcome = EngineOutcome(url)
        prefix = f"push/{self._seq}/{index}/"
        started = time.perf_counter()
        store = self.rendezvous
        store.put(prefix + f"meta/{self.rank}", json.dumps([asdict(b) for b in buckets]))
        driver = _Driver(self, step, url, prefix) if self.rank == 0 else None
        try:
            workers = driver.start() if driver is not None else None
            group = self._join(prefix, workers)
            if group is None:
                if driver is not None:
                    outcome.problem = driver.problem
                return outcome
            workers = int(store.get(prefix + "workers", self.settings.timeout_s))
            if self.settings.staged:
                self._send(group, buckets, share, workers)
                store.put(prefix + f"sent/{self.rank}", "ok")
                if driver is not None:
                    driver.begin()
            else:
                if driver is not None:
                    driver.begin()
                elif store.get(prefix + "send", self.settings.timeout_s) != "ok":
                    return outcome
                self._send(group, buckets, share, workers)
            if driver is not None:
                driver.finish()
        except (EngineError, PushFailed, RuntimeError, TimeoutError) as exc:
            outcome.problem = (driver.problem if driver is not None and driver.problem else
                               f"engine {url}, step {step}: rank {self.rank}: "
                               f"{type(exc).__name__}: {exc}")
            if driver is not None:
                driver.fail(outcome.problem)
            elif self.settings.staged:  # rank 0 waits for it before the pause
                store.put(prefix + f"sent/{self.rank}", outcome.problem)
        finally:
            if driver is not None:
                outcome.phases, outcome.downtime_s = driver.phases(), driver.downtime_s()
                driver.close()
            outcome.seconds = time.perf_counter() - started
        return outcome

    def _join(self, prefix: str, workers: int | None) -> comm.ProcessGroup | None:
        """Wait until the engine's first worker is joining (or rank 0 aborted: None), then join
        the push's gloo group as member `rank`."""
        store, deadline = self.rendezvous, time.perf_counter() + self.settings.timeout_s
        ready, abort = prefix + "group/ready/0", prefix + "abort"
        while not store.store.check([ready]):
            if store.store.check([abort]):
                return None
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the engine's workers did not join the push within "
                                   f"{self.settings.timeout_s:g} s (publish.engine_timeout_s)")
            time.sleep(_POLL_S)
        size = self.world + int(workers if workers is not None else
                                store.get(prefix + "workers", self.settings.timeout_s))
        return store.gloo_group(prefix + "group/gloo", self.rank, size)

    def _send(self, group: comm.ProcessGroup, buckets: list[Bucket],
              share: dict[str, torch.Tensor], workers: int) -> None:
        """Every bucket of this rank to every worker of the engine (members W .. W + n - 1)."""
        scratch = torch.empty(max((b.bytes for b in buckets), default=0), dtype=torch.uint8)
        for bucket in buckets:
            buffer = pack(bucket, share, scratch)
            for worker in range(workers):
                comm.send_bytes(group, buffer, self.world + worker, bucket.tag)


class _Driver:
    """Rank 0's side of one push into one engine: the HTTP control plane and the store's keys
    the other ranks wait on."""

    def __init__(self, push: EnginePush, step: int, url: str, prefix: str):
        self.push, self.step, self.url, self.prefix = push, step, url, prefix
        settings = push.settings
        self.control = VllmPushControl(url, timeout_s=settings.timeout_s,
                                       pause_mode=settings.pause_mode)
        self.problem: str | None = None
        self._side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmcp-push-http")
        self._init: Future | None = None
        self._update: Future | None = None
        self._init_at = 0.0
        #: Seconds from the workers' init request to every rank's sends done (staged).
        self._stage_s: float | None = None
        self._buckets: list[Bucket] = []

    def start(self) -> int:
        """Probe the engine and start its workers' side of the group (on a side thread);
        returns how many workers it has. Sets `abort` for every rank when it cannot."""
        store, settings = self.push.rendezvous, self.push.settings
        per_rank = [[Bucket(**b) for b in json.loads(store.get(self.prefix + f"meta/{r}",
                                                               settings.timeout_s))]
                    for r in range(self.push.world)]
        self._buckets = interleaved(per_rank)
        self.push.pushed_bytes = sum(b.bytes for b in self._buckets)
        try:
            workers = self.control.probe()
        except EngineError as exc:
            self.fail(f"engine {self.url}, step {self.step}: {exc}")
            raise
        store.put(self.prefix + "workers", str(workers))
        parsed = urllib.parse.urlsplit(self.url)
        host = settings.host or comm.local_address_towards(parsed.hostname or "127.0.0.1",
                                                           parsed.port or 80)
        init_info = {"master_address": host, "master_port": store.port,
                     "store_prefix": self.prefix + "group", "rank_offset": self.push.world,
                     "world_size": self.push.world + workers, "timeout_s": settings.timeout_s}
        if settings.staged:
            init_info["buckets"] = [asdict(b) for b in self._buckets]
        self._init = self._side.submit(self._init_or_abort, init_info)
        self._init_at = time.perf_counter()
        return workers

    def _init_or_abort(self, init_info: dict[str, Any]) -> None:
        try:
            self.control.init_transfer(init_info)
        except EngineError as exc:
            self.fail(f"engine {self.url}, step {self.step}: {exc}")
            raise

    def begin(self) -> None:
        """After the group formed (staged: after every rank's sends): pause the engine and
        start its update; streamed, then let the ranks send. POST /update_weights goes on on the
        side thread."""
        store, settings = self.push.rendezvous, self.push.settings
        if settings.staged:
            self._wait_sent()
        self._init.result()
        try:
            self.control.begin(self.step)
        except EngineError as exc:
            self.fail(f"engine {self.url}, step {self.step}: {exc}")
            raise
        if settings.staged:
            info: dict[str, Any] = {"staged": True}
        else:
            store.put(self.prefix + "send", "ok")
            info = {"buckets": [asdict(b) for b in self._buckets]}
        self._update = self._side.submit(self.control.update, info)

    def _wait_sent(self) -> None:
        """Wait until every rank's sends of a staged push are done (rank 0's are); PushFailed
        with the first rank's own error when one failed."""
        store, timeout = self.push.rendezvous, self.push.settings.timeout_s
        for rank in range(1, self.push.world):
            said = store.get(self.prefix + f"sent/{rank}", timeout)
            if said != "ok":
                self.fail(said)
                raise PushFailed(said)
        self._stage_s = time.perf_counter() - self._init_at

    def finish(self) -> None:
        """After this rank's own sends: wait for the engine to load every bucket, then finish,
        relabel, reset the caches and resume it."""
        try:
            self._update.result()
            self.control.end(self.step)
        except EngineError as exc:
            self.fail(f"engine {self.url}, step {self.step}: {exc}")
            raise

    def fail(self, problem: str) -> None:
        """Record the first problem and release every rank still waiting on this push."""
        self.problem = self.problem or problem
        store = self.push.rendezvous
        store.put(self.prefix + "abort", "1")
        store.put(self.prefix + "send", "error")

    def phases(self) -> dict[str, float]:
        """{phase: seconds}: `stage` (staged: from the workers' init request until the group
        formed and every rank's bytes were sent, while the engine served on), then the control
        plane's (pause .. resume)."""
        staged = {"stage": self._stage_s} if self._stage_s is not None else {}
        return {**staged, **self.control.times}

    def downtime_s(self) -> float | None:
        return self.control.downtime_s

    def close(self) -> None:
        """Release the engine's side of the group (after the resume: outside its downtime) and
        the side thread, without waiting for a request the engine never answered."""
        if self._init is not None and self._init.done() and self._init.exception() is None:
            self.control.release()
        self._side.shutdown(wait=False)
