"""Runs inside vLLM's worker: the engine side of vlmcp's weight push over gloo (backend "vlmcp_gloo").

Why it exists: vLLM 0.32 has a weight-transfer protocol for RL trainers (server routes
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`; engines in `vllm/distributed/weight_transfer/`), but every built-in
backend (`nccl`, `ipc`, `sparse_nccl`, `sharded_rdt`, `nccl_m2n`) needs CUDA. This one moves the
bytes over a gloo process group, so a trainer can push its weights into a vLLM running on CPUs
(or anywhere TCP reaches) without writing a checkpoint. The protocol, which the trainer side
follows too:

The group: per push and per engine, a fresh gloo group over a TCPStore that trainer rank 0
hosts. Trainer ranks 0..W-1 keep their rank; this engine's workers are ranks W..W+n-1 (worker k =
`rank_offset` + k, k its rank inside the engine: `data_parallel_index * world_size + rank` of its
parallel config, as vLLM's NCCL backend counts; 0 for the uni executor). A worker first marks
`{store_prefix}/ready/{k}` in the store (the trainer ranks join the group only once worker 0's
mark is there, so that an engine that never joins costs them no group timeout), then joins the
group under the store prefix `{store_prefix}/gloo`. `init_info`:

    {"master_address": str, "master_port": int, "store_prefix": str,
     "rank_offset": int (W), "world_size": int (W + n), "timeout_s": float}

One update, streamed: `/start_weight_update` begins vLLM's layerwise reload; `/update_weights`
with `{"update_info": {"buckets": [B0, B1, ...]}}`, each bucket

    {"src": trainer rank, "tag": int, "names": [HF checkpoint names], "dtype_names": ["bfloat16", ...],
     "shapes": [[...], ...], "bytes": the buffer's size (optional; checked when given)}

for which trainer rank `src` sends ONE contiguous `torch.uint8` tensor of sum(numel * itemsize)
bytes (the tensors' native bytes concatenated in `names` order) with `group.send([buf],
dst=worker_rank, tag=tag)` to every worker of the engine. Buckets of one src are listed in the
order that src sends them; different srcs interleave. The worker keeps one posted recv per src,
waits for the buckets in list order, slices each buffer back into tensors and hands them to
`model.load_weights`, then posts that src's next recv. `/finish_weight_update` finalises the
layerwise reload and, on a CPU, prepacks the experts of the MoE layers it reloaded again
(`vllm_worker`: vLLM's reload leaves the CPU experts in the loader's plain layout; a layer it did
not reload still holds packed weights, which a second packing would scramble).

One update, staged (the engine's downtime is the load alone, not the transfer): `init_info` also
lists the buckets (`"buckets": [B0, B1, ...]`, as above). Once in the group, the worker receives
them on a thread of its own into host buffers, one per bucket, while the engine goes on serving
its current weights; the trainer sends them right after joining. Then `/pause`,
`/start_weight_update`, and `/update_weights` with `{"update_info": {"staged": true}}` waits for
that thread and loads the buffers in list order; the rest as above. It costs the engine one more
copy of the pushed bytes in host memory, until the update ends. A failed or timed-out receive
fails that `/update_weights` (the engine was not paused for it by a trainer that saw its own send
fail).

A failed update (a bad bucket list, a receive that fails or times out, a name the model does not
have) is one error naming the bucket, its src and the peer; the group is dropped (its stream is out
of step: init again) and the layerwise reload is finalised at once, so that the engine serves on
(layers the update had fully loaded hold the new weights, the others the old ones), since vLLM
ends the update session on that error and accepts no `/finish_weight_update` after it.

Loaded by vLLM only (`vllm_plugin.register` names it lazily); vlmcp's own environment never
imports it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vlmcp.engine.vllm_worker import cpu_moe_experts, repack_cpu_moe_experts_of

#: Under vLLM's logger, whose handler prints it in the server's log.
logger = logging.getLogger("vllm.vlmcp_gloo")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCPStore is and where this engine's workers sit in the push group."""

    master_address: str
    master_port: int
    store_prefix: str
    rank_offset: int
    world_size: int
    timeout_s: float
    #: A staged update's buckets (received right after joining), None: updates stream.
    buckets: list[GlooBucket] | None = None

    def __post_init__(self) -> None:
        if self.buckets is not None:
            self.buckets = _parse_buckets(self.buckets, "init_info")
        _expect(self.master_address, str, "master_address")
        _expect(self.store_prefix, str, "store_prefix")
        for name in ("master_port", "rank_offset", "world_size"):
            _expect(getattr(self, name), int, name)
        _expect(self.timeout_s, (int, float), "timeout_s")
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


@dataclass
class GlooBucket:
    """One buffer a trainer rank sends: the tensors `names`, of `dtype_names` and `shapes`."""

    src: int
    tag: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bytes: int | None = None
    dtypes: list[torch.dtype] = field(init=False, repr=False)
    nbytes: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _expect(self.src, int, "src")
        _expect(self.tag, int, "tag")
        if self.src < 0:
            raise ValueError(f"src {self.src} is negative")
        for name in ("names", "dtype_names", "shapes"):
            _expect(getattr(self, name), list, name)
        if not self.names:
            raise ValueError("names is empty (a bucket holds at least one tensor)")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length "
                             f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})")
        self.dtypes, self.nbytes = [], []
        for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes):
            if not isinstance(name, str) or not name:
                raise ValueError(f"name {name!r} is not a non-empty string")
            dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: dtype {dtype_name!r} is not a torch dtype name")
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                raise ValueError(f"{name}: shape {shape!r} is not a list of sizes")
            numel = 1
            for size in shape:
                numel *= size
            self.dtypes.append(dtype)
            self.nbytes.append(numel * dtype.itemsize)
        if self.bytes is not None and self.bytes != sum(self.nbytes):
            raise ValueError(f"bytes {self.bytes!r} is not the {sum(self.nbytes)} bytes of its "
                             "tensors")

    @property
    def size(self) -> int:
        """The bytes of the buffer the trainer sends for this bucket."""
        return sum(self.nbytes)

    def describe(self, index: int) -> str:
        more = f" and {len(self.names) - 1} more" if len(self.names) > 1 else ""
        return (f"bucket {index} (src {self.src}, tag {self.tag}, {self.size} bytes: "
                f"{self.names[0]}{more})")

    def tensors(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors, sliced out of `buffer` (views; a tensor whose offset does not
        suit its dtype's alignment is copied first)."""
        pairs, offset = [], 0
        for name, dtype, shape, nbytes in zip(self.names, self.dtypes, self.shapes, self.nbytes):
            chunk = buffer[offset:offset + nbytes]
            if offset % dtype.itemsize:
                chunk = chunk.clone()
            pairs.append((name, chunk.view(dtype).view(shape)))
            offset += nbytes
        return pairs


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: the buckets in the order the worker waits for them (streamed), or `staged`:
    those of init_info, already received or under way."""

    buckets: list[GlooBucket] | None = None
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
        self.buckets = _parse_buckets(self.buckets, "update_info")


def _parse_buckets(buckets: Any, where: str) -> list[GlooBucket]:
    """`buckets` (a JSON list of bucket objects) as GlooBuckets; ValueError naming `where` and
    the bucket."""
    _expect(buckets, list, f"{where}: buckets")
    if not buckets:
        raise ValueError(f"{where}: buckets is empty")
    parsed = []
    for index, bucket in enumerate(buckets):
        if isinstance(bucket, GlooBucket):
            parsed.append(bucket)
            continue
        if not isinstance(bucket, dict):
            raise ValueError(f"{where}: bucket {index} is {type(bucket).__name__}, not an object")
        try:
            parsed.append(GlooBucket(**bucket))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bucket {index}: {exc}") from None
    return parsed


def _expect(value: Any, kind: type | tuple[type, ...], name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise ValueError(f"{name} {value!r} is not of type {' or '.join(k.__name__ for k in kinds)}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's worker side of the gloo push (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self.rank: int | None = None
        self.init_info: GlooInitInfo | None = None
        self._reloading = False
        self._processed_moe: list[Any] = []
        self._staging: _Staging | None = None

    # -- the group --------------------------------------------------------------------------

    def worker_rank(self) -> int:
        """This worker's rank inside its engine (0 for the uni executor)."""
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's push group (replacing an earlier one)."""
        self.shutdown()
        rank = init_info.rank_offset + self.worker_rank()
        if rank >= init_info.world_size:
            raise ValueError(f"init_info: this worker is rank {rank} (rank_offset "
                             f"{init_info.rank_offset} + worker {self.worker_rank()}), beyond "
                             f"world_size {init_info.world_size}")
        timeout = timedelta(seconds=init_info.timeout_s)
        peer = f"{init_info.master_address}:{init_info.master_port}"
        try:
            store = dist.TCPStore(init_info.master_address, init_info.master_port,
                                  is_master=False, timeout=timeout)
        except Exception as exc:
            raise RuntimeError(f"vlmcp_gloo: cannot reach the trainer's TCPStore at {peer}: "
                               f"{exc}") from exc
        try:
            store.set(f"{init_info.store_prefix}/ready/{self.worker_rank()}", "1")
            group = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{init_info.store_prefix}/gloo", store), rank,
                init_info.world_size, timeout)
        except Exception as exc:
            raise RuntimeError(f"vlmcp_gloo: joining the push group {init_info.store_prefix!r} "
                               f"at {peer} as rank {rank} of {init_info.world_size} failed "
                               f"(within {init_info.timeout_s:g} s): {exc}") from exc
        self.group, self.rank, self.init_info = group, rank, init_info
        logger.info("vlmcp_gloo: joined push group %r at %s as rank %d of %d",
                    init_info.store_prefix, peer, rank, init_info.world_size)
        if init_info.buckets is not None:
            self._staging = _Staging(self._received(init_info.buckets))

    def shutdown(self) -> None:
        """Drop the push group and a staged update's buffers (the model and the engine stay; a
        staging thread still receiving ends with the group's timeout)."""
        self.group = self.rank = self.init_info = self._staging = None

    # -- one update -------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """Begin vLLM's layerwise reload (the layers' weights are buffered until complete)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True
        self._watch_moe_processing()

    def finish_weight_update(self) -> None:
        """Finalise the layerwise reload, then on a CPU prepack the MoE experts again."""
        self._end_reload()

    def _watch_moe_processing(self) -> None:
        """Note each CPU-expert MoE layer whose post-load step the layerwise reload runs (it
        does so once a layer's weights are all loaded, or at the end for a partly loaded one):
        exactly the layers to repack afterwards. A layer the update did not touch keeps its
        packed weights, which a second packing would scramble (a failed update, or one of part
        of the model)."""
        self._processed_moe: list[Any] = []
        for module, _ in cpu_moe_experts(self.model):
            method = module.quant_method
            step = method.process_weights_after_loading

            def noted(layer: Any, _step: Any = step) -> Any:
                self._processed_moe.append(layer)
                return _step(layer)

            method.process_weights_after_loading = noted  # on the instance, removed at the end

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            for module, _ in cpu_moe_experts(self.model):
                vars(module.quant_method).pop("process_weights_after_loading", None)
        processed = getattr(self, "_processed_moe", [])
        if self.device.type == "cpu" and processed:
            repacked = repack_cpu_moe_experts_of(self.model, only=processed)
            logger.info("vlmcp_gloo: repacked the CPU experts of %d MoE layers", repacked)
        self._processed_moe = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one update. Unlike the base class, no `torch.accelerator.synchronize()`
        on a CPU (it raises there: no accelerator); on any failure the group is dropped and the
        layerwise reload finalised (see the module docstring), then the error raised."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as exc:
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
        if update_info.staged:
            if self._staging is None:
                raise RuntimeError("a staged update, but init_info listed no buckets")
            arrived = self._staging.result(self.init_info.timeout_s)
        else:
            arrived = self._received(update_info.buckets)

        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            for index, bucket, buffer in arrived:
                pairs = bucket.tensors(buffer)
                del buffer
                try:
                    self.model.load_weights(pairs)
                except Exception as exc:
                    raise RuntimeError(f"{bucket.describe(index)}: loading it into the model "
                                       f"failed: {type(exc).__name__}: {exc}") from exc
                del pairs
        self._staging = None

    def _received(self, buckets: list[GlooBucket]
                  ) -> Iterator[tuple[int, GlooBucket, torch.Tensor]]:
        """(index, bucket, its `[bytes]` uint8 buffer) in list order, as they arrive: one posted
        recv per src, that src's next posted once the consumer asks for the next bucket. The
        buckets' srcs are checked here, the receives start at the first look."""
        offset = self.init_info.rank_offset
        for index, bucket in enumerate(buckets):
            if bucket.src >= offset:
                raise ValueError(f"{bucket.describe(index)}: src {bucket.src} is not a trainer "
                                 f"rank (0..{offset - 1})")
        return _arrivals(self.group, buckets, f"rank {self.rank} of push group "
                         f"{self.init_info.store_prefix!r}")


def _arrivals(group: dist.ProcessGroupGloo, buckets: list[GlooBucket], member: str
              ) -> Iterator[tuple[int, GlooBucket, torch.Tensor]]:
    """GlooWeightTransferEngine._received's receives (`member`: this worker, for errors)."""
    queues: dict[int, deque[int]] = {}
    for index, bucket in enumerate(buckets):
        queues.setdefault(bucket.src, deque()).append(index)
    posted: dict[int, tuple[int, torch.Tensor, Any]] = {}

    def post(src: int) -> None:
        if queues[src]:
            index = queues[src].popleft()
            buffer = torch.empty(buckets[index].size, dtype=torch.uint8)
            try:
                work = group.recv([buffer], src, buckets[index].tag)
            except Exception as exc:
                raise RuntimeError(f"{buckets[index].describe(index)}: posting the receive "
                                   f"from trainer rank {src} failed: {exc}") from exc
            posted[src] = (index, buffer, work)

    for src in queues:
        post(src)
    for index, bucket in enumerate(buckets):
        posted_index, buffer, work = posted.pop(bucket.src)
        assert posted_index == index, (posted_index, index)
        try:
            work.wait()
        except Exception as exc:
            raise RuntimeError(
                f"{bucket.describe(index)}: receiving from trainer rank {bucket.src} "
                f"(this worker is {member}) failed: {exc}") from exc
        del work
        yield index, bucket, buffer
        del buffer
        post(bucket.src)


class _Staging:
    """A staged update's receive: a thread that drains `arrivals` (`_received`) into memory
    while the engine serves on."""

    def __init__(self, arrivals: Iterator[tuple[int, GlooBucket, torch.Tensor]]):
        self._arrived: list[tuple[int, GlooBucket, torch.Tensor]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, args=(arrivals,), daemon=True,
                                        name="vlmcp-gloo-staging")
        self._thread.start()

    def _drain(self, arrivals: Iterator[tuple[int, GlooBucket, torch.Tensor]]) -> None:
        try:
            self._arrived.extend(arrivals)
        except BaseException as exc:  # handed to the update that waits for it
            self._error = exc

    def result(self, timeout_s: float) -> list[tuple[int, GlooBucket, torch.Tensor]]:
        """Every bucket, once received (its error, raised here, when a receive failed)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the staged buckets did not all arrive within {timeout_s:g} s "
                               f"({len(self._arrived)} had)")
        if self._error is not None:
            raise RuntimeError(f"staging the update failed: {self._error}") from self._error
        return self._arrived
