"""Which rank writes which tensors of the live model, and the gathering of each rank's share: on
the calling thread, or (a background publish) copied off the live model and gathered from the
copies on the publish thread.

    SharePlan.of(hf_model, writers)   the tensors save_pretrained would write
                                      (`hf_format.saved_tensors`), each whole on one of `writers`
                                      ranks, balanced by bytes: largest first onto the least
                                      loaded rank. A pure function of the model, so every rank
                                      computes the same plan without talking.
    gather_share(engine, hf_model, plan, rank, staging)
                                      {HF key: CPU tensor} of the tensors `rank` writes, on the
                                      calling thread, over the default group (a synchronous
                                      publish, the final export, the fallback below). Under
                                      ZeRO-3 each partitioned parameter is gathered to the rank
                                      that writes it alone: every rank sends its partition
                                      (`ds_tensor`), the owner concatenates them, so each byte
                                      travels once and no rank holds more than its share; under
                                      ZeRO 0-2 each rank reads its share from its own full
                                      replica, with no communication.
    gathers_by_modules(engine, tensors, plan)
                                      whether the ranks take the fallback below (they agree).
    StagedShare                       the same share for a background publish, made off the
                                      training's critical path (below).

Why not DeepSpeed's own gather: `deepspeed.zero.GatheredParameters` (and the
`_zero3_consolidated_16bit_state_dict` built on it) all-gathers, so every rank receives and holds
every whole parameter, W times the traffic of a gather to one rank (measured here at world 2 on
gloo, 0.8 GB of partitions: 1.40 s all-gather, 0.53 s gather). The owner rebuilds a parameter as
DeepSpeed does: its W partitions of the padded flat tensor in partition-group rank order, cut to
`ds_numel`, viewed as `ds_shape`. Parameters whose partition is not in this rank's memory (NVMe
offload), quantized ones, and ones partitioned over less than the whole world go through
GatheredParameters instead, one module's parameters at a time, as DeepSpeed's consolidation does;
every rank takes the same path (they agree). That fallback always runs on the training's thread,
also for a background publish (whose thread then only writes).

A rank's share is a whole number of tensors: a tensor is never split, so the bytes of every tensor
are those save_pretrained writes. With `staging` (a dict the caller keeps from one publish to the
next) the share is copied into host buffers that later optimizer steps never touch, allocated at
the first call and refilled in place after (an asynchronous publish needs that; reusing the
buffers spares the allocation and first-touch page faults of a fresh copy every time, which on
this CPU cost about as much as the copy). Without it a CPU tensor may be the live parameter
itself (as in DeepSpeed's consolidation) and must be written before the next optimizer step.

## A background publish (training/weights/publish.py with publish.background)

    StagedShare.capture(tensors, plan, rank, zero3, buffers)
            the training's thread, right after optimizer step N (no copy): detached views of the
            live tensors this rank reads, and on CUDA an event on the current stream after the
            step. `tensors` is `saved_tensors(hf_model)`, `buffers` the caller's host buffers,
            kept from publish to publish.
    staged.stage()
            the publish thread: copies this rank's own data into its host buffers (allocated at
            the first publish, refilled after; pinned for a GPU source, copied on a side stream
            that waits for the event and is synchronised before `stage` returns). Under ZeRO-3
            that is its partition (`ds_tensor`) of every parameter, 1/W of the model, a tensor it
            writes getting its partition straight into that tensor's slot of the tensor's buffer;
            under ZeRO 0-2, the tensors of its share, from its own replica. Until `stage` has
            returned the trainer must not step the optimizer: the fence (`Publisher.fence`, right
            before the accumulation boundary's `engine.step()` in training/loop.py).
    staged.collect(group, stop)
            the publish thread, after `stage`: {HF key: CPU tensor [full shape]} of this rank's
            share, or None when the ranks stopped together. Under ZeRO-3 each parameter is
            gathered to its writer over `group` (`comm.gather_into`: the other ranks send their
            staged partitions, the writer receives them into the tensor's buffer), in state-dict
            order on every rank; under ZeRO 0-2 the share is the staged buffers, with no
            communication. It never reads a live tensor.
    bytes_to_stage(tensors, plan, rank, zero3)
            the host bytes `rank` keeps for that: its share (under ZeRO-3 each of its tensors
            padded to W partitions), and under ZeRO-3 also its partitions of the tensors the
            other ranks write; each pinned buffer (a GPU source) counted as the power of two
            torch's caching host allocator rounds it up to (`held_bytes`), so that
            publish.buffer_mb bounds what is really held.

Stopping together. `group` is the publisher's own gloo group (`comm.new_world_gloo_group`), used
by its publish thread alone, one publish at a time, so every rank's thread issues the same
collectives in the same order, never interleaved with the training's. Before the first gather,
after every `AGREE_BYTES` of gathered parameters and after the last, the threads agree over
`group` (one small all-reduce) whether any of them must stop: `stop()` is true where this rank's
copy failed or the trainer abandoned the write (a stop whose wait ran out, a failure). So all
ranks leave the gathers at the same parameter: no rank is ever left waiting for a partition
another will not send, and once `collect` has returned on one rank, every rank is past its last
gather (its process may tear down its groups). A gather itself fails only with the connection
(a rank gone), which fails it on both ends.

Why the tensors read still hold step N's weights until the next optimizer step (read in
DeepSpeed 0.19.8): between two optimizer steps, forward, backward, gradient reduction,
evaluation, generation and checkpoint saving only read them.
- ZeRO-3 (runtime/zero/stage3.py, runtime/zero/partition_parameters.py): `param.ds_tensor`, this
  rank's partition, is a view of the optimizer's flat `fp16_partitioned_groups_flat` (in the
  model's dtype, fp32 included). Forward and backward all-gather the partitions into
  `param.data` and free that after use (`_partition_param` with `has_been_updated=False` leaves
  `ds_tensor` as it is); gradients are reduced into buffers of their own; `save_checkpoint` and
  `GatheredParameters(modifier_rank=None)` (evaluation, generation, consolidation) read.
  `ds_tensor` is written by the optimizer step (`DeepSpeedZeroOptimizer_Stage3.step` ->
  `_reassign_or_swap_out_partitioned_parameters` copies the updated fp32 partition into it;
  where the two are one tensor the optimizer updates it in place, in the same step), by the exit
  of a `GatheredParameters(modifier_rank=R)` (`partition(has_been_updated=True)`; vlmcp opens
  none once the engine is built) and by `load_checkpoint`.
- ZeRO 1 and 2 (runtime/zero/stage_1_and_2.py): the parameters are views of `bit16_groups_flat`,
  and the fp32 master partition is a copy of its own. `step` copies the updated master partition
  into this rank's part of the flat buffer, all-gathers the others' parts
  (`all_gather_dp_groups`) and points `param.data` at the buffer again
  (`_update_model_bit16_weights`); backward writes gradients only (also with overlap_comm).
- ZeRO-0: bf16 parameters are written by `BF16_Optimizer.step` (`update_lp_params`), fp16 ones by
  the FP16 optimizer's step, fp32 ones by the torch optimizer's `step`, which the engine calls
  from `_take_model_step`.
- The engine's `step()` calls `_take_model_step` only at the gradient accumulation boundary: the
  `step()` after any other micro-batch changes no weight.
The views are taken on the training's thread at the publish, so a later `param.data = ...` (ZeRO
1-2 after a step) cannot redirect them. The other writers of the weights in a run come before
the first publish (`load_checkpoint` at a resume, in `start_run`) or after the last (none:
training merges no LoRA adapter, and the final export runs after `Publisher.close`, which waits
for the copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
from transformers import PreTrainedModel

from vlmcp.parallel import comm
from vlmcp.training.weights.expert_shards import (expert_holders, gather_expert_slices,
                                                  is_gathered_slice)
from vlmcp.training.weights.hf_format import saved_tensors, shard_names


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape, also of a ZeRO-3 partitioned parameter."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def full_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole tensor, also of a ZeRO-3 partitioned parameter."""
    return int(torch.Size(_full_shape(tensor)).numel()) * tensor.element_size()


def balanced_owners(sizes: dict[str, int], world: int,
                    holders: dict[str, tuple[int, ...]] | None = None) -> dict[str, int]:
    """{key: its rank}: `sizes` ({key: bytes}, in order) spread over ranks 0 .. `world` - 1,
    largest first onto the least loaded rank (ties: the lower rank, then the earlier key), a key
    of `holders` only onto one of its ranks. A pure function: every rank computes the same."""
    holders = holders or {}
    load = [0] * world
    owner: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: -sizes[k]):  # stable: order on ties
        rank = min(holders.get(key, range(world)), key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += sizes[key]
    return owner


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
        """The plan of `hf_model`'s saved tensors over ranks 0 .. `writers` - 1. Under expert
        parallelism an expert's tensors go to one of the ranks that hold it
        (training/weights/expert_shards.py)."""
        tensors = saved_tensors(hf_model)
        keys = tuple(tensors)
        sizes = {key: full_nbytes(value) for key, value in tensors.items()}
        owner = balanced_owners(sizes, writers, expert_holders(hf_model, writers))
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

    def writers(self) -> dict[str, int]:
        """{HF key: the rank that writes it}."""
        return {key: writer for writer, keys in zip(self.writer_of, self.keys_of) for key in keys}

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


def partitioned(engine: Any) -> bool:
    """Whether `engine` partitions the parameters themselves (ZeRO-3)."""
    return engine is not None and engine.zero_optimization_partition_weights()


def gathers_by_modules(engine: Any, tensors: dict[str, torch.Tensor], plan: SharePlan) -> bool:
    """Whether some ZeRO-3 parameter of `tensors` (`saved_tensors`) cannot be gathered to its
    owner alone on some rank (see the module docstring), so that every rank gathers with
    DeepSpeed instead. Call on every rank at the same point (one small all-reduce); False
    without ZeRO-3."""
    if not partitioned(engine):
        return False
    zero_params = [tensors[k] for k in plan.keys if hasattr(tensors[k], "ds_id")]
    return any(comm.rank_flags(not all(_owner_gatherable(p) for p in zero_params)))


def gather_share(engine: Any, hf_model: PreTrainedModel, plan: SharePlan, rank: int,
                 staging: dict[str, torch.Tensor] | None = None, *,
                 by_modules: bool | None = None) -> dict[str, torch.Tensor]:
    """{HF key: CPU tensor [full shape]} of the tensors `rank` writes (its `plan` share, in state-
    dict order; empty when it writes none), in the buffers of `staging` when given (see the module
    docstring). Call on every rank at the same point: under ZeRO-3
    (`engine.zero_optimization_partition_weights()`) gathering is collective. `by_modules`: the
    ranks' `gathers_by_modules`, when the caller has agreed on it already."""
    tensors = saved_tensors(hf_model)
    shard = plan.shard_of(rank)
    mine = set(plan.keys_of[shard]) if shard is not None else set()
    if not partitioned(engine):
        return {key: _to_host(key, tensors[key], staging) for key in plan.keys if key in mine}
    if by_modules is None:
        by_modules = gathers_by_modules(engine, tensors, plan)
    experts = gather_expert_slices(tensors, mine)
    tensors = {key: value for key, value in tensors.items() if not is_gathered_slice(value)}
    plan_keys = [key for key in plan.keys if key in tensors]
    if by_modules:
        return {**_gather_by_modules(engine, tensors, plan_keys, mine, staging), **experts}
    owners = plan.writers()
    share = experts
    for key in plan_keys:
        tensor = tensors[key]
        if hasattr(tensor, "ds_id"):
            whole = _gathered_to_owner(key, tensor, owners[key], rank, staging)
            if whole is not None:
                share[key] = whole
        elif key in mine:
            share[key] = _to_host(key, tensor, staging)
    return share


def _gather_by_modules(engine: Any, tensors: dict[str, torch.Tensor], keys: list[str],
                       mine: set[str], staging: dict[str, torch.Tensor] | None
                       ) -> dict[str, torch.Tensor]:
    """DeepSpeed's gather (every rank receives every parameter), one module's own parameters at a
    time, keeping the tensors of `mine`."""
    import deepspeed

    optimizer = engine.optimizer
    if hasattr(optimizer, "checkpoint_event_prologue"):
        optimizer.checkpoint_event_prologue()
    share = {}
    for _, group in groupby(keys, key=_module_of):
        keys = list(group)
        params = [tensors[k] for k in keys if hasattr(tensors[k], "ds_id")]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None,
                                               enabled=bool(params)):
            share.update({key: _to_host(key, tensors[key], staging)
                          for key in keys if key in mine})
    if hasattr(optimizer, "checkpoint_event_epilogue"):
        optimizer.checkpoint_event_epilogue()
    return share


#: Bytes of whole parameters gathered between two agreements of the ranks' publish threads.
AGREE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Part:
    """One tensor this rank stages: `source` [n], a flat detached view of the live tensor (under
    ZeRO-3 this rank's partition), goes to `buffer_numel`-long buffer of `key` at `offset`.
    `owner`: the rank it is gathered to (ZeRO-3; None: it is this rank's, whole). The tensor
    written is buffer[:numel] viewed as `shape`."""

    key: str
    source: torch.Tensor
    buffer_numel: int
    offset: int
    owner: int | None
    numel: int
    shape: tuple[int, ...]


def _parts(tensors: dict[str, torch.Tensor], plan: SharePlan, rank: int,
           zero3: bool) -> list[_Part]:
    """What `rank` stages, in state-dict order (the same ZeRO-3 parameters on every rank)."""
    writers = plan.writers()
    world = comm.world_size()
    parts = []
    for key in plan.keys:
        tensor = tensors[key]
        if zero3 and hasattr(tensor, "ds_id"):
            partition = tensor.ds_tensor.detach().reshape(-1)
            n, owner = partition.numel(), writers[key]
            mine = owner == rank
            parts.append(_Part(key, partition, world * n if mine else n, rank * n if mine else 0,
                               owner, tensor.ds_numel, tuple(tensor.ds_shape)))
        elif writers[key] == rank:
            value = tensor.detach()
            parts.append(_Part(key, value.reshape(-1), value.numel(), 0, None, value.numel(),
                               tuple(value.shape)))
    return parts


def held_bytes(nbytes: int, pinned: bool) -> int:
    """The host memory a staging buffer of `nbytes` really takes: a pinned one (for a GPU
    source) is a block of torch's caching host allocator, which rounds every block up to the
    next power of two (a 2.1 GB embedding takes 4 GiB; `torch.cuda.host_memory_stats` counts the
    rounded size), a pageable one its bytes."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


def buffers_held_bytes(buffers: dict[str, torch.Tensor]) -> int:
    """The host memory `buffers` (a publisher's staging buffers) really take (`held_bytes`)."""
    return sum(held_bytes(b.numel() * b.element_size(), b.is_pinned()) for b in buffers.values())


def bytes_to_stage(tensors: dict[str, torch.Tensor], plan: SharePlan, rank: int,
                   zero3: bool) -> int:
    """The host memory `rank` keeps for a background publish (see the module docstring), as it
    is really held: pinned buffers of GPU sources rounded as the allocator rounds them."""
    return sum(held_bytes(part.buffer_numel * part.source.element_size(), part.source.is_cuda)
               for part in _parts(tensors, plan, rank, zero3))


class StagedShare:
    """This rank's part of one background publish (see the module docstring)."""

    def __init__(self, parts: list[_Part], rank: int, buffers: dict[str, torch.Tensor],
                 ready: tuple[torch.device, torch.cuda.Event] | None):
        self._parts, self._rank, self._buffers = parts, rank, buffers
        #: (the GPU, an event on its stream right after the optimizer step) for GPU sources.
        self._ready = ready

    @classmethod
    def capture(cls, tensors: dict[str, torch.Tensor], plan: SharePlan, rank: int, zero3: bool,
                buffers: dict[str, torch.Tensor]) -> StagedShare:
        """On the training's thread, right after the optimizer step (no copy)."""
        parts = _parts(tensors, plan, rank, zero3)
        on_gpu = [part.source.device for part in parts if part.source.is_cuda]
        ready = ((on_gpu[0], torch.cuda.current_stream(on_gpu[0]).record_event())
                 if on_gpu else None)
        return cls(parts, rank, buffers, ready)

    def _slot(self, part: _Part) -> torch.Tensor:
        return self._buffers[part.key][part.offset:part.offset + part.source.numel()]

    def stage(self) -> None:
        """On the publish thread: copy every part into its host buffer; returns once done."""
        for part in self._parts:
            _buffer(self._buffers, part.key, part.buffer_numel, part.source)
        if self._ready is None:
            for part in self._parts:
                self._slot(part).copy_(part.source)
            return
        device, after_step = self._ready
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            stream.wait_event(after_step)
            with torch.cuda.stream(stream):
                for part in self._parts:
                    self._slot(part).copy_(part.source, non_blocking=True)
            stream.synchronize()

    def collect(self, group: comm.ProcessGroup | None, stop: Callable[[], bool]
                ) -> dict[str, torch.Tensor] | None:
        """On the publish thread, after `stage`: this rank's share, or None when any rank's
        `stop()` was true at an agreement (see the module docstring)."""
        gathered = [part for part in self._parts if part.owner is not None]
        if not gathered:
            return None if stop() else {part.key: self._whole(part) for part in self._parts}
        since = None
        for part in gathered:
            if since is None or since >= AGREE_BYTES:
                if _any_stops(group, stop):
                    return None
                since = 0
            comm.gather_into(self._slot(part), part.owner,
                             self._buffers[part.key] if part.owner == self._rank else None, group)
            since += part.numel * part.source.element_size()
        if _any_stops(group, stop):
            return None
        return {part.key: self._whole(part) for part in self._parts
                if part.owner in (None, self._rank)}

    def _whole(self, part: _Part) -> torch.Tensor:
        return self._buffers[part.key][:part.numel].view(part.shape)


def _any_stops(group: comm.ProcessGroup | None, stop: Callable[[], bool]) -> bool:
    """Whether any rank's `stop()` is true: one small all-reduce over `group` (None: one rank)."""
    flag = torch.tensor([float(stop())], dtype=torch.float64)
    if group is not None:
        comm.all_reduce_max(flag, group)
    return bool(flag[0])
