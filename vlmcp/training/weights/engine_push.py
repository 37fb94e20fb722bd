"""Pushing a published step straight into running vLLM engines (`publish.engines`), no files.

vLLM 0.32's weight-transfer protocol: HTTP for the control plane (vlmcp/engine/weight_push_http.py,
standard library: the trainer never imports vLLM) and a transport for the bytes. The transport is
vlmcp's gloo backend, a vLLM plugin (`vlmcp_gloo`, vlmcp/engine/vllm_gloo.py) that `make engine`
installs into the engine venv; vLLM's own backends (`nccl`, `ipc`) need CUDA and a single sender.

Every trainer rank sends the share it would write (training/weights/shards.py: whole tensors, HF
names as in the published safetensors, under ZeRO-3 gathered to their writer, under EP the experts
a rank holds), from its publish thread, straight from the host copy of step N; a LoRA run's
ranks send the merged weights (training/weights/lora_push.py: the adapted tensors, and the whole
merged model in a dense push), from the training's thread. Each push into one
engine is a session of vlmcp/engine/push_wire.py over rank 0's `Rendezvous` store (its keys, the
group's retried formation, the aborts every wait obeys):

    every rank   sparse/<r>: whether it can push sparse (publish.dense_every > 1, the engine
                 holds the previous push, confirmed by its report, fewer than dense_every - 1
                 sparse pushes since its last dense one, and the rank holds a base of its whole
                 share)
    rank 0       plan: sparse when every rank can, else dense; the push's token and its base;
                 every rank follows it
    rank 0       (publish.push_dtype set, the engine's first push only) POST
                 /init_weight_transfer_engine {describe: [names]}: worker 0 puts the dtype it
                 holds each tensor in under engines/<e>/dtypes; a tensor travels in that dtype
                 when known, else in push_dtype
    every rank   meta/<r>: its buckets (sparse: only the changed elements of its share against
                 its base, push_delta.py, each tensor encoded as its fewest bytes), its changed
                 and total elements
    rank 0       GET /get_world_size (probe; an unreachable engine: abort, nobody waits), then
                 attempt k = 0, 1, ...: POST /init_weight_transfer_engine (side thread): the
                 workers mark ready and join a gloo group of W + n (trainer r is member r, worker
                 k member W + k); staged, init_info lists every rank's buckets, interleaved
    every rank   waits for worker 0's mark, joins, and waits for every member's `joined` mark;
                 an attempt that failed anywhere is retried (push_wire.FORM_ATTEMPTS)
    staged (publish.push_staged, the default: the workers receive into host buffers while the
    engine serves on)
      every rank sends each of its buckets to every worker ([bytes] uint8, its tensors' bytes in
                 `names` order, tag its index on that rank), then sent/<r>
      rank 0     once every rank's sent/<r> is there: POST /pause, /start_weight_update,
                 /update_weights {staged: true} (loads the received buffers)
    streamed (push_staged false: no extra engine memory, the transfer inside the pause)
      rank 0     POST /pause, /start_weight_update, then `go`, then POST /update_weights {every
                 rank's buckets, interleaved} (side thread, returns once every bucket is loaded)
      every rank waits for `go`, sends its buckets as above, then sent/<r>
    then
      rank 0     POST /finish_weight_update {version N} (the engine repacks CPU experts there,
                 or a sparse push processes the layers it patched again), prefix and encoder
                 caches reset, /resume, POST /shutdown_weight_transfer_engine
      every rank (publish.verify_push, or sparse pushes) waits for every worker's report/<w>
                 (where each tensor lies, and its checksums, read while the engine serves) and
                 checks its own share against it (push_check.py): a mismatch fails the push,
                 naming the tensor; check/<r>
      every rank done/<r>; rank 0 reads every member's error, if any, and puts the push's
                 outcome; every rank reads it (the engine's version, whether the next push may
                 be sparse), then left/<r>; rank 0 deletes the session's keys once every rank
                 has left it (so the store holds no more keys after 10,000 pushes than after one)

A sparse push that fails anywhere (the engine restarted and no longer holds its base, a patch
that failed part-way, a failed check) is followed at once by a dense push of the same step into
that engine (the re-anchor, `push_reanchored` in the row): the engine ends the push serving step
N whole, never a mix. Each rank's base moves to step N once an engine took it (push_delta.py).

So the engine serves step N whole or not at all: it is paused before the first byte is loaded
and resumed only after the last was loaded and labelled N; a failure after /start_weight_update
leaves it paused (never serving a half-updated model) and the next push brings it to the latest
step, also after a restart, since every push makes its group anew. Staged, a send that fails
fails the push before the pause: the engine serves on, unpaused, and its workers drop what they
received. A member that fails aborts the session: every other member's waits and gloo
operations end within a poll (push_wire.WorkWatch), and the push's error names every failing
member (its own line, the trainer ranks' and the workers'), never a bystander's timeout. A wait
still gives up after publish.engine_timeout_s. Failures are PushFailed naming the engine and the
step (publish.on_engine_error "error": the run stops after a checkpoint, as for a failed write),
or logged and reported in the publish's row ("warn").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import socket
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmcp.engine.push_wire import (DENSE_MODE, FORM_ATTEMPTS, POLL_S, PROTOCOL, SPARSE_MODE,
                                    GroupNotFormed, PushAborted, Session, WireBucket,
                                    WireTensor, WorkWatch, cut_buckets, send_buckets,
                                    settle_sessions)
from vlmcp.engine.weight_push_http import PAUSED_NOTE, VllmPushControl
from vlmcp.errors import EngineError
from vlmcp.parallel import comm
from vlmcp.training.weights.push_check import check_share
from vlmcp.training.weights.push_delta import Delta, PushBase
from vlmcp.training.weights.sharded_write import PushFailed

logger = logging.getLogger(__name__)

#: Where rank 0 keeps an engine's dtype table for the run (outside any session's keys).
_DTYPES = "engines/{index}/dtypes"


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype | None, held: str | None = None
               ) -> torch.dtype:
    """The dtype `tensor` travels in: a floating tensor in the dtype the engine holds it in
    (`held`, when the engine named it), else in `dtype` (publish.push_dtype); else its own."""
    if not tensor.is_floating_point():
        return tensor.dtype
    if held is not None:
        return getattr(torch, held)
    return dtype if dtype is not None else tensor.dtype


def buckets_of(share: dict[str, torch.Tensor], src: int, bucket_bytes: int,
               dtype: torch.dtype | None = None, held: dict[str, str] | None = None
               ) -> list[WireBucket]:
    """`share` ({HF name: whole tensor}, this rank's, in its order) cut into buckets of at most
    `bucket_bytes` bytes (a larger tensor is a bucket of its own), each floating tensor in its
    `wire_dtype` (`held`: {name: dtype name} the engine holds)."""
    held = held or {}
    listed = []
    for name, tensor in share.items():
        sent = wire_dtype(tensor, dtype, held.get(name))
        listed.append(WireTensor(name, str(sent).removeprefix("torch."), list(tensor.shape),
                                 tensor.numel() * sent.itemsize))
    return cut_buckets(src, listed, bucket_bytes)


def interleaved(per_rank: list[list[WireBucket]]) -> list[WireBucket]:
    """Every rank's buckets, round robin over the ranks (each rank's in its own order), so that
    the engine waits for the ranks' sends in turn while all of them are under way."""
    out: list[WireBucket] = []
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
    #: DENSE_MODE or SPARSE_MODE; whether a failed sparse push was followed by a dense one (the
    #: problem then is the dense one's, None when it landed); bytes of one engine's copy.
    mode: str = DENSE_MODE
    reanchored: bool = False
    #: Whether the engine serves the step (every rank knows; `problem` is rank 0's view).
    landed: bool = False
    bytes: int = 0
    #: Rank 0: seconds of the delivery check (waiting for the reports and its own share's).
    check_s: float | None = None


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
    #: publish.dense_every: every N-th push into an engine is dense, the others sparse.
    dense_every: int = 1
    #: publish.verify_push: check the engine's checksums after every push.
    verify: bool = True

    @property
    def hold(self) -> bool:
        """Whether the engines keep and report where each tensor lies (sparse pushes need it,
        and so does the check)."""
        return self.verify or self.dense_every > 1


@dataclass
class _EngineState:
    """What every rank knows of one engine after its pushes (from each push's outcome): the
    token of the version it holds (None: unknown, the next push is dense), sparse pushes since
    its last dense one, whether it holds every element of every pushed tensor somewhere (it can
    take patches), and {name: the dtype it holds it in} (this rank's share)."""

    token: str | None = None
    sparse_since: int = 0
    patchable: bool = True
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)


def store_address(settings: PushSettings) -> tuple[str, str | None]:
    """(the address rank 0's push store listens on, the address the engines are told to reach it
    at: None for each engine's own interface). It listens on one interface when one address
    serves every peer: publish.push_host, else the interface that reaches the engines (an engine
    on this host reaches any of its addresses) and, with trainer ranks on other hosts, the one
    that reaches them (MASTER_ADDR). Peers on several interfaces: every interface, logged."""
    if settings.host:
        return settings.host, settings.host
    needed = set()
    for url in settings.urls:
        parts = urllib.parse.urlsplit(url)
        address = comm.local_address_towards(parts.hostname or "127.0.0.1", parts.port or 80)
        if not address.startswith("127."):
            needed.add(address)
    world = comm.world_size()
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world:
        master = socket.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if not master.startswith("127."):
            needed.add(master)
    if len(needed) > 1:
        logger.warning("publish.engines: the push's rendezvous store on trainer rank 0 listens "
                       "on every interface, since its peers reach it at %s; set "
                       "publish.push_host to one address they all reach to restrict it "
                       "(docs/rl-loop.md)", ", ".join(sorted(needed)))
        return "0.0.0.0", None
    address = needed.pop() if needed else "127.0.0.1"
    return address, address


class EnginePush:
    """The push of published steps into `settings.urls` (see the module docstring). Build it on
    every rank at the same point (it opens rank 0's store); `push` runs on every rank's publish
    thread."""

    def __init__(self, settings: PushSettings):
        self.settings = settings
        bind, self._engine_host = store_address(settings) if comm.rank() == 0 else (None, None)
        self.rendezvous = comm.Rendezvous.open(settings.timeout_s, bind)
        self.world = comm.world_size()
        self.rank = comm.rank()
        self._seq = 0
        #: Rank 0: the prefixes of the sessions whose keys are not deleted yet.
        self._open: list[str] = []
        #: {engine index: {name: dtype name}} each engine holds (publish.push_dtype only).
        self._held: dict[int, dict[str, str]] = {}
        #: Rank 0: a name for this run's pushes in the engines' version tokens.
        self._run = secrets.token_hex(4)
        self._engines = [_EngineState() for _ in settings.urls]
        #: This rank's share as last pushed, for sparse pushes (publish.dense_every > 1).
        self.base = PushBase()
        #: Rank 0: each engine's part of the latest push (read by the publish's row).
        self.outcomes: list[EngineOutcome] = []
        #: Bytes of one engine's copy of the latest push, over all ranks (rank 0; the largest
        #: of the engines', a dense one's when any was dense).
        self.pushed_bytes = 0
        #: Rank 0: changed and total elements of the latest sparse push, over all ranks.
        self.changed: tuple[int, int] | None = None

    def push(self, step: int, share: dict[str, torch.Tensor],
             whole: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        """Push this rank's `share` of step `step` into every engine (every rank, its publish
        thread). `whole`: where `share` holds only the tensors that change from push to push
        (a LoRA run's, training/weights/lora_push.py), this rank's part of the whole model, which
        a dense push sends; called at most once, by every rank at the same point, and only when
        some engine gets a dense push. Raises PushFailed naming the engines that failed, the step
        and every failing member's error under publish.on_engine_error "error" (on rank 0;
        another rank raises only for its own failures); under "warn" it logs them and returns."""
        outcomes, self.changed, delta = [], None, None
        dense = functools.cache(whole) if whole is not None else (lambda: share)
        for index, url in enumerate(self.settings.urls):
            if delta is None and self._sparse_next(index) and self.base.ready_for(share):
                delta = self.base.delta(share)
            outcome = self._one_engine(step, index, url, share, delta, dense)
            if outcome.mode == SPARSE_MODE and not outcome.landed:
                if self.rank == 0:
                    logger.warning("engine %s, step %d: the sparse push failed, pushing the "
                                   "step whole instead (the re-anchor): %s", url, step,
                                   outcome.problem)
                outcome = dataclasses.replace(
                    self._one_engine(step, index, url, share, None, dense), reanchored=True)
            outcomes.append(outcome)
        self.outcomes = outcomes
        self.pushed_bytes = max((o.bytes for o in outcomes), default=0)
        if self.settings.dense_every > 1 and any(o.landed for o in outcomes):
            held = next((e.dtypes for e in self._engines if e.token is not None), {})
            self.base.advance(step, share, held)
        if self.rank == 0:
            self._open = settle_sessions(self.rendezvous.store, self._open, self.world)
        failed = [o for o in outcomes if o.problem]
        if not failed:
            return
        text = "; ".join(o.problem for o in failed)
        if self.settings.on_error == "error":
            raise PushFailed(f"pushing step {step} into the engines: {text} "
                             "(publish.on_engine_error=\"warn\" trains on and reports it instead)")
        logger.error("rank %d: pushing step %d into the engines failed, training on "
                     "(publish.on_engine_error=\"warn\"): %s", self.rank, step, text)

    def keys(self) -> int:
        """How many keys rank 0's store holds (rank 0)."""
        return self.rendezvous.store.num_keys()

    def _sparse_next(self, index: int) -> bool:
        """Whether the next push into engine `index` is sparse (every rank decides alike: the
        engine's state comes from the pushes' outcomes every rank reads)."""
        engine = self._engines[index]
        return (self.settings.dense_every > 1 and engine.token is not None and engine.patchable
                and engine.sparse_since < self.settings.dense_every - 1
                and self.base.step is not None)

    def _one_engine(self, step: int, index: int, url: str, share: dict[str, torch.Tensor],
                    delta: Delta | None, dense: Callable[[], dict[str, torch.Tensor]]
                    ) -> EngineOutcome:
        """One session: push into engine `index` sparse (`delta`, the changes of `share`) when
        `delta` is given and the engine may take it, else dense (`dense()`, this rank's part of
        the whole model); check what was pushed; every rank learns the outcome."""
        self._seq += 1
        engine = self._engines[index]
        outcome = EngineOutcome(url)
        session = Session(self.rendezvous.store, f"push/{self._seq}/{index}/", self.rank,
                          self.world, self.settings.timeout_s)
        if self.rank == 0:
            self._open.append(session.prefix)
        driver = _Driver(self, session, step, url, index) if self.rank == 0 else None
        started = time.perf_counter()
        try:
            session.put(f"sparse/{self.rank}",
                        "1" if delta is not None and self._sparse_next(index) else "0")
            if driver is not None:
                driver.plan_push(engine.token, f"{self._run}/{step}")
            plan = json.loads(session.wait_key("plan", "rank 0's plan of the push"))
            outcome.mode = plan["mode"]
            if outcome.mode == SPARSE_MODE:
                buckets = delta.buckets(self.rank, self.settings.bucket_bytes)
                payload: dict[str, Any] = delta.parts
                counts, pushed = [delta.changed, delta.total], share
            else:
                pushed = dense()
                held = self._held_dtypes(session, index, driver, pushed) \
                    if self.settings.dtype is not None else {}
                buckets = buckets_of(pushed, self.rank, self.settings.bucket_bytes,
                                     self.settings.dtype, held)
                payload, counts = pushed, None
            session.put(f"meta/{self.rank}", json.dumps(
                {"buckets": [b.to_json() for b in buckets], "counts": counts}))
            if driver is not None:
                driver.start()
            session = dataclasses.replace(session, workers=int(session.wait_key(
                "workers", "the engine's worker count")))
            group = self._form(session, driver)
            self._transfer(session, driver, group, buckets, payload)
            if self.settings.hold:
                checked = time.perf_counter()
                self._check(session, url, step, plan["token"], pushed, engine)
                outcome.check_s = time.perf_counter() - checked
        except PushAborted:
            pass  # another member failed: its own error is the push's (read by rank 0 below)
        except GroupNotFormed as exc:  # every rank saw it; rank 0 reports it
            if driver is not None:
                session.fail(f"engine {url}, step {step}: the push group did not form in "
                             f"{FORM_ATTEMPTS} attempts: {exc}")
        except Exception as exc:  # any failure of one member is the session's, never a hang
            detail = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            session.fail(f"engine {url}, step {step}: {session.who()}: {detail}")
        finally:
            self._settle(session, driver, outcome, engine)
            outcome.seconds = time.perf_counter() - started
        return outcome

    def _check(self, session: Session, url: str, step: int, token: str,
               share: dict[str, torch.Tensor], engine: _EngineState) -> None:
        """This rank's part of the delivery check: every worker's report against its share
        (push_check.py); its verdict under check/<r>, a mismatch fails the push naming the
        tensors."""
        reports = [json.loads(session.wait_key(f"report/{worker}", f"engine worker {worker}'s "
                                                                   "report of the push"))
                   for worker in range(session.workers)]
        result = check_share(share, reports, token, digests=self.settings.verify)
        engine.dtypes.update(result.dtypes)
        session.put(f"check/{self.rank}", json.dumps({"patchable": result.patchable}))
        if result.problems:
            more = f" (and {len(result.problems) - 3} more)" if len(result.problems) > 3 else ""
            raise EngineError(f"the delivery check failed: {'; '.join(result.problems[:3])}"
                              f"{more}")

    def _settle(self, session: Session, driver: _Driver | None, outcome: EngineOutcome,
                engine: _EngineState) -> None:
        """The session's end on every rank: done/<r>; rank 0 reads every member's error and
        puts the outcome, then releases the engine's side of the group (the other ranks do not
        wait for that); every rank reads the outcome into the engine's state, then left/<r>."""
        session.put(f"done/{self.rank}", "1")
        if driver is not None:
            problem = driver.close()
            patchable = all(json.loads(session.read(f"check/{r}"))["patchable"]
                            for r in range(self.world) if session.has(f"check/{r}"))
            session.put("outcome", json.dumps({
                "problem": problem, "patchable": patchable, "bytes": driver.pushed_bytes,
                "counts": driver.counts}))
            driver.release()
            outcome.phases, outcome.downtime_s = driver.phases(), driver.downtime_s()
        result = json.loads(session.wait_key("outcome", "rank 0's outcome of the push",
                                             abortable=False))
        session.put(f"left/{self.rank}", "1")
        outcome.bytes, outcome.landed = result["bytes"], result["problem"] is None
        if driver is not None:
            outcome.problem = result["problem"]
            if result["counts"] is not None:
                self.changed = tuple(result["counts"])
        elif session.has(f"failed/{self.rank}"):
            outcome.problem = session.read(f"failed/{self.rank}")
        if result["problem"] is None:
            plan = json.loads(session.read("plan"))
            engine.token, engine.patchable = plan["token"], result["patchable"]
            engine.sparse_since = engine.sparse_since + 1 if outcome.mode == SPARSE_MODE else 0
        else:
            engine.token = None

    def _held_dtypes(self, session: Session, index: int, driver: _Driver | None,
                     share: dict[str, torch.Tensor]) -> dict[str, str]:
        """{name: dtype} the engine holds the pushed tensors in, asked once per engine (rank 0
        describes, every rank reads the table from the store)."""
        if index not in self._held:
            key = _DTYPES.format(index=index)
            session.put(f"names/{self.rank}", json.dumps(list(share)))
            if driver is not None and not self.rendezvous.store.check([key]):
                driver.describe(key)
            self._held[index] = json.loads(session.wait_store_key(
                key, "the engine's table of the dtypes it holds"))
        return self._held[index]

    def _form(self, session: Session, driver: _Driver | None) -> Any:
        """The session's gloo group: attempt after attempt until one forms on every member
        (rank 0 asks the engine for each; the others follow worker 0's ready mark)."""
        attempt = 0
        while True:
            if driver is not None:
                driver.init(attempt)
            session.wait_key(f"try{attempt}/ready/0", "the engine's workers joining the push")
            try:
                return session.form_group(attempt)
            except GroupNotFormed as exc:
                attempt += 1
                if attempt == FORM_ATTEMPTS:
                    raise
                if driver is not None:
                    logger.warning("engine %s, step %d: %s; trying again", driver.url,
                                   driver.step, exc)

    def _transfer(self, session: Session, driver: _Driver | None, group: Any,
                  buckets: list[WireBucket], payload: dict[str, Any]) -> None:
        """This rank's sends, staged or streamed, and rank 0's control plane around them."""
        workers = range(self.world, session.size)
        with WorkWatch(session, group) as watch:
            if not self.settings.staged:
                if driver is not None:
                    driver.begin()
                else:
                    session.wait_key("go", "the engine's pause for the push")
            send_buckets(watch, group, buckets, payload, workers)
            session.put(f"sent/{self.rank}", "ok")
            if driver is not None:
                if self.settings.staged:
                    driver.begin()
                driver.finish()


class _Driver:
    """Rank 0's side of one push into one engine: the HTTP control plane, and the session's keys
    the other members wait on."""

    def __init__(self, push: EnginePush, session: Session, step: int, url: str, index: int):
        self.push, self.session, self.step, self.url, self.index = push, session, step, url, index
        #: The push's mode, token and base (`plan_push`).
        self.plan: dict[str, Any] = {}
        #: Bytes of the engine's copy of the push, and (sparse) changed and total elements.
        self.pushed_bytes = 0
        self.counts: list[int] | None = None
        settings = push.settings
        self.control = VllmPushControl(url, timeout_s=settings.timeout_s,
                                       pause_mode=settings.pause_mode)
        self._side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmcp-push-http")
        self._init: Future | None = None
        self._update: Future | None = None
        self._init_at = 0.0
        self._joined = False
        #: Seconds from the workers' first init request to every rank's sends done (staged).
        self._stage_s: float | None = None
        self._buckets: list[WireBucket] = []
        self._workers = 0

    def _init_info(self, **fields: Any) -> dict[str, Any]:
        host = self.push._engine_host
        if host is None:
            parsed = urllib.parse.urlsplit(self.url)
            host = comm.local_address_towards(parsed.hostname or "127.0.0.1", parsed.port or 80)
        return {"protocol": PROTOCOL, "master_address": host,
                "master_port": self.push.rendezvous.port, "store_prefix": self.session.prefix,
                "rank_offset": self.push.world, "timeout_s": self.push.settings.timeout_s,
                **fields}

    def describe(self, key: str) -> None:
        """Have the engine's worker 0 put the dtype it holds each pushed tensor in under `key`
        (every rank's names, from the session's `names/<r>`)."""
        names = [name for r in range(self.push.world) for name in json.loads(
            self.session.wait_key(f"names/{r}", f"rank {r}'s tensor names"))]
        try:
            self.control.init_transfer(self._init_info(world_size=self.push.world + 1,
                                                       describe=names, describe_key=key))
        except EngineError as exc:
            raise EngineError(f"{exc} (asking it which dtype it holds each tensor in, for "
                              "publish.push_dtype)") from exc

    def start(self) -> None:
        """Read every rank's buckets and probe the engine for its worker count (puts `workers`).
        An unreachable engine fails the session before any group is formed."""
        session = self.session
        metas = [json.loads(session.wait_key(f"meta/{r}", f"rank {r}'s buckets"))
                 for r in range(self.push.world)]
        self._buckets = interleaved([[WireBucket(**b) for b in meta["buckets"]]
                                     for meta in metas])
        self.pushed_bytes = sum(b.size for b in self._buckets)
        if self.plan["mode"] == SPARSE_MODE:
            self.counts = [sum(meta["counts"][i] for meta in metas) for i in (0, 1)]
        self._workers = self.control.probe()
        session.put("workers", str(self._workers))

    def init(self, attempt: int) -> None:
        """Ask the engine's workers to join attempt `attempt` of the group (on the side thread).
        A request that fails before worker 0 marked itself ready fails the session at once;
        after it, the members' `joined` marks tell the attempt's outcome."""
        settings = self.push.settings
        info = self._init_info(world_size=self.push.world + self._workers, attempt=attempt,
                               mode=self.plan["mode"], token=self.plan["token"],
                               base=self.plan["base"], hold=settings.hold,
                               verify=settings.verify)
        if self.push.settings.staged:
            info["buckets"] = [b.to_json() for b in self._buckets]
        if attempt == 0:
            self._init_at = time.perf_counter()
        self._init = self._side.submit(self._init_or_abort, info, attempt)

    def _init_or_abort(self, info: dict[str, Any], attempt: int) -> None:
        try:
            self.control.init_transfer(info)
        except EngineError as exc:
            if not self.session.has(f"try{attempt}/ready/0"):
                self.session.fail(f"engine {self.url}, step {self.step}: {exc}")
            raise
        self._joined = True

    def begin(self) -> None:
        """After the group formed (staged: after every rank's sends): pause the engine and
        start its update; streamed, then let the ranks send (`go`). POST /update_weights goes
        on on the side thread."""
        session, staged = self.session, self.push.settings.staged
        if staged:
            session.wait_all((f"sent/{r}" for r in range(self.push.world)),
                             "every rank's sends to the engine")
            self._stage_s = time.perf_counter() - self._init_at
        self._wait(self._init, "the workers' join request")
        self.control.begin(self.step)
        if staged:
            info: dict[str, Any] = {"staged": True}
        else:
            session.put("go", "1")
            info = {"buckets": [b.to_json() for b in self._buckets]}
        self._update = self._side.submit(self.control.update, info)

    def finish(self) -> None:
        """After this rank's own sends: wait for the engine to load every bucket (or the session
        to abort), then finish, relabel, reset the caches and resume it."""
        self._wait(self._update, "the engine's load of the buckets")
        self.control.end(self.step)

    def _wait(self, future: Future, what: str) -> None:
        """The side thread's `future`, raising its error; PushAborted when the session aborts
        first, TimeoutError after publish.engine_timeout_s."""
        deadline = time.monotonic() + self.push.settings.timeout_s
        while True:
            try:
                future.result(timeout=POLL_S)
                return
            except FutureTimeout:
                if self.session.aborted():
                    raise PushAborted(self.session.abort_reason()) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not end within "
                                       f"{self.push.settings.timeout_s:g} s") from None

    def phases(self) -> dict[str, float]:
        """{phase: seconds}: `stage` (staged: from the workers' init request until the group
        formed and every rank's bytes were sent, while the engine served on), then the control
        plane's (pause .. resume)."""
        staged = {"stage": self._stage_s} if self._stage_s is not None else {}
        return {**staged, **self.control.times}

    def downtime_s(self) -> float | None:
        return self.control.downtime_s

    def plan_push(self, base: str | None, token: str) -> None:
        """Put the push's plan: sparse (against `base`, the version the engine holds) when every
        rank marked sparse/<r> (each holds a base of its whole share and the engine may take a
        patch), else dense; labelled `token` once it lands."""
        session = self.session
        sparse = all(session.wait_key(f"sparse/{r}", f"rank {r}'s choice of the push") == "1"
                     for r in range(self.push.world))
        self.plan = {"mode": SPARSE_MODE if sparse else DENSE_MODE, "token": token,
                     "base": base if sparse else None}
        session.put("plan", json.dumps(self.plan))

    def release(self) -> None:
        """Release the engine's side of the group (after the resume, outside its downtime) and
        the side thread, without waiting for a request the engine never answered."""
        if self._joined:
            self.control.release()
        self._side.shutdown(wait=False)

    def close(self) -> str | None:
        """After rank 0's part: wait until every rank ended its part of the session and return
        every member's error, or None when the engine serves the step."""
        session = self.session
        try:
            session.wait_all((f"done/{r}" for r in range(self.push.world)),
                             "every rank's end of the push", abortable=False)
        except TimeoutError as exc:
            logger.warning("engine %s, step %d: %s", self.url, self.step, exc)
        problems = session.failures()
        if problems and self.control.updating and not any(PAUSED_NOTE in p for p in problems):
            problems.append(f"engine {self.url}, step {self.step}: the push failed after the "
                            f"engine's update started: {PAUSED_NOTE}")
        return "; ".join(problems) or None
