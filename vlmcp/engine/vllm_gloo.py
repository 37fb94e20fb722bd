"""Runs inside vLLM's worker: vlmcp's weight-transfer backend "vlmcp_gloo" (the receiving side of
publish.engines; the sending side is training/weights/engine_push.py).

Why it exists: vLLM 0.32's own backends (`nccl`, `ipc`, `sparse_nccl`, ...) need CUDA, and the
`nccl` one takes every byte from a single trainer rank. This one runs on any host over gloo and
takes each trainer rank's share from that rank, all at once. vLLM creates it from
`--weight-transfer-config '{"backend": "vlmcp_gloo"}'` once `vllm_plugin.register` (the
`vllm.general_plugins` entry point of vlmcp's package) has registered it.

    init_transfer_engine({master_address, master_port, store_prefix, rank_offset, world_size,
                          timeout_s})
        joins trainer rank 0's TCPStore, marks `{store_prefix}/ready/{k}` (k: this worker's rank
        in its engine; the trainer ranks wait for worker 0's mark before they join), then a gloo
        group of `world_size` under `{store_prefix}/gloo`: trainer rank r is member r, worker k
        member rank_offset + k. A second init replaces the group.
    start_weight_update()    vLLM's layerwise reload begins
    update_weights({"buckets": [{src, tag, names, dtype_names, shapes, bytes}, ...]})
        one posted receive per source rank at a time: bucket B arrives from member B.src as one
        [B.bytes] uint8 buffer under tag B.tag, its tensors' bytes back to back in `names` order
        ([*shape] of `dtype`, native byte order); the buckets are awaited in the listed order and
        each is handed to `model.load_weights` as soon as it is complete
    finish_weight_update()   vLLM's layerwise finalisation, then, on a CPU, the MoE experts'
                             prepack (vllm_worker.repack_cpu_moe_experts_of), which vLLM's
                             reload leaves undone
    shutdown()               the group is dropped

Imported by vLLM only (through the factory's lazy loader), never in the trainer's environment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from vlmcp.engine.vllm_worker import repack_cpu_moe_experts_of

logger = logging.getLogger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the push's group meets (see the module docstring)."""

    master_address: str
    master_port: int
    store_prefix: str
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The buckets of one update, in the order they are awaited."""

    buckets: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for index, bucket in enumerate(self.buckets):
            missing = {"src", "tag", "names", "dtype_names", "shapes", "bytes"} - set(bucket)
            if missing:
                raise ValueError(f"bucket {index}: missing {sorted(missing)}")
            if not len(bucket["names"]) == len(bucket["dtype_names"]) == len(bucket["shapes"]):
                raise ValueError(f"bucket {index}: names, dtype_names and shapes differ in length")
            for dtype in bucket["dtype_names"]:
                if not isinstance(getattr(torch, dtype, None), torch.dtype):
                    raise ValueError(f"bucket {index}: {dtype!r} is not a torch dtype")


def unpack(buffer: torch.Tensor, bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one received bucket ([bytes] uint8): each a view of `buffer`
    where its offset is aligned to its dtype, else a copy."""
    pairs, offset = [], 0
    for name, dtype_name, shape in zip(bucket["names"], bucket["dtype_names"], bucket["shapes"]):
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        part = buffer[offset:offset + size]
        if offset % torch.empty((), dtype=dtype).element_size():
            part = part.clone()
        pairs.append((name, part.view(dtype).view(shape)))
        offset += size
    if offset != buffer.numel():
        raise ValueError(f"bucket {bucket['tag']} of trainer rank {bucket['src']}: its tensors "
                         f"take {offset} bytes, the bucket {buffer.numel()}")
    return pairs


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vlmcp's gloo backend (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.rank = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.rank = init_info.rank_offset + worker
        timeout = timedelta(seconds=init_info.timeout_s)
        self.store = dist.TCPStore(init_info.master_address, init_info.master_port,
                                   is_master=False, timeout=timeout)
        self.store.set(f"{init_info.store_prefix}/ready/{worker}", "1")
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{init_info.store_prefix}/gloo", self.store), self.rank,
            init_info.world_size, timeout)
        logger.info("vlmcp_gloo: joined the push's group as member %d of %d", self.rank,
                    init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repacked = repack_cpu_moe_experts_of(self.model)
        if repacked:
            logger.info("vlmcp_gloo: repacked the CPU experts of %d MoE layers", repacked)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class, without its device synchronisation (the buckets arrive in host
        memory and `load_weights` copies them synchronously)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("vlmcp_gloo: no push group: POST /init_weight_transfer_engine "
                               "first")
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check)

        pending: dict[int, tuple[dict[str, Any], torch.Tensor, Any]] = {}
        queues: dict[int, list[dict[str, Any]]] = {}
        for bucket in update_info.buckets:
            queues.setdefault(int(bucket["src"]), []).append(bucket)

        def post(src: int) -> None:
            if queues[src]:
                bucket = queues[src].pop(0)
                buffer = torch.empty(int(bucket["bytes"]), dtype=torch.uint8)
                pending[src] = (bucket, buffer, self.group.recv([buffer], src, int(bucket["tag"])))

        for src in queues:
            post(src)
        with disable_mtp_completeness_check():
            for bucket in update_info.buckets:
                src = int(bucket["src"])
                posted, buffer, work = pending.pop(src)
                try:
                    work.wait()
                except RuntimeError as exc:
                    raise RuntimeError(f"vlmcp_gloo: receiving bucket {posted['tag']} of trainer "
                                       f"rank {src}: {exc}") from exc
                post(src)
                self.model.load_weights(unpack(buffer, posted))

    def shutdown(self) -> None:
        self.group = None
        self.store = None
