"""Rank-side code of the DeltaNet hook unit tests (imported by spawned processes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vlmcp.model import deltanet
from vlmcp.model.deltanet import sharded_deltanet_forward
from vlmcp.parallel import comm
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.parallel.shard import ShardPlan


@contextlib.contextmanager
def counting_recurrence_tokens() -> Iterator[list[int]]:
    """Count the tokens the hook passes through `deltanet_core` (one counter, [tokens]).

    Wraps the name the hook module calls, in this spawned process only, and restores it."""
    original = deltanet.deltanet_core
    counter = [0]

    def counted(mixed, *args, **kwargs):
        counter[0] += mixed.shape[0]
        return original(mixed, *args, **kwargs)

    deltanet.deltanet_core = counted
    try:
        yield counter
    finally:
        deltanet.deltanet_core = original


def sharded_layer_grads(cases: dict[str, tuple]) -> dict[str, dict]:
    """On each rank, for every case name -> (layer, x [S, hidden], weight [S, hidden], seq_lens, mode,
    DeltaNet kernel):
    the sharded layer's output shard, input-gradient shard and the parameter gradients summed
    over ranks, of loss = sum(out * weight) over the whole pack; also the tokens this rank's
    forward ran through the recurrence and its shard length."""
    sp = SequenceParallel.initialize(comm.world_size())
    results = {}
    for name, (layer, x, weight, seq_lens, mode, kernel) in cases.items():
        plan = ShardPlan.build(seq_lens, sp.size, sp.rank, sp.group, min_local_len=layer.conv_kernel_size - 1)
        x_local = plan.shard(x, dim=0).detach().requires_grad_(True)
        with counting_recurrence_tokens() as recurrence_tokens:
            out = sharded_deltanet_forward(layer, x_local.unsqueeze(0), plan, mode, kernel)[0]
        (out * plan.shard(weight, dim=0)).sum().backward()
        grads = {}
        for pname, p in layer.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            grads[pname] = comm.all_reduce_sum(g)
        layer.zero_grad(set_to_none=True)
        results[name] = {
            "out": out.detach(),
            "x_grad": x_local.grad,
            "param_grads": grads,
            "recurrence_tokens": recurrence_tokens[0],
            "local_len": plan.local_len,
        }
    return results
