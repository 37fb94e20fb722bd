"""A stand-in engine for the weight push's tests: vLLM's HTTP routes without vLLM, and workers that
follow vlmcp/engine/push_wire.py exactly as vLLM's workers do under vlmcp_gloo.

`FakePushEngine(workers=n)` is a `FakeVllm` server whose weight-transfer routes drive `n` worker
threads of the test's own process, each a real member of the push's gloo group: it joins each
attempt (`push_wire.join_as_worker`), receives a staged update into host buffers as it arrives
(`push_wire.StagedReceive`) or a streamed one during `/update_weights`
(`push_wire.streamed_arrivals`), and keeps every tensor it "loads": `weights[k]` {name: tensor}.
A describe request gets `held` ({name: dtype name}) as the engine's table. Faults it can play:
`fail_attempts` {attempt: worker}: that worker joins attempt k's group, then marks it failed (as
a connection closed while the full mesh forms would, the others having built theirs); `fail_load`: loading that tensor raises,
recorded in the session as vlmcp_gloo records its own failures.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.fake_vllm import FakeVllm
from vlmcp.engine.push_wire import (PushAborted, StagedReceive, WorkWatch, join_as_worker,
                                    parse_buckets, streamed_arrivals, worker_session)


class _Worker:
    """One engine worker's state between the routes."""

    def __init__(self, index: int):
        self.index = index
        self.session = self.group = self.staging = None
        self.loaded: dict[str, torch.Tensor] = {}


class FakePushEngine:
    """See the module docstring. Use as a context manager."""

    def __init__(self, workers: int = 1, held: dict[str, str] | None = None,
                 fail_attempts: dict[int, int] | None = None, fail_load: str | None = None):
        self.held, self.fail_attempts, self.fail_load = held or {}, fail_attempts or {}, fail_load
        self.workers = [_Worker(k) for k in range(workers)]
        self.fake = FakeVllm({"/get_world_size": (200, {"world_size": workers}),
                              "/init_weight_transfer_engine": self._init,
                              "/update_weights": self._update,
                              "/shutdown_weight_transfer_engine": self._shutdown})
        self._pool = ThreadPoolExecutor(max_workers=max(workers, 1))
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
            if "buckets" in info:
                worker.staging = StagedReceive(session, worker.group,
                                               parse_buckets(info["buckets"], "init_info"),
                                               f"fake worker {worker.index}")
                self.stagings.append(worker.staging)

        return self._all(join)

    def _update(self, body: dict) -> tuple[int, Any]:
        info = body["update_info"]

        def load(worker: _Worker) -> None:
            try:
                if info.get("staged"):
                    staging, worker.staging = worker.staging, None
                    arrived = staging.result(worker.session.timeout_s)
                    self._keep(worker, arrived)
                else:
                    with WorkWatch(worker.session) as watch:
                        self._keep(worker, streamed_arrivals(
                            watch, worker.group, parse_buckets(info["buckets"], "update_info"),
                            f"fake worker {worker.index}"))
            except BaseException as exc:
                if not isinstance(exc, PushAborted):
                    worker.session.fail(f"engine worker {worker.index}: update failed: {exc}")
                self._drop(worker)
                raise

        return self._all(load)

    def _keep(self, worker: _Worker, arrived: Any) -> None:
        for _, bucket, buffer in arrived:
            for name, tensor in bucket.tensors(buffer):
                if name == self.fail_load:
                    raise RuntimeError(f"{name}: no such parameter (played)")
                worker.loaded[name] = tensor.clone()

    def _shutdown(self, body: Any) -> tuple[int, Any]:
        for worker in self.workers:
            self._drop(worker)
        return 200, {}

    @staticmethod
    def _drop(worker: _Worker) -> None:
        if worker.staging is not None:
            worker.staging.stop()
        worker.session = worker.group = worker.staging = None
