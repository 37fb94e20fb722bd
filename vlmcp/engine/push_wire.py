"""The wire of a weight push: what the trainer's ranks and an engine's workers both follow.

Both sides import this module: the trainer on every rank's publish thread
(training/weights/engine_push.py) and each vLLM worker of an engine (engine/vllm_gloo.py, vlmcp's
weight-transfer backend, in the engine venv). It talks to torch.distributed itself, a TCPStore
client and gloo groups outside any training world, rather than through vlmcp.parallel.comm, which
needs DeepSpeed: the engine venv has torch but not DeepSpeed. Standard library and torch only.

One push of one step into one engine is a *session* under the key prefix P = `push/<seq>/<e>/` of
trainer rank 0's TCPStore (`comm.Rendezvous`). Its members: trainer ranks 0..W-1 (member r) and
the engine's workers 0..n-1 (member W + k). Every key of the session lies under P, so rank 0
deletes the whole session once every trainer rank has left it (`left/<r>`):

    P sparse/<r>            trainer rank r can push sparse ("1") or not ("0")
    P plan                  rank 0: the push's mode (sparse when every rank can), token and base
    P meta/<r>              trainer rank r's buckets (JSON list of `WireBucket`), changed counts
    P workers               n, the engine's worker count (rank 0, from the engine)
    P dtypes                {checkpoint name: dtype} the engine holds (a describe session only)
    P try<k>/ready/<w>      worker w is joining attempt k of the group
    P try<k>/gloo/...       gloo's own rendezvous keys of attempt k
    P try<k>/joined/<m>     "ok", or member m's error building attempt k's group
    P failed/<m>            member m's error: the push fails
    P abort                 set by whoever failed (after its failed/<m>): every wait ends
    P go                    streamed pushes: rank 0 paused the engine, send now
    P sent/<r>              trainer rank r sent every bucket it holds
    P report/<w>            worker w's placements (and checksums) after the update (vllm_held)
    P check/<r>             trainer rank r's delivery check of its share
    P done/<r>              trainer rank r's part is over
    P outcome               rank 0: the push's outcome (every rank reads it before it leaves)
    P left/<r>              trainer rank r is done with the session's keys

**The group, with retries.** A gloo group of W + n members forms per attempt k: the workers mark
`ready`, the trainer ranks join once worker 0's mark is there, every member writes `joined` ("ok"
or its error) and waits for every member's mark. So all members agree on the outcome of each
attempt: one that failed anywhere (a connection refused or closed while the full mesh forms) is
dropped everywhere, before any byte was sent, and rank 0 asks for attempt k + 1, up to
`FORM_ATTEMPTS`, every member's error logged; after the last, the push fails naming all of them.

**No wait outlives the push's failure.** A member that fails writes `failed/<m>` and `abort`.
Every wait of the session polls `abort` (`Session.wait_key`), and every gloo send and receive
runs under a `WorkWatch`: a thread that ends the member's pending operations once `abort`
appears. gloo has no cancel: `ProcessGroupGloo.abort` leaves a pending receive waiting, and a
wait that times out closes every pair of the member's gloo context, so that every pending
operation raises at once and every later one at its post. That timed wait goes to a receive
of the watch's own that nobody ever sends (the sentinel), never to an operation another thread
waits on or will wait on: a gloo operation completes to one wait only, so a timed wait on a
receive that had arrived would take its completion and leave its owner waiting out the group's
timeout. So a failed send of one rank ends every other rank's sends and the workers' receives
within a poll, and the error that reaches the user is the failing member's own, never a timeout
of a bystander.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlmcp.engine import push_patch

#: The version of this protocol; the trainer and an engine's backend must speak the same one.
PROTOCOL = 3
#: A push's modes: every tensor through vLLM's layerwise reload, or patches applied in place.
DENSE_MODE, SPARSE_MODE = "dense", "sparse"
#: Attempts at forming one push's group before the push fails.
FORM_ATTEMPTS = 3
#: Seconds between two looks at the store while a member waits.
POLL_S = 0.02
#: The timed wait on the sentinel that ends a member's pending gloo operations (module docstring).
_CANCEL = timedelta(milliseconds=1)
#: The sentinel's tag: above any bucket's (a bucket's tag is its index on its rank).
_SENTINEL_TAG = 1 << 30


class PushAborted(Exception):
    """Another member of the session failed (its error is the message); this member stopped."""


class GroupNotFormed(Exception):
    """An attempt at the session's group failed on some member (every member's error in
    `problems`); nothing was sent on it."""

    def __init__(self, attempt: int, problems: list[str]):
        super().__init__(f"attempt {attempt + 1} at the push group failed: " + "; ".join(problems))
        self.attempt, self.problems = attempt, problems


@dataclass
class WireBucket:
    """One buffer a trainer rank sends: the tensors `names` (checkpoint names), of `dtype_names`
    and `shapes`, their bytes back to back in `names` order; `tag` is its index among `src`'s
    buckets; `bytes` the buffer's size (checked when given). `encodings` (a sparse push; None:
    every tensor dense) says how each tensor travels (push_patch.py: ["dense"], ["index", k] or
    ["bitmap", k])."""

    src: int
    tag: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bytes: int | None = None
    encodings: list[list[Any]] | None = None
    dtypes: list[torch.dtype] = field(init=False, repr=False)
    nbytes: list[int] = field(init=False, repr=False)
    kinds: list[tuple[str, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        expect_type(self.src, int, "src")
        expect_type(self.tag, int, "tag")
        if self.src < 0:
            raise ValueError(f"src {self.src} is negative")
        for name in ("names", "dtype_names", "shapes"):
            expect_type(getattr(self, name), list, name)
        if not self.names:
            raise ValueError("names is empty (a bucket holds at least one tensor)")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length "
                             f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})")
        encodings = self.encodings
        if encodings is not None:
            expect_type(encodings, list, "encodings")
            if len(encodings) != len(self.names):
                raise ValueError(f"encodings has {len(encodings)} entries for "
                                 f"{len(self.names)} tensors")
        self.dtypes, self.nbytes, self.kinds = [], [], []
        for index, (name, dtype_name, shape) in enumerate(
                zip(self.names, self.dtype_names, self.shapes)):
            if not isinstance(name, str) or not name:
                raise ValueError(f"name {name!r} is not a non-empty string")
            dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: dtype {dtype_name!r} is not a torch dtype name")
            if not isinstance(shape, list) or not all(
                    type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"{name}: shape {shape!r} is not a list of sizes")
            numel = 1
            for size in shape:
                numel *= size
            kind = (push_patch.DENSE, numel) if encodings is None else \
                push_patch.parse_encoding(encodings[index], numel, name)
            self.dtypes.append(dtype)
            self.kinds.append(kind)
            self.nbytes.append(push_patch.encoded_bytes(kind[0], numel, kind[1], dtype))
        if self.bytes is not None and self.bytes != sum(self.nbytes):
            raise ValueError(f"bytes {self.bytes!r} is not the {sum(self.nbytes)} bytes of its "
                             "tensors")

    @property
    def size(self) -> int:
        """The bytes of the buffer the trainer sends for this bucket."""
        return sum(self.nbytes)

    @property
    def sparse(self) -> bool:
        """Whether it lists encodings (a sparse push's bucket)."""
        return self.encodings is not None

    def to_json(self) -> dict[str, Any]:
        """The bucket as the wire lists it."""
        fields = asdict(self)
        del fields["dtypes"], fields["nbytes"], fields["kinds"]
        if self.encodings is None:
            del fields["encodings"]
        return {**fields, "bytes": self.size}

    def describe(self, index: int) -> str:
        more = f" and {len(self.names) - 1} more" if len(self.names) > 1 else ""
        return (f"bucket {index} (src {self.src}, tag {self.tag}, {self.size} bytes: "
                f"{self.names[0]}{more})")

    def pack(self, share: dict[str, Any], out: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's bytes from `share` ({name: tensor}, cast to its dtype of `dtype_names`,
        or the list of its wire parts, push_patch.encode): `[size]` uint8 (into `out`'s first
        bytes when given)."""
        buffer = out[:self.size] if out is not None else torch.empty(self.size, dtype=torch.uint8)
        offset = 0
        for name, dtype, (kind, _), nbytes in zip(self.names, self.dtypes, self.kinds,
                                                 self.nbytes):
            value = share[name]
            parts = value if isinstance(value, list) else [value.to(dtype)]
            for part in parts:
                flat = part.contiguous().reshape(-1).view(torch.uint8)
                buffer[offset:offset + flat.numel()].copy_(flat)
                offset += flat.numel()
        if offset != self.size:
            raise ValueError(f"{self.describe(0)}: its tensors packed into {offset} bytes")
        return buffer

    def tensors(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors of a dense push, sliced out of `buffer` (views; a tensor whose
        offset does not suit its dtype's alignment is copied first)."""
        if self.sparse:
            raise ValueError("a sparse push's bucket holds patches: read it with patches()")
        pairs, offset = [], 0
        for name, dtype, shape, nbytes in zip(self.names, self.dtypes, self.shapes, self.nbytes):
            chunk = buffer[offset:offset + nbytes]
            if offset % dtype.itemsize:
                chunk = chunk.clone()
            pairs.append((name, chunk.view(dtype).view(shape)))
            offset += nbytes
        return pairs

    def patches(self, buffer: torch.Tensor) -> list[push_patch.Patch]:
        """The bucket's tensors as patches (push_patch.decode), any encoding."""
        patches, offset = [], 0
        for name, dtype, shape, (kind, count), nbytes in zip(
                self.names, self.dtypes, self.shapes, self.kinds, self.nbytes):
            patches.append(push_patch.decode(name, kind, count, tuple(shape), dtype,
                                             buffer[offset:offset + nbytes]))
            offset += nbytes
        return patches


@dataclass(frozen=True)
class WireTensor:
    """One tensor as a trainer rank lists it for the wire: its checkpoint name, dtype name,
    shape, bytes on the wire and (a sparse push) encoding."""

    name: str
    dtype_name: str
    shape: list[int]
    nbytes: int
    encoding: list[Any] | None = None


def cut_buckets(src: int, tensors: list[WireTensor], bucket_bytes: int) -> list[WireBucket]:
    """`tensors` (trainer rank `src`'s, in its order) cut into buckets of at most `bucket_bytes`
    bytes, a larger tensor a bucket of its own; each bucket lists the encodings when the tensors
    carry them."""
    buckets: list[WireBucket] = []
    group: list[WireTensor] = []
    size = 0

    def close() -> None:
        if group:
            encodings = [t.encoding for t in group] if group[0].encoding is not None else None
            buckets.append(WireBucket(src, len(buckets), [t.name for t in group],
                                      [t.dtype_name for t in group],
                                      [t.shape for t in group], encodings=encodings))

    for tensor in tensors:
        if group and size + tensor.nbytes > bucket_bytes:
            close()
            group, size = [], 0
        group.append(tensor)
        size += tensor.nbytes
    close()
    return buckets


def parse_buckets(buckets: Any, where: str, allow_empty: bool = False) -> list[WireBucket]:
    """`buckets` (a JSON list of bucket objects) as WireBuckets; ValueError naming `where` and
    the bucket. Empty only when `allow_empty` (a sparse push in which nothing changed)."""
    expect_type(buckets, list, f"{where}: buckets")
    if not buckets and not allow_empty:
        raise ValueError(f"{where}: buckets is empty")
    parsed = []
    for index, bucket in enumerate(buckets):
        if isinstance(bucket, WireBucket):
            parsed.append(bucket)
            continue
        if not isinstance(bucket, dict):
            raise ValueError(f"{where}: bucket {index} is {type(bucket).__name__}, not an object")
        try:
            parsed.append(WireBucket(**bucket))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bucket {index}: {exc}") from None
    return parsed


def expect_type(value: Any, kind: type | tuple[type, ...], name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise ValueError(f"{name} {value!r} is not of type {' or '.join(k.__name__ for k in kinds)}")


@dataclass(frozen=True)
class Session:
    """One member's handle on one push session (module docstring): the store, the session's
    prefix, the member's index, the trainer ranks W and the engine's workers n (None while not
    known), and the timeout of every wait."""

    store: dist.Store
    prefix: str
    member: int
    trainers: int
    timeout_s: float
    workers: int | None = None

    @property
    def size(self) -> int:
        """W + n: the group's members."""
        if self.workers is None:
            raise RuntimeError("the session's worker count is not known yet")
        return self.trainers + self.workers

    def key(self, name: str) -> str:
        return self.prefix + name

    def who(self, member: int | None = None) -> str:
        """A member in words: "trainer rank r" or "engine worker k"."""
        member = self.member if member is None else member
        return (f"trainer rank {member}" if member < self.trainers
                else f"engine worker {member - self.trainers}")

    def put(self, name: str, value: str) -> None:
        self.store.set(self.key(name), value)

    def has(self, name: str) -> bool:
        return self.store.check([self.key(name)])

    def read(self, name: str) -> str:
        return self.store.get(self.key(name)).decode()

    # -- failures -------------------------------------------------------------------------------

    def fail(self, problem: str) -> None:
        """Record this member's error and abort the session: every member's waits end."""
        self.put(f"failed/{self.member}", problem)
        self.put("abort", str(self.member))

    def aborted(self) -> bool:
        return self.has("abort")

    def failures(self) -> list[str]:
        """Every member's recorded error, members in order (the trainer ranks, then the workers
        when their count is known)."""
        members = self.trainers + (self.workers or 0)
        return [self.read(f"failed/{m}") for m in range(members) if self.has(f"failed/{m}")]

    def abort_reason(self) -> str:
        return "; ".join(self.failures()) or "the push was aborted"

    # -- waiting --------------------------------------------------------------------------------

    def wait_key(self, name: str, what: str, *, abortable: bool = True) -> str:
        """The value of the session's key `name` once some member set it; PushAborted (the
        failing members' errors) when the session aborts first (`abortable`), TimeoutError after
        `timeout_s`."""
        return self.wait_store_key(self.key(name), what, abortable=abortable)

    def wait_store_key(self, key: str, what: str, *, abortable: bool = True) -> str:
        """`wait_key` for a key of the store outside the session's prefix."""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if abortable and self.aborted():
                raise PushAborted(self.abort_reason())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.who()}: {what} did not happen within "
                                   f"{self.timeout_s:g} s (publish.engine_timeout_s)")
            time.sleep(POLL_S)
        return self.store.get(key).decode()

    def wait_all(self, names: Iterable[str], what: str, *, abortable: bool = True
                 ) -> list[str]:
        """The values of every key of `names`, as `wait_key` waits for each."""
        return [self.wait_key(name, what, abortable=abortable) for name in names]

    # -- the group ------------------------------------------------------------------------------

    def form_group(self, attempt: int) -> dist.ProcessGroupGloo:
        """Join attempt `attempt` of the session's gloo group as `member`, then wait for every
        member's `joined` mark: the group when every member built it, else GroupNotFormed with
        every failing member's error (this member's group dropped). PushAborted when the
        session aborts meanwhile. Building the group waits for every member's address (gloo's
        full mesh) up to `timeout_s`."""
        group, mark = None, "ok"
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(self.key(f"try{attempt}/gloo"),
                                                           self.store),
                                          self.member, self.size,
                                          timedelta(seconds=self.timeout_s))
        except Exception as exc:  # gloo raises RuntimeError subclasses of several kinds
            mark = f"{self.who()}: {' '.join(str(exc).split())[:500]}"
        self.put(f"try{attempt}/joined/{self.member}", mark)
        marks = self.wait_all((f"try{attempt}/joined/{m}" for m in range(self.size)),
                              "every member's mark on the push group")
        problems = [m for m in marks if m != "ok"]
        if problems:
            del group
            raise GroupNotFormed(attempt, problems)
        return group


class WorkWatch:
    """Runs a member's gloo sends and receives on `group` under the session's `abort` (module
    docstring): `run(work)` waits for one (raising PushAborted when the session aborted),
    `post(work)` keeps one pending to wait on later, and a thread ends every pending one once
    `abort` appears, through the watch's sentinel receive. `close()` stops the thread and ends
    what is still pending (the buffers they hold are released with them); a work posted after it
    ends at once. Only the thread that posted a work waits on it. Use as a context manager."""

    def __init__(self, session: Session, group: dist.ProcessGroupGloo):
        self.session = session
        peer = (group.rank() + 1) % group.size()
        self._sentinel = group.recv([torch.empty(1, dtype=torch.uint8)], peer, _SENTINEL_TAG)
        self._pending: set[Any] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ended = False
        self.aborted = False
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="vlmcp-push-watch")
        self._thread.start()

    def __enter__(self) -> WorkWatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def post(self, work: Any) -> Any:
        """Keep `work` (a gloo send or receive) pending under the watch; returns it."""
        with self._lock:
            self._pending.add(work)
            end = self.aborted or self._closed.is_set()
        if end:
            self._end()
        return work

    def run(self, work: Any, what: str) -> None:
        """Wait for `work` (posted or not): PushAborted when the session aborted meanwhile, else
        RuntimeError naming `what` when it failed."""
        self.post(work)
        try:
            work.wait()
        except Exception as exc:
            if self.aborted:
                raise PushAborted(self.session.abort_reason()) from None
            raise RuntimeError(f"{what}: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            with self._lock:
                self._pending.discard(work)

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                aborted = self.session.aborted()
            except Exception:  # the store went away with rank 0: the waits' own timeouts end them
                return
            if aborted:
                with self._lock:
                    self.aborted = True
                self._end()
                return

    def _end(self) -> None:
        """End every pending gloo operation of the member (once): the sentinel's timed wait."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        try:
            self._sentinel.wait(_CANCEL)
        except Exception:  # the point: the timeout closes the member's pairs
            pass

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            pending = bool(self._pending)
        if pending:
            self._end()
        with self._lock:
            self._pending.clear()


def send_buckets(watch: WorkWatch, group: dist.ProcessGroupGloo, buckets: list[WireBucket],
                 share: dict[str, torch.Tensor], destinations: Iterable[int],
                 on_sent: Callable[[WireBucket], None] | None = None) -> None:
    """A trainer rank's sends: each bucket packed from `share` once and sent to every member of
    `destinations` (the workers' member indices), one at a time, under `watch`."""
    destinations = list(destinations)
    scratch = torch.empty(max((b.size for b in buckets), default=0), dtype=torch.uint8)
    for index, bucket in enumerate(buckets):
        buffer = bucket.pack(share, scratch)
        for dst in destinations:
            watch.run(group.send([buffer], dst, bucket.tag),
                      f"{watch.session.who()}: sending {bucket.describe(index)} to "
                      f"{watch.session.who(dst)}")
        if on_sent is not None:
            on_sent(bucket)


def settle_sessions(store: dist.Store, prefixes: list[str], trainers: int) -> list[str]:
    """Delete every key of each session of `prefixes` that every trainer rank has left (its
    `left/<r>` marks), on the store's host (rank 0); returns the prefixes still open."""
    keys = None
    still = []
    for prefix in prefixes:
        if not store.check([f"{prefix}left/{r}" for r in range(trainers)]):
            still.append(prefix)
            continue
        keys = store.list_keys() if keys is None else keys
        for key in keys:
            if key.startswith(prefix):
                store.delete_key(key)
    return still


def check_sources(buckets: list[WireBucket], trainers: int) -> None:
    """ValueError naming the bucket whose src is not a trainer rank (0..trainers-1)."""
    for index, bucket in enumerate(buckets):
        if bucket.src >= trainers:
            raise ValueError(f"{bucket.describe(index)}: src {bucket.src} is not a trainer "
                             f"rank (0..{trainers - 1})")


class StagedReceive:
    """A staged update's receives: a thread that posts one receive per bucket at once and waits
    for them in list order, into host buffers, while the engine serves on (`member`: the worker,
    for errors). Its own failure is recorded in the session (the trainer ranks stop sending); an
    aborted session, or `stop`, cancels what is still pending; either way every buffer is
    dropped, so that a failed push leaves no copy behind (`held_bytes` 0)."""

    def __init__(self, session: Session, group: dist.ProcessGroupGloo, buckets: list[WireBucket],
                 member: str):
        check_sources(buckets, session.trainers)
        self._session, self._group, self._buckets, self._member = session, group, buckets, member
        self._watch = WorkWatch(session, group)
        self._stopping = False
        #: (index, bucket, buffer, receive) of every bucket, while the thread waits for them.
        self._posted: list[tuple[int, WireBucket, torch.Tensor, Any]] = []
        self._arrived: list[tuple[int, WireBucket, torch.Tensor]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, daemon=True,
                                        name="vlmcp-gloo-staging")
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers it still holds (posted or arrived)."""
        return sum(entry[1].size for entry in (self._posted or self._arrived))

    def _receive(self) -> None:
        try:
            for index, bucket in enumerate(self._buckets):
                buffer = torch.empty(bucket.size, dtype=torch.uint8)
                self._posted.append((index, bucket, buffer, self._watch.post(
                    self._group.recv([buffer], bucket.src, bucket.tag))))
            for index, bucket, _, work in self._posted:
                self._watch.run(work, f"{bucket.describe(index)}: receiving from trainer rank "
                                      f"{bucket.src} ({self._member})")
            self._arrived = [entry[:3] for entry in self._posted]
        except BaseException as exc:  # handed to the update that waits for it
            self._error = exc
            if not (isinstance(exc, PushAborted) or self._watch.aborted or self._stopping):
                worker = self._session.member - self._session.trainers
                try:
                    self._session.fail(f"engine worker {worker}: staging the update failed: "
                                       f"{exc}")
                except Exception:  # the store is gone with rank 0: nobody waits for the mark
                    pass
        finally:
            self._posted = []
            self._watch.close()

    def result(self, timeout_s: float) -> list[tuple[int, WireBucket, torch.Tensor]]:
        """Every bucket, once received (its error, raised here, when a receive failed); the
        buffers pass to the caller."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.stop()
            raise TimeoutError(f"the {len(self._buckets)} staged buckets did not all arrive "
                               f"within {timeout_s:g} s")
        if self._error is not None:
            if isinstance(self._error, PushAborted):
                raise self._error
            raise RuntimeError(f"staging the update failed: {self._error}") from self._error
        arrived, self._arrived = self._arrived, []
        return arrived

    def stop(self) -> None:
        """Cancel the receives still pending and drop the buffers (returns once the thread
        has ended, within a poll)."""
        self._stopping = True
        self._watch.close()
        self._thread.join()
        self._arrived = []


def streamed_arrivals(watch: WorkWatch, group: dist.ProcessGroupGloo, buckets: list[WireBucket],
                      member: str) -> Iterator[tuple[int, WireBucket, torch.Tensor]]:
    """A worker's receives of a streamed update: (index, bucket, its `[size]` uint8 buffer) in
    list order, as they arrive: one posted receive per src, that src's next posted once the
    consumer asks for the next bucket (`member`: this worker, for errors)."""
    check_sources(buckets, watch.session.trainers)
    queues: dict[int, deque[int]] = {}
    for index, bucket in enumerate(buckets):
        queues.setdefault(bucket.src, deque()).append(index)
    posted: dict[int, tuple[int, torch.Tensor, Any]] = {}

    def post(src: int) -> None:
        if queues[src]:
            index = queues[src].popleft()
            buffer = torch.empty(buckets[index].size, dtype=torch.uint8)
            posted[src] = (index, buffer, watch.post(group.recv([buffer], src,
                                                                buckets[index].tag)))

    for src in queues:
        post(src)
    for index, bucket in enumerate(buckets):
        posted_index, buffer, work = posted.pop(bucket.src)
        assert posted_index == index, (posted_index, index)
        watch.run(work, f"{bucket.describe(index)}: receiving from trainer rank {bucket.src} "
                        f"({member})")
        del work
        yield index, bucket, buffer
        del buffer
        post(bucket.src)


def worker_index(data_parallel_index: int, workers_per_replica: int, rank: int) -> int:
    """An engine worker's index among all the engine's workers: its replica's index times the
    workers of a replica (tensor x pipeline parallel), plus its rank in the replica, as vLLM's
    own NCCL weight transfer numbers them; the engine takes data-parallel replicas x workers
    per replica members in the group (`/get_world_size?include_dp=true`)."""
    return data_parallel_index * workers_per_replica + rank


def worker_session(master_address: str, master_port: int, prefix: str, member: int,
                   trainers: int, size: int, timeout_s: float) -> Session:
    """An engine worker's handle on a session: a client of the trainer's store at
    `master_address`:`master_port` (RuntimeError naming it when unreachable)."""
    try:
        store = dist.TCPStore(master_address, master_port, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError kinds
        raise RuntimeError(f"vlmcp_gloo: cannot reach the trainer's TCPStore at "
                           f"{master_address}:{master_port}: {exc}") from exc
    return Session(store, prefix, member, trainers, timeout_s, size - trainers)


def join_as_worker(session: Session, attempt: int) -> dist.ProcessGroupGloo:
    """An engine worker's part of attempt `attempt` at the session's group: its ready mark, then
    `Session.form_group` (RuntimeError naming the session when the attempt failed anywhere)."""
    worker = session.member - session.trainers
    session.put(f"try{attempt}/ready/{worker}", "1")
    try:
        return session.form_group(attempt)
    except (GroupNotFormed, PushAborted, TimeoutError) as exc:
        raise RuntimeError(f"vlmcp_gloo: joining the push group {session.prefix!r} as member "
                           f"{session.member} of {session.size} failed: {exc}") from exc
