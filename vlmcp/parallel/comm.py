"""Every collective vlmcp issues lives here; model code calls these and never torch.distributed.

Dimension legend used in docstrings:
    P        ranks in the sequence-parallel (SP) group
    S        length of the whole (padded) packed sequence
    S_local  S / P, the contiguous shard one SP rank holds
    H        heads; H_local = H / P
    D        head dim
    N_send   rows this rank sends in a variable-size all-to-all; N_recv the rows it receives

Functions whose name ends in `_autograd` are differentiable: their backward runs the matching
collective, so gradients flow across ranks. With `group is None` or a group of one rank every
function is the identity (or the trivial stacking), so single-process code runs unchanged.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlmcp import device

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


#: Overrides the process-group backend ("nccl" or "gloo"); unset: NCCL on CUDA, gloo on CPU.
BACKEND_ENV = "VLMCP_DIST_BACKEND"


def dist_backend() -> str:
    """The backend `init_distributed` starts: VLMCP_DIST_BACKEND when set, else "nccl" when vlmcp
    runs on CUDA (`vlmcp.device.use_cuda`) and "gloo" otherwise.

    gloo also serves CUDA tensors for the collectives vlmcp issues (all_reduce, all_gather,
    all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single: torch's ProcessGroupGloo
    stages them through pinned host memory), which lets several ranks share one GPU (NCCL refuses
    that); gloo's send/recv and coalesced collectives are CPU-only. NCCL without CUDA is a
    DeviceError.
    """
    on_cuda = device.use_cuda()
    backend = os.environ.get(BACKEND_ENV, "").strip().lower() or ("nccl" if on_cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise device.DeviceError(f"{BACKEND_ENV}={backend!r}: use 'nccl' or 'gloo'")
    if backend == "nccl" and not on_cuda:
        raise device.DeviceError(f"{BACKEND_ENV}=nccl needs CUDA, but vlmcp runs on CPU (no GPU, or DS_ACCELERATOR=cpu)")
    return backend


def init_distributed(timeout_s: float = 600.0) -> None:
    """Start torch.distributed and deepspeed.comm from the launcher's environment.

    Works under torchrun, the `deepspeed` launcher and `accelerate launch` (ranks come from the
    environment they set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The backend is
    `dist_backend()`; on CUDA each rank uses cuda:LOCAL_RANK (to share one GPU under gloo, give
    every rank LOCAL_RANK=0, as `make gpu-check` does). A single process without launcher
    variables gets a world of one.
    """
    on_cuda = device.settle_accelerator()  # before DeepSpeed reads DS_ACCELERATOR
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = dist_backend()
    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        _skip_cpu_shm_op()
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    logger.debug("rank %d/%d on %s (%s)", rank(), world_size(), get_accelerator().device_name(), backend)


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a rendezvous of ranks started on this machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def all_gather_world(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (same shape and dtype on all ranks), stacked by global rank:
    [...] -> [W, ...]. No autograd; a CPU tensor under NCCL travels through the GPU and back."""
    if not is_initialized() or world_size() == 1:
        return tensor.unsqueeze(0)
    moved = tensor
    if not tensor.is_cuda and dist.get_backend() == "nccl":
        moved = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    parts = [torch.empty_like(moved) for _ in range(world_size())]
    dist.all_gather(parts, moved.contiguous())
    return torch.stack(parts).to(tensor.device)


def gather_to_rank(tensor: torch.Tensor, dst: int,
                   out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every rank's `tensor` (same shape and dtype on all ranks, [N]) concatenated in global rank
    order on global rank `dst`, None elsewhere: into `out` ([W * N], on any device) when given,
    else into a fresh tensor (on `dst`'s GPU under NCCL). Only `dst` receives anything. No
    autograd."""
    moved = tensor.contiguous()
    if not is_initialized() or world_size() == 1:
        return (out if out is not None else torch.empty_like(moved)).copy_(moved)
    if not tensor.is_cuda and dist.get_backend() == "nccl":
        moved = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    flat = None
    if rank() == dst:
        flat = out if out is not None and out.device == moved.device else torch.empty(
            world_size() * moved.numel(), dtype=moved.dtype, device=moved.device)
    dist.gather(moved, gather_list=list(flat.chunk(world_size())) if flat is not None else None,
                dst=dst)
    if flat is not None and out is not None and flat is not out:
        return out.copy_(flat)
    return flat


def new_world_gloo_group(timeout_s: float) -> ProcessGroup | None:
    """A new gloo process group over the whole world, for the collectives of one background
    thread only (call on every rank, at the same point of the program: group creation is itself
    collective over the default group). Its collectives never interleave with the main thread's,
    which run on other groups; torch.distributed.checkpoint's async save keeps a gloo group of
    its own for the same reason. gloo serves CPU tensors under any default backend. A collective
    on it raises after `timeout_s`. None when there is one rank (nothing to talk to)."""
    if not is_initialized() or world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def gather_into(part: torch.Tensor, dst: int, out: torch.Tensor | None,
                group: ProcessGroup | None) -> None:
    """Every rank's `part` ([N] CPU, the same N and dtype on all ranks) into `out` ([W * N] CPU,
    on global rank `dst` only; None elsewhere) in global rank order: rank r's part lands in
    out[r*N:(r+1)*N]. `dst`'s own part may already be that slice of `out` (it is not copied
    then). Point to point over `group`, a gloo group over the whole world (`new_world_gloo_group`;
    None: one rank): the others send, `dst` receives straight into `out`, so no rank allocates
    anything (gloo's gather would stage a flat [W * N] copy on `dst` first). Call on every rank
    of `group`, in the same order. No autograd."""
    if rank() == dst:
        slots = out.view(world_size(), -1)
        if slots[dst].data_ptr() != part.data_ptr():
            slots[dst].copy_(part)
        if group is None:
            return
        receives = [dist.irecv(slots[src], src=src, group=group)
                    for src in range(world_size()) if src != dst]
        for receive in receives:
            receive.wait()
    elif group is not None:
        dist.send(part.contiguous(), dst=dst, group=group)


def broadcast_object(obj: Any) -> Any:
    """Global rank 0's `obj` (any picklable value; the other ranks pass None), on every rank of
    the world. No autograd; under NCCL the bytes travel through this rank's GPU."""
    if not is_initialized() or world_size() == 1:
        return obj
    holder = [obj if rank() == 0 else None]
    on_nccl = dist.get_backend() == "nccl"
    dist.broadcast_object_list(holder, src=0, device=torch.device(
        "cuda", torch.cuda.current_device()) if on_nccl else None)
    return holder[0]


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


class _AllReduceSum(torch.autograd.Function):
    """Forward: the sum over the group. Backward: the sum of the incoming gradients over the group."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(tensor.contiguous().clone(), dist.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.contiguous().clone(), dist.ReduceOp.SUM, ctx.group), None


def all_reduce_sum_autograd(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of every rank's `tensor` over `group` (same shape on all ranks), out of place.

    Backward hands every rank the sum of all ranks' incoming gradients: when each rank backpropagates
    its own loss term through the sum, each input receives the gradient of every term. Every rank of
    the group must run the backward, so with grad enabled the sum joins the graph even where this
    rank's `tensor` needs no gradient (a shard holding none of a sample's targets): its backward
    still runs the all-reduce its peers wait in.
    """
    if group_size(group) == 1:
        return tensor
    if torch.is_grad_enabled() and not tensor.requires_grad:
        tensor = tensor.detach().requires_grad_()
    return _AllReduceSum.apply(tensor, group)


def keep_in_graph(out: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """`out`, made to depend (with weight zero) on collective outputs this rank did not use.

    The backward of a differentiable collective is itself a collective: every rank must run it.
    A rank that gathered values it has no use for (say, rank 0, which has no predecessor) ties
    them to its output so its backward still reaches the collective.
    """
    for t in gathered:
        out = out + 0.0 * t.sum().to(out.dtype)
    return out


def _all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                     group: ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Forward: variable-size all-to-all of rows. Backward: the same exchange in reverse."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return _all_to_all_rows(rows, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all_rows(grad, ctx.recv_counts, ctx.send_counts, ctx.group), None, None, None


def all_to_all_rows_autograd(
    rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Variable-size all-to-all of rows: [N_send, F] -> [N_recv, F].

    `rows` holds send_counts[0] rows for SP rank 0, then send_counts[1] for rank 1, and so on
    (N_send = sum(send_counts)); the result holds recv_counts[0] rows from rank 0, then
    recv_counts[1] from rank 1, ... (N_recv = sum(recv_counts)). recv_counts[s] on this rank must
    equal send_counts[this rank] on rank s; counts may be 0, and a rank may send or receive
    nothing. Backward sends each row's gradient back to the rank the row came from.

    Every rank of the group must call it, and when the exchange is differentiable on one rank
    (`rows` requires grad) it must be on all, so that every rank runs the backward exchange.
    """
    p = group_size(group)
    if len(send_counts) != p or len(recv_counts) != p:
        raise ValueError(f"all-to-all needs one send and one receive count per rank ({p}), got "
                         f"{len(send_counts)} and {len(recv_counts)}")
    if rows.shape[0] != sum(send_counts):
        raise ValueError(f"all-to-all sends {sum(send_counts)} rows (counts {list(send_counts)}) "
                         f"but got a tensor of {rows.shape[0]}")
    if p == 1:
        return rows
    return _AllToAllRows.apply(rows, list(send_counts), list(recv_counts), group)


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


class Rendezvous:
    """A key-value store that trainer rank 0 hosts for groups made outside the training world
    (a weight push: the trainer ranks and an inference engine's workers). Rank 0 serves it at a
    free port on the one address `bind` (its socket bound there: nothing on another interface
    can reach it), or on every interface for "0.0.0.0"; the other ranks join it at that address,
    or at rank 0's address as the launcher set it (MASTER_ADDR) when it listens everywhere. No
    authentication: whoever reaches the port can read and write its keys. Build it on every rank
    at the same point (`open`: the address travels over the default group); later use needs no
    collective of the training world."""

    def __init__(self, store: dist.Store, host: str, port: int, timeout_s: float):
        self.store, self.host, self.port, self.timeout_s = store, host, port, timeout_s

    @classmethod
    def open(cls, timeout_s: float, bind: str | None = "0.0.0.0") -> Rendezvous:
        """`bind`: the address rank 0 listens on (read on rank 0 only)."""
        timeout = timedelta(seconds=timeout_s)
        store = None
        if rank() == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind or "0.0.0.0", 0))
            listener.listen()
            store = dist.TCPStore(bind or "0.0.0.0", listener.getsockname()[1], is_master=True,
                                  timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=listener.detach())
            address = (None if bind in (None, "0.0.0.0") else bind, store.port)
        else:
            address = None
        host, port = broadcast_object(address)
        host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        return cls(store, host, port, timeout_s)

    def put(self, key: str, value: str) -> None:
        self.store.set(key, value)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the interface that reaches `host`:`port` (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return str(sock.getsockname()[0])
