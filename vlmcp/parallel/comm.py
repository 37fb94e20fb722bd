"""Every collective vlmcp issues lives here; model code calls these and never torch.distributed.

Dimension legend used in docstrings:
    P        ranks in the sequence-parallel (SP) group
    S        length of the whole (padded) packed sequence
    S_local  S / P, the contiguous shard one SP rank holds
    H        heads; H_local = H / P
    D        head dim

Functions whose name ends in `_autograd` are differentiable: their backward runs the matching
collective, so gradients flow across ranks. With `group is None` or a group of one rank every
function is the identity (or the trivial stacking), so single-process code runs unchanged.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def group_size(group: ProcessGroup | None) -> int:
    if group is None or not is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    if group is None or not is_initialized():
        return 0
    return dist.get_rank(group)


def _skip_cpu_shm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory comm op (about 60 s per machine).

    DeepSpeed probes its op builders once and caches the result in
    `deepspeed.ops.__compatible_ops__`; marking the shm op incompatible makes its CPU backend use
    plain gloo collectives, which is what vlmcp's training path issues anyway. Set
    VLMCP_DS_SHM=1 to keep the op.
    """
    if os.environ.get("VLMCP_DS_SHM") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(timeout_s: float = 600.0) -> None:
    """Start torch.distributed and deepspeed.comm from the launcher's environment.

    Works under torchrun, the `deepspeed` launcher and `accelerate launch` (ranks come from the
    environment they set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Uses NCCL on
    CUDA and gloo on CPU. A single process without launcher variables gets a world of one.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        _skip_cpu_shm_op()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    logger.debug("rank %d/%d on %s (%s)", rank(), world_size(), get_accelerator().device_name(), backend)


def shutdown() -> None:
    """Destroy the process group (if any); every rank calls it once before exiting."""
    if is_initialized():
        dist.destroy_process_group()


def barrier(group: ProcessGroup | None = None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> torch.Tensor:
    """In-place all-reduce; a CPU tensor under NCCL travels through the GPU and comes back."""
    if not is_initialized():
        return tensor
    if tensor.is_cuda or dist.get_backend(group) != "nccl":
        dist.all_reduce(tensor, op=op, group=group)
        return tensor
    on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(on_device, op=op, group=group)
    return tensor.copy_(on_device)


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over `group` (the whole world when None). No autograd."""
    return _all_reduce(tensor, dist.ReduceOp.SUM, group)


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """In-place max over `group` (the whole world when None). No autograd."""
    return _all_reduce(tensor, dist.ReduceOp.MAX, group)


def rank_flags(flag: bool) -> list[bool]:
    """Every rank's `flag`, indexed by global rank (one small all-reduce; call on every rank).

    How ranks agree on an outcome (a failed write, a stop request) so that all of them take the
    same branch and none is left waiting in a collective the others skipped.
    """
    flags = torch.zeros(world_size(), dtype=torch.float64)
    flags[rank()] = float(flag)
    all_reduce_sum(flags)
    return [bool(f) for f in flags.tolist()]


class _AllGatherStack(torch.autograd.Function):
    """Forward: stack every rank's tensor. Backward: sum the stacked gradient over the group and
    keep this rank's slot (an all-reduce, which every backend has for any subgroup)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


def all_gather_autograd(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Stack every rank's `tensor` (same shape on all ranks): [...] -> [P, ...].

    Backward sums the incoming gradients of slot r over all ranks and hands that sum to rank r,
    so a value used on several ranks receives the gradient of every use.
    """
    if group_size(group) == 1:
        return tensor.unsqueeze(0)
    return _AllGatherStack.apply(tensor, group)


def keep_in_graph(out: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """`out`, made to depend (with weight zero) on collective outputs this rank did not use.

    The backward of a differentiable collective is itself a collective: every rank must run it.
    A rank that gathered values it has no use for (say, rank 0, which has no predecessor) ties
    them to its output so its backward still reaches the collective.
    """
    for t in gathered:
        out = out + 0.0 * t.sum().to(out.dtype)
    return out


def seq_to_heads_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Ulysses all-to-all, sequence-sharded to head-sharded: [S_local, H, D] -> [S, H_local, D].

    Rank r keeps heads [r*H_local, (r+1)*H_local) of the whole sequence, ordered by SP rank.
    Uses DeepSpeed's `_SeqAllToAll`; H must be divisible by P.
    """
    if group_size(group) == 1:
        return x
    from deepspeed.sequence.layer import _SeqAllToAll

    _check_divisible(x.shape[1], group, "heads")
    out = _SeqAllToAll.apply(group, x.unsqueeze(0).contiguous(), 2, 1, 0)
    return out.squeeze(0)


def heads_to_seq_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Ulysses all-to-all back, head-sharded to sequence-sharded: [S, H_local, D] -> [S_local, H, D]."""
    if group_size(group) == 1:
        return x
    from deepspeed.sequence.layer import _SeqAllToAll

    _check_divisible(x.shape[0], group, "sequence length")
    out = _SeqAllToAll.apply(group, x.unsqueeze(0).contiguous(), 1, 2, 0)
    return out.squeeze(0)


def _check_divisible(n: int, group: ProcessGroup | None, what: str) -> None:
    p = group_size(group)
    if n % p:
        raise ValueError(f"all-to-all needs {what} ({n}) divisible by the SP size ({p})")
