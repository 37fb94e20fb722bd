"""Which rank writes which tensors of the live model, and the gathering of each rank's share.

    SharePlan.of(hf_model, writers)   the tensors save_pretrained would write
                                      (`hf_format.saved_tensors`), each whole on one of `writers`
                                      ranks, balanced by bytes: largest first onto the least
                                      loaded rank. A pure function of the model, so every rank
                                      computes the same plan without talking.
    gather_share(engine, hf_model, plan, rank, staging)
                                      {HF key: CPU tensor} of the tensors `rank` writes. Under
                                      ZeRO-3 each partitioned parameter is gathered to the rank
                                      that writes it alone: every rank sends its partition
                                      (`ds_tensor`), the owner concatenates them, so each byte
                                      travels once and no rank holds more than its share; under
                                      ZeRO 0-2 each rank reads its share from its own full
                                      replica, with no communication.

Why not DeepSpeed's own gather: `deepspeed.zero.GatheredParameters` (and the
`_zero3_consolidated_16bit_state_dict` built on it) all-gathers, so every rank receives and holds
every whole parameter, W times the traffic of a gather to one rank (measured here at world 2 on
gloo, 0.8 GB of partitions: 1.40 s all-gather, 0.53 s gather). The owner rebuilds a parameter as
DeepSpeed does: its W partitions of the padded flat tensor in partition-group rank order, cut to
`ds_numel`, viewed as `ds_shape`. Parameters whose partition is not in this rank's memory (NVMe
offload), quantized ones, and ones partitioned over less than the whole world go through
GatheredParameters instead, one module's parameters at a time, as DeepSpeed's consolidation does;
every rank takes the same path (they agree).

A rank's share is a whole number of tensors: a tensor is never split, so the bytes of every tensor
are those save_pretrained writes. With `staging` (a dict the caller keeps from one publish to the
next) the share is copied into host buffers that later optimizer steps never touch, allocated at
the first call and refilled in place after (an asynchronous publish needs that; reusing the
buffers spares the allocation and first-touch page faults of a fresh copy every time, which on
this CPU cost about as much as the copy). Without it a CPU tensor may be the live parameter
itself (as in DeepSpeed's consolidation) and must be written before the next optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
from transformers import PreTrainedModel

from vlmcp.parallel import comm
from vlmcp.training.hf_format import saved_tensors, shard_names


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape, also of a ZeRO-3 partitioned parameter."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def _nbytes(tensor: torch.Tensor) -> int:
    return int(torch.Size(_full_shape(tensor)).numel()) * tensor.element_size()


@dataclass(frozen=True)
class SharePlan:
    """The shards of one model directory: `files[i]` holds the tensors `keys_of[i]`
    (`share_bytes[i]` bytes), written by rank `writer_of[i]`; a rank without a tensor writes no
    file. `keys` is every saved tensor in state-dict order."""

    keys: tuple[str, ...]
    files: tuple[str, ...]
    keys_of: tuple[tuple[str, ...], ...]
    writer_of: tuple[int, ...]
    share_bytes: tuple[int, ...]
    total_parameters: int

    @classmethod
    def of(cls, hf_model: PreTrainedModel, writers: int) -> SharePlan:
        """The plan of `hf_model`'s saved tensors over ranks 0 .. `writers` - 1."""
        tensors = saved_tensors(hf_model)
        keys = tuple(tensors)
        sizes = {key: _nbytes(value) for key, value in tensors.items()}
        load = [0] * writers
        owner: dict[str, int] = {}
        for key in sorted(keys, key=lambda k: -sizes[k]):  # stable: state-dict order on ties
            rank = min(range(writers), key=lambda r: (load[r], r))
            owner[key] = rank
            load[rank] += sizes[key]
        used = tuple(r for r in range(writers) if any(owner[k] == r for k in keys))
        keys_of = tuple(tuple(k for k in keys if owner[k] == r) for r in used)
        numel = sum(int(torch.Size(_full_shape(tensors[k])).numel()) for k in keys
                    if isinstance(tensors[k], torch.nn.Parameter))
        return cls(keys=keys, files=tuple(shard_names(len(used))), keys_of=keys_of,
                   writer_of=used, share_bytes=tuple(sum(sizes[k] for k in ks) for ks in keys_of),
                   total_parameters=numel)

    @property
    def total_size(self) -> int:
        """Bytes of every saved tensor."""
        return sum(self.share_bytes)

    def shard_of(self, rank: int) -> int | None:
        """The index of the shard `rank` writes, or None when it writes none."""
        return self.writer_of.index(rank) if rank in self.writer_of else None

    def bytes_of(self, rank: int) -> int:
        """Bytes of the tensors `rank` writes."""
        shard = self.shard_of(rank)
        return 0 if shard is None else self.share_bytes[shard]

    def weight_map(self) -> dict[str, str]:
        """{HF key: its file}, the index's weight_map."""
        return {key: name for name, keys in zip(self.files, self.keys_of) for key in keys}


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]


def _buffer(staging: dict[str, torch.Tensor], key: str, numel: int,
            like: torch.Tensor) -> torch.Tensor:
    """The flat host buffer [numel] of `key` in `staging` (made, pinned for a CUDA source, when
    missing or of another size or dtype)."""
    buffer = staging.get(key)
    if buffer is None or buffer.numel() != numel or buffer.dtype != like.dtype:
        buffer = staging[key] = torch.empty(numel, dtype=like.dtype, pin_memory=like.is_cuda)
    return buffer


def _to_host(key: str, tensor: torch.Tensor,
             staging: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """`tensor` on the host: copied into its staging buffer, else as it is (a CPU tensor) or
    copied (a GPU one)."""
    value = tensor.detach()
    if staging is None:
        return value.cpu()
    return _buffer(staging, key, value.numel(), value).copy_(value.reshape(-1)).view(value.shape)


def _owner_gatherable(param: torch.Tensor) -> bool:
    """Whether a ZeRO-3 parameter's partition lies in this rank's memory, unquantized, and is
    partitioned over the whole world (so its owner can gather it alone)."""
    import torch.distributed as dist

    partition = param.ds_tensor
    return (getattr(partition, "final_location", None) != "nvme"
            and not hasattr(partition, "ds_quant_scale")
            and dist.get_world_size(param.ds_process_group) == comm.world_size())


def _gathered_to_owner(key: str, param: torch.Tensor, owner: int, rank: int,
                       staging: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    """The whole parameter [ds_shape] on the host of global rank `owner` (None elsewhere): the
    W partitions of its padded flat tensor, cut to `ds_numel`. Every rank sends its partition
    (call on every rank)."""
    partition = param.ds_tensor.detach().reshape(-1)
    out = None
    if staging is not None and rank == owner:
        out = _buffer(staging, key, comm.world_size() * partition.numel(), partition)
    flat = comm.gather_to_rank(partition, owner, out)
    if rank != owner:
        return None
    return flat[:param.ds_numel].view(param.ds_shape).cpu()


def gather_share(engine: Any, hf_model: PreTrainedModel, plan: SharePlan, rank: int,
                 staging: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """{HF key: CPU tensor [full shape]} of the tensors `rank` writes (its `plan` share, in state-
    dict order; empty when it writes none), in the buffers of `staging` when given (see the module
    docstring). Call on every rank at the same point: under ZeRO-3
    (`engine.zero_optimization_partition_weights()`) gathering is collective."""
    tensors = saved_tensors(hf_model)
    shard = plan.shard_of(rank)
    mine = set(plan.keys_of[shard]) if shard is not None else set()
    partitioned = engine is not None and engine.zero_optimization_partition_weights()
    if not partitioned:
        return {key: _to_host(key, tensors[key], staging) for key in plan.keys if key in mine}
    zero_params = [tensors[k] for k in plan.keys if hasattr(tensors[k], "ds_id")]
    if any(comm.rank_flags(not all(_owner_gatherable(p) for p in zero_params))):
        return _gather_by_modules(engine, tensors, plan, mine, staging)
    owners = {key: writer for writer, keys in zip(plan.writer_of, plan.keys_of) for key in keys}
    share = {}
    for key in plan.keys:
        tensor = tensors[key]
        if hasattr(tensor, "ds_id"):
            whole = _gathered_to_owner(key, tensor, owners[key], rank, staging)
            if whole is not None:
                share[key] = whole
        elif key in mine:
            share[key] = _to_host(key, tensor, staging)
    return share


def _gather_by_modules(engine: Any, tensors: dict[str, torch.Tensor], plan: SharePlan,
                       mine: set[str], staging: dict[str, torch.Tensor] | None
                       ) -> dict[str, torch.Tensor]:
    """DeepSpeed's gather (every rank receives every parameter), one module's own parameters at a
    time, keeping the tensors of `mine`."""
    import deepspeed

    optimizer = engine.optimizer
    if hasattr(optimizer, "checkpoint_event_prologue"):
        optimizer.checkpoint_event_prologue()
    share = {}
    for _, group in groupby(plan.keys, key=_module_of):
        keys = list(group)
        params = [tensors[k] for k in keys if hasattr(tensors[k], "ds_id")]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None,
                                               enabled=bool(params)):
            share.update({key: _to_host(key, tensors[key], staging)
                          for key in keys if key in mine})
    if hasattr(optimizer, "checkpoint_event_epilogue"):
        optimizer.checkpoint_event_epilogue()
    return share
