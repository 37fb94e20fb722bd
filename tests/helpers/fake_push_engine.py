"""A stand-in engine for the weight push's tests: vLLM's HTTP routes without vLLM, and workers that
follow vlmcp/engine/push_wire.py exactly as vLLM's workers do under vlmcp_gloo.

`FakePushEngine(replicas=d, tensor_parallel=t)` is a `FakeVllm` server whose weight-transfer
routes drive d x t worker threads of the test's own process, each a real member of the push's
gloo group at the index vLLM's workers take (`push_wire.worker_index`: replica x t + rank; the
server answers `/get_world_size` with d x t, vLLM's default include_dp=true): it joins each
attempt (`push_wire.join_as_worker`), receives a staged update into host buffers as it arrives
(`push_wire.StagedReceive`) or a streamed one during `/update_weights`
(`push_wire.streamed_arrivals`), and keeps what it "loads": `weights[k]` {name: tensor}. As vLLM's
loader does under tensor parallelism, worker rank r of a replica keeps rows r/t of a tensor whose
first dimension t divides, and every other tensor whole; floating tensors are held in
`engine_dtype` (None: as they arrive) but those `held` names ({name: dtype name}, also the answer
to a describe request). It keeps where each tensor lies (a `push_patch.Region` of the checkpoint
tensor), applies a sparse push's patches there, refuses a sparse push whose base is not the
version it holds, and reports after each update as vllm_held does (the session's
`report/<worker>`: placements, dtypes and, when verifying, checksums).

Faults it can play: `fail_attempts` {attempt: worker}: that worker joins attempt k's group, then
marks it failed (as a connection closed while the full mesh forms would, the others having built
theirs); `fail_load`: loading that tensor raises, recorded in the session as vlmcp_gloo records
its own failures (`fail_sparse`: only in a sparse push); `corrupt`: that tensor is held as zeros;
`drop`: that tensor is silently not loaded (its loader does not know it); `restart()`: every
worker forgets what it holds, as an engine restarted on its checkpoint (also `POST
/test/restart`, for a test's trainer ranks between pushes).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.fake_vllm import FakeVllm
from vlmcp.engine.push_patch import Patch, Region, digest
from vlmcp.engine.push_wire import (SPARSE_MODE, PushAborted, StagedReceive, WorkWatch,
                                    join_as_worker, parse_buckets, streamed_arrivals,
                                    worker_index, worker_session)


#: The route that restarts the stand-in (a test's ranks call it between pushes).
RESTART = "/test/restart"


class _Worker:
    """One engine worker's state between the routes."""

    def __init__(self, index: int, replica: int, rank: int):
        self.index, self.replica, self.rank = index, replica, rank
        self.session = self.group = self.staging = self.info = None
        self.loaded: dict[str, torch.Tensor] = {}
        self.places: dict[str, Region] = {}
        self.applied: str | None = None


class FakePushEngine:
    """See the module docstring. Use as a context manager."""

    def __init__(self, replicas: int = 1, tensor_parallel: int = 1,
                 held: dict[str, str] | None = None, engine_dtype: torch.dtype | None = None,
                 fail_attempts: dict[int, int] | None = None, fail_load: str | None = None,
                 fail_sparse: str | None = None, corrupt: str | None = None,
                 drop: str | None = None):
        self.held, self.fail_attempts, self.fail_load = held or {}, fail_attempts or {}, fail_load
        self.fail_sparse, self.corrupt, self.drop = fail_sparse, corrupt, drop
        self.engine_dtype, self.tensor_parallel = engine_dtype, tensor_parallel
        self.workers = [_Worker(worker_index(d, tensor_parallel, r), d, r)
                        for d in range(replicas) for r in range(tensor_parallel)]
        self.fake = FakeVllm({"/get_world_size": (200, {"world_size": len(self.workers)}),
                              "/init_weight_transfer_engine": self._init,
                              "/update_weights": self._update,
                              "/finish_weight_update": self._finish,
                              "/shutdown_weight_transfer_engine": self._shutdown,
                              RESTART: self._restart})
        self._pool = ThreadPoolExecutor(max_workers=max(len(self.workers), 1))
        self._lock = threading.Lock()
        #: Every staged receive a worker started, in order.
        self.stagings: list[StagedReceive] = []

    @property
    def url(self) -> str:
        return self.fake.url

    @property
    def weights(self) -> list[dict[str, torch.Tensor]]:
        return [w.loaded for w in self.workers]

    def staged_bytes(self) -> int:
        """Bytes every staged receive it ever started still holds, over the workers."""
        return sum(staging.held_bytes for staging in self.stagings)

    def restart(self) -> None:
        """Every worker forgets what it holds (a restarted engine)."""
        for worker in self.workers:
            worker.loaded, worker.places, worker.applied = {}, {}, None

    def _restart(self, body: Any) -> tuple[int, Any]:
        self.restart()
        return 200, {}

    def __enter__(self) -> FakePushEngine:
        self.fake.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shutdown(None)
        self.fake.__exit__(*exc)
        self._pool.shutdown(wait=False)

    def _all(self, step) -> tuple[int, Any]:
        """`step(worker)` on every worker at once (as vLLM's collective_rpc): 200, or 500 with
        the first error."""
        errors = [f.exception() for f in [self._pool.submit(step, w) for w in self.workers]]
        errors = [e for e in errors if e is not None]
        return (500, {"error": {"message": str(errors[0])}}) if errors else (200, {})

    def _init(self, body: dict) -> tuple[int, Any]:
        info = body["init_info"]

        def join(worker: _Worker) -> None:
            self._drop(worker)
            session = worker_session(info["master_address"], info["master_port"],
                                     info["store_prefix"], info["rank_offset"] + worker.index,
                                     info["rank_offset"], info["world_size"], info["timeout_s"])
            if "describe" in info:
                if worker.index == 0:
                    session.store.set(info["describe_key"], json.dumps(
                        {n: d for n, d in self.held.items() if n in info["describe"]}))
                return
            if info.get("mode") == SPARSE_MODE and worker.applied != info["base"]:
                session.fail(f"engine worker {worker.index} holds {worker.applied}, not the "
                             f"sparse push's base {info['base']}")
                raise RuntimeError("not the base")
            attempt = info["attempt"]
            if self.fail_attempts.get(attempt) == worker.index:  # joins, then says it failed
                session.put(f"try{attempt}/ready/{worker.index}", "1")
                group = dist.ProcessGroupGloo(
                    dist.PrefixStore(session.key(f"try{attempt}/gloo"), session.store),
                    session.member, session.size, timedelta(seconds=session.timeout_s))
                session.put(f"try{attempt}/joined/{session.member}",
                            f"engine worker {worker.index}: Connection closed by peer (played)")
                del group
                raise RuntimeError("played failure of the group's attempt")
            worker.group, worker.session = join_as_worker(session, attempt), session
            worker.info = info
            if "buckets" in info:
                worker.staging = StagedReceive(
                    session, worker.group, parse_buckets(info["buckets"], "init_info",
                                                         allow_empty=True),
                    f"fake worker {worker.index}")
                with self._lock:
                    self.stagings.append(worker.staging)

        return self._all(join)

    def _update(self, body: dict) -> tuple[int, Any]:
        info = body["update_info"]

        def load(worker: _Worker) -> None:
            worker.applied = None
            try:
                if info.get("staged"):
                    staging, worker.staging = worker.staging, None
                    arrived = staging.result(worker.session.timeout_s)
                    self._keep(worker, arrived)
                else:
                    with WorkWatch(worker.session, worker.group) as watch:
                        self._keep(worker, streamed_arrivals(
                            watch, worker.group, parse_buckets(info["buckets"], "update_info",
                                                               allow_empty=True),
                            f"fake worker {worker.index}"))
            except BaseException as exc:
                if not isinstance(exc, PushAborted):
                    worker.session.fail(f"engine worker {worker.index}: update failed: {exc}")
                self._drop(worker)
                raise

        return self._all(load)

    def _keep(self, worker: _Worker, arrived: Any) -> None:
        sparse = worker.info.get("mode") == SPARSE_MODE
        for _, bucket, buffer in arrived:
            for patch in bucket.patches(buffer):
                if patch.name in (self.fail_load, self.fail_sparse if sparse else None):
                    raise RuntimeError(f"{patch.name}: no such parameter (played)")
                if patch.name == self.drop:
                    continue
                if sparse:
                    self._patch(worker, patch)
                else:
                    self._place(worker, patch)

    def _place(self, worker: _Worker, patch: Patch) -> None:
        """A dense tensor as vLLM's loader would keep it on this worker (a row shard under
        tensor parallelism), in the engine's dtype."""
        tensor = patch.values.view(patch.shape)
        rows = patch.shape[0] // self.tensor_parallel if patch.shape else 0
        if self.tensor_parallel > 1 and rows and patch.shape[0] % self.tensor_parallel == 0:
            tensor = tensor.narrow(0, worker.rank * rows, rows)
        dtype = getattr(torch, self.held[patch.name]) if patch.name in self.held else \
            self.engine_dtype if self.engine_dtype is not None and tensor.is_floating_point() \
            else tensor.dtype
        worker.places[patch.name] = Region.of(tensor, patch.values.storage_offset())
        worker.loaded[patch.name] = (torch.zeros_like(tensor, dtype=dtype)
                                     if patch.name == self.corrupt else tensor.to(dtype).clone())

    def _patch(self, worker: _Worker, patch: Patch) -> None:
        """A sparse push's patch, applied where the tensor lies on this worker."""
        region, held = worker.places[patch.name], worker.loaded[patch.name]
        target = Region(0, region.sizes, tuple(held.stride()))
        if patch.dense:
            held.copy_(region.read(patch.values).to(held.dtype))
            return
        inside, multi = region.locate(patch.indices)
        held.view(-1)[target.positions(multi)] = patch.values[inside].to(held.dtype)

    def _finish(self, body: Any) -> tuple[int, Any]:
        def finish(worker: _Worker) -> None:
            info = worker.info
            if info is None:
                return
            worker.applied = info.get("token")
            if info.get("hold"):
                names = {name: [[worker.places[name].to_json(),
                                 str(tensor.dtype).removeprefix("torch."),
                                 digest(tensor) if info.get("verify") else None]]
                         for name, tensor in worker.loaded.items()}
                worker.session.put(f"report/{worker.index}", json.dumps(
                    {"worker": worker.index, "replica": worker.replica,
                     "token": info.get("token"), "names": names}))

        return self._all(finish)

    def _shutdown(self, body: Any) -> tuple[int, Any]:
        for worker in self.workers:
            self._drop(worker)
        return 200, {}

    @staticmethod
    def _drop(worker: _Worker) -> None:
        if worker.staging is not None:
            worker.staging.stop()
        worker.session = worker.group = worker.staging = worker.info = None
