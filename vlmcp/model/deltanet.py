"""The DeltaNet context-parallel hook: a sharded Gated DeltaNet layer that computes exactly what
the unsharded layer computes, in forward and backward.

A Gated DeltaNet layer is a depthwise causal conv1d over the q/k/v projections, then the gated
delta-rule recurrence, both of which must restart at every packed-sample boundary. Two modes:

"state" (default): every rank keeps its own tokens.
  * Conv halo: rank r prepends rank r-1's last (kernel-1) pre-conv tokens of the same sample; the
    conv restarts at every sample and runs inside the DeltaNet core (`vlmcp.model.deltanet_kernel`).
  * State chain: the recurrence is linear in its state, S_end = A S_start + B, with A [H_v, K, K]
    and B [H_v, K, V] over a rank's last segment. Each rank sends one payload in one all-gather
    per layer and chains its predecessors inside the same sample. Every token goes through the
    recurrence exactly once: a rank whose last segment starts inside its shard runs it from the
    zero state first (its final state is B); only a rank whose whole shard continues a sample
    into the next rank needs A, and gets it, together with its output as an affine function of
    the incoming state, from one pass with value columns [v | 0] from state [0 | I]. The scheme
    follows flash-linear-attention's `ops/cp` (`_chained_recurrence` has the details).
"heads": an all-to-all moves q/k/v/a/b to head-sharded layout ([S, H/P, D]); each rank runs the
  whole sequence for its heads, and a second all-to-all brings the output back. Needs the DeltaNet
  key and value head counts divisible by P.

The conv, its activation and the recurrence run as one core call per piece of the shard
(`deltanet_core`, the kernel `model.deltanet_kernel` chooses), so the pure-torch kernel keeps only
the pre-conv channels for backward.

Both modes read boundaries only from the batch's `ShardPlan` (global `seq_lens`). The hook is
installed per layer instance (`install_deltanet_hooks`), and a layer called without a plan runs its
original transformers forward (generation, plain inference).

Legend: S_local tokens on this rank, C = 2*H_k*K + H_v*V conv channels, H_k/H_v key/value heads,
K/V head dims, P SP size, w = kernel - 1 halo width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from vlmcp.model.delta_rule import HeadLayout
from vlmcp.model.deltanet_kernel import deltanet_core
from vlmcp.model.recompute import gated_norm_then_project
from vlmcp.parallel import comm
from vlmcp.parallel.modes import DELTANET_MODES
from vlmcp.parallel.shard import ShardPlan


def is_gated_deltanet(module: nn.Module) -> bool:
    """True for Qwen3.5's (dense or MoE) Gated DeltaNet token mixer."""
    return type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "in_proj_qkv")


def install_deltanet_hooks(model: nn.Module, mode: str = "state", kernel: str = "auto") -> list[nn.Module]:
    """Give every Gated DeltaNet layer of `model` the packed/sharded forward, its core run by
    `kernel` (`model.deltanet_kernel`). Returns the layers.

    The original forward stays in use whenever a call has no `shard_plan`. The hooked forward
    runs the layer's gated RMSNorm and `out_proj` as transformers does, under one checkpoint
    (`vlmcp.model.recompute.gated_norm_then_project`). Under ZeRO-3 the conv
    weight, which the forward reads directly, is registered as an external parameter of its layer
    so that DeepSpeed gathers it for the layer's forward.
    """
    if mode not in DELTANET_MODES:
        raise ValueError(f"parallel.deltanet_cp must be one of {DELTANET_MODES}, got {mode!r}")
    layers = [m for m in model.modules() if is_gated_deltanet(m)]
    for layer in layers:
        original = type(layer).forward.__get__(layer)
        layer.forward = functools.partial(_hooked_forward, layer, original, mode, kernel)
        if hasattr(layer.conv1d.weight, "ds_id"):
            import deepspeed

            deepspeed.zero.register_external_parameter(layer, layer.conv1d.weight)
    return layers


def uninstall_deltanet_hooks(layers: list[nn.Module]) -> None:
    """Restore the transformers forward on layers returned by `install_deltanet_hooks`."""
    for layer in layers:
        if "forward" in layer.__dict__:
            del layer.forward


def _hooked_forward(layer, original, mode, kernel, hidden_states, *args, shard_plan: ShardPlan | None = None,
                    **kwargs):
    if shard_plan is None:
        return original(hidden_states, *args, **kwargs)
    return sharded_deltanet_forward(layer, hidden_states, shard_plan, mode, kernel)


def sharded_deltanet_forward(
    layer: nn.Module, hidden_states: torch.Tensor, plan: ShardPlan, mode: str = "state",
    kernel: str = "auto",
) -> torch.Tensor:
    """[1, S_local, hidden] (this rank's shard) -> [1, S_local, hidden], as the unsharded layer
    would compute for these positions of the whole pack."""
    x = hidden_states[0]
    length = x.shape[0]
    mixed = layer.in_proj_qkv(x)
    z = layer.in_proj_z(x).reshape(length, -1, layer.head_v_dim)
    b = layer.in_proj_b(x)
    a = layer.in_proj_a(x)
    if mode == "heads":
        core = _heads_mode(layer, mixed, a, b, plan, kernel)
    else:
        core = _state_mode(layer, mixed, a, b, plan, kernel)
    return gated_norm_then_project(layer.norm, layer.out_proj, core.reshape(length, -1, layer.head_v_dim),
                                   z).unsqueeze(0)


def _gates(layer: nn.Module, a: torch.Tensor, b: torch.Tensor, heads: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [L, h] for value heads `heads`: log decay and write strength, as transformers computes them."""
    g = -layer.A_log[heads].float().exp() * F.softplus(a.float() + layer.dt_bias[heads])
    return g, b.sigmoid()


def conv_halo(mixed: torch.Tensor, plan: ShardPlan, width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The previous rank's last `width` pre-conv tokens of this rank's first sample.

    mixed: [S_local, C]. Returns (halo [w, C] or None when the shard starts a sample, all ranks'
    tails [P, w, C]). Rows of the halo that belong to another sample are zeros. Every rank takes
    part; gradients flow back to the rank that owns the tokens.
    """
    tails = comm.all_gather_autograd(mixed[-width:], plan.group)
    first = plan.local_segments[0]
    if not first.continues:
        return None, tails
    halo = tails[plan.rank - 1]
    foreign = width - min(width, first.offset)
    if foreign:
        halo = torch.cat([halo.new_zeros(foreign, halo.shape[1]), halo[foreign:]], dim=0)
    return halo, tails


@dataclass(frozen=True)
class _Core:
    """The DeltaNet core of one layer: conv weights, head layout, activation and kernel."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    layout: HeadLayout
    activation: Any
    kernel: str

    def __call__(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lengths: list[int],
                 inits: list[torch.Tensor | None], left: torch.Tensor | None = None,
                 value_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """mixed: [L, C] pre-conv channels of whole segments `lengths`; left: [w, C] rows before the
        first (None: it starts a sample). Returns (out [L, H_v, V + value_pad], finals [N, H_v, K, V + value_pad])."""
        return deltanet_core(mixed, self.weight, self.bias, left, g, beta, lengths, inits, self.layout,
                             self.activation, self.kernel, value_pad)


def _state_mode(layer: nn.Module, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: ShardPlan,
                kernel: str) -> torch.Tensor:
    """Sequence-sharded DeltaNet: conv halo + state chain. Returns core output [S_local, H_v, V]."""
    lengths = [s.length for s in plan.local_segments]
    halo, tails = (None, None) if plan.size == 1 else conv_halo(mixed, plan, layer.conv_kernel_size - 1)
    layout = HeadLayout(layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim)
    core = _Core(layer.conv1d.weight, layer.conv1d.bias, layout, ACT2FN[layer.activation], kernel)
    g, beta = _gates(layer, a, b, slice(None))
    if plan.size == 1:
        out, _ = core(mixed, g, beta, lengths, [None] * len(lengths))
        return out
    out, transfers = _chained_recurrence(core, mixed, halo, g, beta, plan)
    return comm.keep_in_graph(out, tails, transfers)


def runs_through(plan: ShardPlan, rank: int) -> bool:
    """Rank `rank`'s shard is one piece of a sample that started on an earlier rank."""
    pieces = plan.all_segments[rank]
    return len(pieces) == 1 and pieces[0].continues


def feeds_next(plan: ShardPlan, rank: int) -> bool:
    """The next rank's shard starts inside the sample that ends rank `rank`'s shard."""
    return rank + 1 < plan.size and plan.all_segments[rank + 1][0].continues


def relays(plan: ShardPlan, rank: int) -> bool:
    """Rank `rank` passes a state through: it needs its affine map A, not only its final state B."""
    return runs_through(plan, rank) and feeds_next(plan, rank)


def _chained_recurrence(core: _Core, mixed, halo, g, beta, plan: ShardPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over this rank's shard, chained to its predecessors, with each token in
    exactly one pass. mixed: [S_local, C] pre-conv channels; halo: [w, C] or None (the shard
    starts a sample); g, beta: [S_local, H_v].

    Every rank sends one [H_v, K, W] payload in one all-gather (W = V + K when some rank relays,
    else V) and receives all P of them ([P, H_v, K, W]):
      * a relay (`relays`): one augmented pass from state [0 | I] with values [v | 0] gives its
        zero-state output, the output's linear response to the incoming state, and [B | A];
        after the gather its output is o_zero + o_I @ S_in, with no second pass;
      * a rank running through to a sample's end: sends zeros, then one pass from S_in;
      * any other rank: its last segment starts inside the shard, so it runs that segment from
        the zero state first and sends the final state B (zeros if the next rank starts a new
        sample); after the gather it runs its other segments, the first from S_in.
    Returns (out [S_local, H_v, V], the gathered payloads, which the caller keeps in the graph).
    """
    segments, rank = plan.local_segments, plan.rank
    layout = core.layout
    vdim, kdim = layout.value_dim, layout.key_dim
    width = vdim + kdim if any(relays(plan, r) for r in range(plan.size)) else vdim
    last = segments[-1]
    if relays(plan, rank):
        zero_out, response, payload = _affine_pass(core, mixed, halo, g, beta)
    else:
        if not runs_through(plan, rank):
            tail = slice(last.start, last.stop)
            tail_out, finals = core(mixed[tail], g[tail], beta[tail], [last.length], [None],
                                    left=halo if last.start == 0 else None)
        if feeds_next(plan, rank):
            payload = F.pad(finals[0].float(), (0, width - vdim))
        else:
            # Nothing the next rank reads; tied to mixed so that this rank's gather joins the backward.
            zeros = mixed.new_zeros(layout.value_heads, kdim, width, dtype=torch.float32)
            payload = comm.keep_in_graph(zeros, mixed)

    transfers = comm.all_gather_autograd(payload, plan.group)
    s_in = incoming_state(transfers, plan, vdim)
    if relays(plan, rank):
        through = torch.einsum("lhk,hkv->lhv", response.float(), s_in.float())
        return (zero_out.float() + through).to(mixed.dtype), transfers
    if runs_through(plan, rank):
        out, _ = core(mixed, g, beta, [last.length], [s_in], left=halo)
        return out, transfers
    if len(segments) == 1:
        return tail_out, transfers
    head = slice(0, last.start)
    inits = [s_in] + [None] * (len(segments) - 2)
    lengths = [s.length for s in segments[:-1]]
    head_out, _ = core(mixed[head], g[head], beta[head], lengths, inits, left=halo)
    return torch.cat([head_out, tail_out], dim=0), transfers


def _affine_pass(core: _Core, mixed, halo, g, beta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One segment's output and state as affine functions of its initial state, in one pass.

    mixed: [L, C] (one segment, continuing from `halo`). The recurrence is linear in (values,
    initial state) jointly, so running it with values [v | 0] from state [0 | I] gives, for an
    initial state X [H_v, K, V], output o_zero + o_I @ X and final state A X + B. Returns
    (o_zero [L, H_v, V], o_I [L, H_v, K], [B | A] [H_v, K, V + K]).
    """
    layout = core.layout
    heads, kdim, vdim = layout.value_heads, layout.key_dim, layout.value_dim
    eye = torch.eye(kdim, dtype=torch.float32, device=mixed.device).expand(heads, kdim, kdim)
    init = torch.cat([eye.new_zeros(heads, kdim, vdim), eye], dim=-1)
    out, finals = core(mixed, g, beta, [mixed.shape[0]], [init], left=halo, value_pad=kdim)
    return out[..., :vdim], out[..., vdim:], finals[0].float()


def incoming_state(transfer: torch.Tensor, plan: ShardPlan, vdim: int) -> torch.Tensor | None:
    """State entering this rank's first segment, chained from its predecessors in the same sample.

    transfer: [P, H_v, K, W], rank j's payload: its final state B_j [H_v, K, V] in the first V
    columns and, when it relays, its map A_j [H_v, K, K] in the rest. Returns [H_v, K, V], or
    None when this rank's shard starts a sample.
    """
    state = None
    for r in range(plan.rank):
        final = transfer[r, ..., :vdim]
        state = transfer[r, ..., vdim:] @ state + final if relays(plan, r) else final
        if not feeds_next(plan, r):
            state = None
    return state


def _heads_mode(layer: nn.Module, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: ShardPlan,
                kernel: str) -> torch.Tensor:
    """Head-parallel DeltaNet: all-to-all to [S, H/P, D], whole sequence per head group, back.
    Returns core output [S_local, H_v, V]."""
    group, p, r = plan.group, plan.size, plan.rank
    hk, hv = layer.num_k_heads // p, layer.num_v_heads // p
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    n = mixed.shape[0]
    q, k = (t.reshape(n, -1, layer.head_k_dim) for t in (q, k))
    v = v.reshape(n, -1, layer.head_v_dim)
    q, k, v = (comm.seq_to_heads_autograd(t, group) for t in (q, k, v))
    a = comm.seq_to_heads_autograd(a.unsqueeze(-1), group).squeeze(-1)
    b = comm.seq_to_heads_autograd(b.unsqueeze(-1), group).squeeze(-1)
    kd, vd = layer.head_k_dim, layer.head_v_dim
    channels = torch.cat(
        [
            torch.arange(r * hk * kd, (r + 1) * hk * kd),
            layer.key_dim + torch.arange(r * hk * kd, (r + 1) * hk * kd),
            2 * layer.key_dim + torch.arange(r * hv * vd, (r + 1) * hv * vd),
        ]
    ).to(mixed.device)
    weight = layer.conv1d.weight.index_select(0, channels)
    bias = None if layer.conv1d.bias is None else layer.conv1d.bias.index_select(0, channels)
    total = q.shape[0]
    conv_in = torch.cat([q.reshape(total, -1), k.reshape(total, -1), v.reshape(total, -1)], dim=-1)
    lengths = list(plan.seq_lens)
    core = _Core(weight, bias, HeadLayout(hk, kd, hv, vd), ACT2FN[layer.activation], kernel)
    g, beta = _gates(layer, a, b, slice(r * hv, (r + 1) * hv))
    out, _ = core(conv_in, g, beta, lengths, [None] * len(lengths))
    return comm.heads_to_seq_autograd(out, group)
