"""Which rank writes which tensors of the live model, and the gathering of each rank's share.

    SharePlan.of(hf_model, writers)   the tensors save_pretrained would write
                                      (`hf_format.saved_tensors`), each whole on one of `writers`
                                      ranks, balanced by bytes: largest first onto the least
                                      loaded rank. A pure function of the model, so every rank
                                      computes the same plan without talking.
    gather_share(engine, hf_model, plan, rank, copy)
                                      {HF key: CPU tensor} of the tensors `rank` writes. Under
                                      ZeRO-3 every rank takes part in gathering every partitioned
                                      parameter, one module's own parameters at a time (as
                                      DeepSpeed's `_zero3_consolidated_16bit_state_dict` does),
                                      and keeps only those of its share, so no rank ever holds
                                      more than its share on the host; under ZeRO 0-2 each rank
                                      reads its share from its own full replica, with no
                                      communication.

A rank's share is a whole number of tensors: a tensor is never split, so the bytes of every tensor
are those save_pretrained writes. With `copy` the share is a fresh copy, unchanged by later
optimizer steps (an asynchronous publish needs that); without it, a CPU tensor may be the live
parameter itself (as in DeepSpeed's consolidation) and must be written before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
from transformers import PreTrainedModel

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


def _to_host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    value = tensor.detach()
    return value.to("cpu", copy=True) if copy else value.cpu()


def gather_share(engine: Any, hf_model: PreTrainedModel, plan: SharePlan, rank: int,
                 copy: bool) -> dict[str, torch.Tensor]:
    """{HF key: CPU tensor [full shape]} of the tensors `rank` writes (its `plan` share, in state-
    dict order; empty when it writes none). Call on every rank at the same point: under ZeRO-3
    (`engine.zero_optimization_partition_weights()`) gathering is collective."""
    tensors = saved_tensors(hf_model)
    shard = plan.shard_of(rank)
    mine = set(plan.keys_of[shard]) if shard is not None else set()
    partitioned = engine is not None and engine.zero_optimization_partition_weights()
    if not partitioned:
        return {key: _to_host(tensors[key], copy) for key in plan.keys if key in mine}
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
            share.update({key: _to_host(tensors[key], copy) for key in keys if key in mine})
    if hasattr(optimizer, "checkpoint_event_epilogue"):
        optimizer.checkpoint_event_epilogue()
    return share
