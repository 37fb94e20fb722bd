"""Runs inside vLLM's worker: the engine side of vlmcp's weight push over gloo (backend "vlmcp_gloo").

Why it exists: vLLM 0.32 has a weight-transfer protocol for RL trainers (server routes
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`; engines in `vllm/distributed/weight_transfer/`), but every built-in
backend (`nccl`, `ipc`, `sparse_nccl`, `sharded_rdt`, `nccl_m2n`) needs CUDA. This one moves the
bytes over a gloo process group, so a trainer can push its weights into a vLLM running on CPUs
(or anywhere TCP reaches) without writing a checkpoint.

The session, its keys, the group's formation (retried by the trainer) and the aborts are those of
vlmcp/engine/push_wire.py, which the trainer follows too: per push and per engine, a fresh gloo
group over a TCPStore that trainer rank 0 hosts. Trainer ranks 0..W-1 keep their rank; this
engine's workers are members W..W+n-1 (worker k = `rank_offset` + k, k its rank inside the
engine: `data_parallel_index * world_size + rank` of its parallel config, as vLLM's NCCL backend
counts; 0 for the uni executor). `init_info`:

    {"protocol": 2, "master_address": str, "master_port": int,
     "store_prefix": the session's prefix P, "rank_offset": int (W), "world_size": int (W + n),
     "timeout_s": float, "attempt": int (k: marks P try<k>/ready/<worker>, joins the group under
     P try<k>/gloo, writes its `joined` mark and waits for every member's),
     "buckets": [B0, B1, ...] (staged updates only)}

or, to ask which dtype the engine holds each tensor in (the trainer's publish.push_dtype),
`{"protocol", "master_address", "master_port", "store_prefix", "rank_offset", "world_size",
"timeout_s", "describe": [checkpoint names], "describe_key": K}`: worker 0 puts
`{name: dtype}` under K (`held_dtypes`) and nobody joins a group. Each bucket:

    {"src": trainer rank, "tag": int, "names": [HF checkpoint names], "dtype_names": ["bfloat16", ...],
     "shapes": [[...], ...], "bytes": the buffer's size (optional; checked when given)}

for which trainer rank `src` sends ONE contiguous `torch.uint8` tensor of sum(numel * itemsize)
bytes (the tensors' bytes concatenated in `names` order) with `group.send([buf], dst=worker,
tag=tag)` to every worker of the engine.

One update, streamed: `/start_weight_update` begins vLLM's layerwise reload; `/update_weights`
with `{"update_info": {"buckets": [B0, B1, ...]}}`. Buckets of one src are listed in the order
that src sends them; different srcs interleave. The worker keeps one posted receive per src,
waits for the buckets in list order, slices each buffer back into tensors and hands them to
`model.load_weights`, then posts that src's next receive. `/finish_weight_update` finalises the
layerwise reload and, on a CPU, prepacks the experts of the MoE layers it reloaded again
(`vllm_worker`: vLLM's reload leaves the CPU experts in the loader's plain layout; a layer it did
not reload still holds packed weights, which a second packing would scramble).

One update, staged (the engine's downtime is the load alone, not the transfer): `init_info` lists
the buckets. Once in the group, the worker posts a receive for every bucket at once, into host
buffers, on a thread of its own, while the engine goes on serving its current weights (all of
them at once: a src whose send failed then holds up no other src's sends); the trainer sends
them right after joining. Then `/pause`, `/start_weight_update`, and `/update_weights` with
`{"update_info": {"staged": true}}` waits for that thread and loads the buffers in list order;
the rest as above. It costs the engine one more copy of the pushed bytes in host memory, until the
update ends or the push fails: an aborted session, a newer `init`, or `/shutdown_weight_transfer_engine`
cancels the receives still pending and drops every buffer, so at most one staged copy exists.

A failed update (a bad bucket list, a receive that fails or times out, a name the model does not
have) is one error naming the bucket, its src and the peer, recorded in the session (the trainer
ranks stop sending at once); the group is dropped (its stream is out of step: init again) and the
layerwise reload is finalised at once, so that the engine serves on (layers the update had fully
loaded hold the new weights, the others the old ones), since vLLM ends the update session on that
error and accepts no `/finish_weight_update` after it. A session that another member aborted ends
this worker's receives within a poll (push_wire.WorkWatch).

Loaded by vLLM only (`vllm_plugin.register` names it lazily); vlmcp's own environment never
imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vlmcp.engine.push_wire import (DENSE_MODE, PROTOCOL, SPARSE_MODE, PushAborted, Session,
                                    StagedReceive, WireBucket, WorkWatch, expect_type,
                                    join_as_worker, parse_buckets, streamed_arrivals,
                                    worker_index, worker_session)
from vlmcp.engine.vllm_held import HeldWeights, LoadRecorder
from vlmcp.engine.vllm_worker import cpu_moe_experts

#: Under vLLM's logger, whose handler prints it in the server's log.
logger = logging.getLogger("vllm.vlmcp_gloo")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCPStore is, the session, and where this engine's workers sit in its
    group (see the module docstring)."""

    protocol: int
    master_address: str
    master_port: int
    store_prefix: str
    rank_offset: int
    world_size: int
    timeout_s: float
    attempt: int = 0
    #: A staged update's buckets (received right after joining), None: updates stream.
    buckets: list[WireBucket] | None = None
    #: A describe request's checkpoint names (no group), and the key its answer goes under.
    describe: list[str] | None = None
    describe_key: str | None = None
    #: "dense" (vLLM's layerwise reload of every bucket) or "sparse" (patches in place).
    mode: str = DENSE_MODE
    #: The version this push leaves the engine at once finished, and (sparse) the one it must
    #: hold before: a push token of the trainer (push_wire.push_token).
    token: str | None = None
    base: str | None = None
    #: Keep the placements and held tensors (sparse pushes, the delivery check) and report
    #: them after the update (P report/<worker>), with checksums when `verify`.
    hold: bool = False
    verify: bool = False

    def __post_init__(self) -> None:
        if self.protocol != PROTOCOL:
            raise ValueError(f"init_info: protocol {self.protocol!r}, but this engine's vlmcp_gloo "
                             f"speaks {PROTOCOL}: install the trainer's vlmcp in the engine venv")
        if self.buckets is not None:
            self.buckets = parse_buckets(self.buckets, "init_info",
                                         allow_empty=self.mode == SPARSE_MODE)
        expect_type(self.master_address, str, "master_address")
        expect_type(self.store_prefix, str, "store_prefix")
        for name in ("master_port", "rank_offset", "world_size", "attempt"):
            expect_type(getattr(self, name), int, name)
        expect_type(self.timeout_s, (int, float), "timeout_s")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"init_info: master_port {self.master_port} is not a TCP port")
        if self.rank_offset < 1:
            raise ValueError(f"init_info: rank_offset {self.rank_offset} leaves no trainer rank "
                             "(the trainer ranks are 0..rank_offset-1)")
        if self.world_size <= self.rank_offset:
            raise ValueError(f"init_info: world_size {self.world_size} leaves no worker rank "
                             f"after rank_offset {self.rank_offset}")
        if not self.timeout_s > 0:
            raise ValueError(f"init_info: timeout_s {self.timeout_s} is not positive")
        if (self.describe is None) != (self.describe_key is None):
            raise ValueError("init_info: describe and describe_key come together")
        if self.describe is not None:
            expect_type(self.describe, list, "describe")
            expect_type(self.describe_key, str, "describe_key")
        if self.mode not in (DENSE_MODE, SPARSE_MODE):
            raise ValueError(f"init_info: mode {self.mode!r} is not {DENSE_MODE!r} or "
                             f"{SPARSE_MODE!r}")
        for name in ("hold", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"init_info: {name} {getattr(self, name)!r} is not true or false")
        if self.mode == SPARSE_MODE and not (self.hold and self.base and self.token):
            raise ValueError("init_info: a sparse push needs hold, its base and its token")
        if self.buckets is not None and self.mode == DENSE_MODE and any(
                b.sparse for b in self.buckets):
            raise ValueError("init_info: a dense push's buckets list encodings")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: the buckets in the order the worker waits for them (streamed), or `staged`:
    those of init_info, already received or under way."""

    buckets: list[WireBucket] | None = None
    staged: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.staged, bool):
            raise ValueError(f"update_info: staged {self.staged!r} is not true or false")
        if self.staged:
            if self.buckets is not None:
                raise ValueError("update_info: a staged update lists no buckets (init_info "
                                 "did)")
            return
        if self.buckets is None:
            raise ValueError("update_info: no buckets (and not staged)")
        self.buckets = parse_buckets(self.buckets, "update_info", allow_empty=True)


def held_dtypes(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """{checkpoint name: the dtype of the vLLM parameter it loads into} for each of `names`
    whose parameter is found: through the model's own name mapping (`hf_to_vllm_mapper`), and
    for a tensor vLLM stacks into a fused one (`packed_modules_mapping`: q, k and v into qkv) the
    fused parameter. A name not found is left out (the trainer then sends it in
    publish.push_dtype); a parameter kept in another dtype than the model's that no name reaches
    is logged."""
    params = dict(model.named_parameters())
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    found: dict[str, str] = {}
    reached = set()
    for name in names:
        mapped = mapper.map_name(name) if mapper is not None else name
        if mapped is None:
            continue
        candidates = [mapped] + [mapped.replace(f".{part}.", f".{fused}.")
                                 for fused, parts in packed.items() for part in parts
                                 if f".{part}." in mapped]
        target = next((c for c in candidates if c in params), None)
        if target is not None:
            found[name] = str(params[target].dtype).removeprefix("torch.")
            reached.add(target)
    dtypes = {p.dtype for p in params.values()}
    main = max(dtypes, key=lambda d: sum(p.numel() for p in params.values() if p.dtype == d))
    missed = sorted(n for n, p in params.items() if p.dtype != main and n not in reached)
    if missed:
        logger.warning("vlmcp_gloo: %d parameters held in another dtype than %s are reached by "
                       "no pushed name (a publish.push_dtype push may round them): %s",
                       len(missed), main, ", ".join(missed[:8]))
    return found


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's worker side of the gloo push (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self.session: Session | None = None
        self.init_info: GlooInitInfo | None = None
        self.held = HeldWeights(model)
        self._reloading = False
        self._recorder: LoadRecorder | None = None
        self._watch: Any = None
        self._touched: set[torch.nn.Module] = set()
        self._staging: StagedReceive | None = None
        self._report: threading.Thread | None = None

    # -- the group --------------------------------------------------------------------------

    def worker_rank(self) -> int:
        """This worker's index among the engine's workers, over every data-parallel replica
        (push_wire.worker_index); 0 for the uni executor."""
        parallel = self.parallel_config
        return worker_index(parallel.data_parallel_index, parallel.world_size, parallel.rank)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join attempt `init_info.attempt` of the push's group (replacing an earlier group and
        dropping what it staged), or answer a describe request. A sparse push whose base is not
        the version this worker holds is refused (recorded in the session)."""
        self.shutdown()
        self._finish_report()
        if getattr(self.parallel_config, "local_engines_only", False):
            raise ValueError("vlmcp_gloo: this server drives only its own data-parallel "
                             "replicas (external or hybrid load balancing), while the push "
                             "numbers the workers of every replica: push into a server that "
                             "drives all of them (vLLM's internal load balancing)")
        worker = self.worker_rank()
        member = init_info.rank_offset + worker
        if member >= init_info.world_size:
            raise ValueError(f"init_info: this worker is member {member} (rank_offset "
                             f"{init_info.rank_offset} + worker {worker}), beyond world_size "
                             f"{init_info.world_size}")
        session = worker_session(init_info.master_address, init_info.master_port,
                                 init_info.store_prefix, member, init_info.rank_offset,
                                 init_info.world_size, init_info.timeout_s)
        if init_info.describe is not None:
            if worker == 0:
                session.store.set(init_info.describe_key,
                                  json.dumps(held_dtypes(self.model, init_info.describe)))
            return
        self.held.keep = init_info.hold
        if not init_info.hold:
            self.held.forget()
        refusal = self.held.holds(init_info.base) if init_info.mode == SPARSE_MODE else None
        if refusal is not None:
            problem = (f"engine worker {worker} {refusal}: it cannot take a patch against "
                       f"{init_info.base} (restarted, or a push failed since)")
            session.fail(problem)
            raise ValueError(f"vlmcp_gloo: {problem}")
        group = join_as_worker(session, init_info.attempt)
        self.group, self.session, self.init_info = group, session, init_info
        logger.info("vlmcp_gloo: joined push group %r (attempt %d, %s) at %s:%d as member %d of "
                    "%d", init_info.store_prefix, init_info.attempt + 1, init_info.mode,
                    init_info.master_address, init_info.master_port, member,
                    init_info.world_size)
        if init_info.buckets is not None:
            self._staging = StagedReceive(session, group, init_info.buckets, self._member())

    def shutdown(self) -> None:
        """Drop the push group and a staged update's receives and buffers (the model and the
        engine stay; a checksum report under way completes)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.stop()
        self.group = self.session = self.init_info = None

    def _member(self) -> str:
        return f"member {self.session.member} of push group {self.init_info.store_prefix!r}"

    # -- one update -------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """Begin an update: a dense push begins vLLM's layerwise reload (the layers' weights are
        buffered until complete), recorded when the push holds (vllm_held); a sparse one patches
        in place. Either way the engine holds no complete pushed version until it finished."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.init_info is None:
            raise RuntimeError("no push group: POST /init_weight_transfer_engine first")
        self._finish_report()
        self.held.applied = None
        self._touched = set()
        self.held.recent.clear()
        if self.init_info.mode == SPARSE_MODE:
            return
        initialize_layerwise_reload(self.model)
        self._reloading = True
        self._watch = self.held.watching()
        self._watch.__enter__()
        self._recorder = LoadRecorder() if self.init_info.hold else None

    def finish_weight_update(self) -> None:
        """Finalise the update: a dense one ends the layerwise reload and on a CPU prepacks the
        MoE experts again, a sparse one processes the layers it patched again; then the engine
        holds this push's version and, holding, reports where each tensor lies (with
        checksums when verifying) under the session's `report/<worker>`."""
        if self.init_info is not None and self.init_info.mode == SPARSE_MODE:
            self.held.reprocess(self._touched)
        else:
            self._end_reload()
        info = self.init_info
        if info is None:
            return
        self.held.seal(info.token)
        if info.hold:
            self._report = threading.Thread(target=self._put_report, args=(info,), daemon=True,
                                            name="vlmcp-push-report")
            self._report.start()

    def _put_report(self, info: GlooInitInfo) -> None:
        """Put this worker's placements (and checksums) under the session's report key (its
        own store client: the thread runs on while the engine serves)."""
        worker = self.worker_rank()
        try:
            report = {"worker": worker, "replica": self.parallel_config.data_parallel_index,
                      "token": info.token, "names": self.held.checksums(info.verify)}
            text = json.dumps(report)
        except Exception as exc:  # the trainer waits for the report: tell it why there is none
            text = json.dumps({"worker": worker, "error": f"{type(exc).__name__}: {exc}"})
        try:
            session = worker_session(info.master_address, info.master_port, info.store_prefix,
                                     info.rank_offset + worker, info.rank_offset,
                                     info.world_size, info.timeout_s)
            session.put(f"report/{worker}", text)
        except Exception as exc:  # the trainer is gone: nobody waits for the report
            logger.warning("vlmcp_gloo: could not report the push's checksums: %s", exc)

    def _finish_report(self) -> None:
        """Wait for a report under way (it reads the weights: no update may start meanwhile)."""
        report, self._report = self._report, None
        if report is not None:
            report.join()

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        recorder, self._recorder = self._recorder, None
        watch, self._watch = self._watch, None
        if not self._reloading:
            return
        self._reloading = False
        with recorder if recorder is not None else contextlib.nullcontext():
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                if watch is not None:
                    watch.__exit__(None, None, None)
            repacked = 0
            if self.device.type == "cpu":
                for module, experts in cpu_moe_experts(self.model):
                    if module in self.held.recent:
                        self.held.process(module, experts.process_weights_after_loading)
                        repacked += 1
        if repacked:
            logger.info("vlmcp_gloo: repacked the CPU experts of %d MoE layers", repacked)
        if recorder is not None:
            self.held.resolve(recorder.landed())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one update. Unlike the base class, no `torch.accelerator.synchronize()`
        on a CPU (it raises there: no accelerator); on any failure this worker's own error is
        recorded in the session, the group is dropped and the layerwise reload finalised (see
        the module docstring), then the error raised."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as exc:
            session = self.session
            if session is not None and not isinstance(exc, PushAborted):
                session.fail(f"engine worker {self.worker_rank()}: update failed: {exc}")
            self.shutdown()
            if self._reloading:
                try:
                    self._end_reload()
                except Exception as end:  # the first error is the one to report
                    logger.warning("vlmcp_gloo: finalising the reload after a failed update "
                                   "failed too: %s", end)
            if isinstance(exc, Exception):
                raise RuntimeError(f"vlmcp_gloo: update failed: {exc} (the push group is "
                                   "dropped: init it again)") from exc
            raise
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Load one update: streamed (each bucket loaded as it arrives), or the staged buffers
        once the staging thread has them all."""
        if self.group is None or self.init_info is None:
            raise RuntimeError("no push group: POST /init_weight_transfer_engine first")
        if not update_info.staged and not update_info.buckets \
                and self.init_info.mode == DENSE_MODE:
            raise ValueError("update_info: a dense push lists no buckets")
        if update_info.staged:
            if self._staging is None:
                raise RuntimeError("a staged update, but init_info listed no buckets")
            staging, self._staging = self._staging, None
            self._load(staging.result(self.init_info.timeout_s))
        else:
            with WorkWatch(self.session, self.group) as watch:
                self._load(streamed_arrivals(watch, self.group, update_info.buckets,
                                             self._member()))

    def _load(self, arrived: Iterator[tuple[int, WireBucket, torch.Tensor]]) -> None:
        """Hand each arrived bucket's tensors to vLLM's loader (dense), or its patches to the
        held weights (sparse), in order."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        sparse = self.init_info.mode == SPARSE_MODE
        with disable_mtp_completeness_check():
            for index, bucket, buffer in arrived:
                try:
                    if sparse:
                        self._touched |= self.held.apply(bucket.patches(buffer))
                    else:
                        pairs = bucket.tensors(buffer)
                        if self._recorder is not None:
                            self._recorder.add_sources(pairs)
                            with self._recorder:
                                self.model.load_weights(pairs)
                        else:
                            self.model.load_weights(pairs)
                        del pairs
                except Exception as exc:
                    raise RuntimeError(f"{bucket.describe(index)}: loading it into the model "
                                       f"failed: {type(exc).__name__}: {exc}") from exc
                del buffer
