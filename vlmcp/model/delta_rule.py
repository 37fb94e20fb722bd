"""vlmcp's pure-torch Gated DeltaNet core: the causal conv, its activation and the chunked gated
delta rule over packed segments, as one autograd function that keeps little for backward.

What it saves: its inputs (the pre-conv channels `mixed`, the conv weight and bias, the gates g and
beta, the initial states) and one [H_v, K, V] state every `stretch` chunks. Everything else (the
conv output, q/k/v, the intra-chunk triangular systems, the per-chunk states) is recomputed in
backward, one stretch at a time: the stretch's forward runs again under autograd from its saved
starting state, and its backward hands the state gradient to the stretch before it. The pre-conv
channels are exactly as large as q, k and v together, so this keeps what fla's kernel keeps
(q, k, v, g, beta, A), minus A, plus the sparse states: at Qwen3.5-35B-A3B's DeltaNet layout
(16 key / 32 value heads of 128) 32 KiB per token for `mixed`, 2 KiB for the states (one 2 MiB
state per 16 x 64 tokens), 0.25 KiB for the gates, against 409 KiB for autograd's own graph of the
same ops. Backward holds one stretch's graph at a time (about 409 MiB at that layout).

The math, per value head and chunk of C tokens (G the cumulative log decay inside the chunk,
D[i, j] = exp(G_i - G_j) for j <= i and 0 above the diagonal, k_b = beta k, v_b = beta v):
T = (I + strictly_lower(k_b k^T * D))^-1 (a unit triangular solve), u = T v_b,
w = T (k_b exp(G)); then chunk by chunk from the state S [K, V]: v_new = u - w S,
o = (q exp(G)) S + (q k^T * D) v_new, S <- exp(G_last) S + (k exp(G_last - G))^T v_new.
These are the operations of transformers' `torch_chunk_gated_delta_rule` in the same order, so
fp32 rounding stays close to plain transformers'.

Legend: L tokens, H_k key heads, H_v value heads (a multiple of H_k), K key dim, V value dim,
C_in = 2 H_k K + H_v V pre-conv channels, w + 1 conv taps, N segments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

#: Tokens per chunk of the chunked recurrence (fla's and transformers' chunk size).
CHUNK = 64
#: Chunks per saved state: backward recomputes this many chunks (1,024 tokens) at a time. Each
#: stretch costs a recompute setup and an autograd call: at 16k tokens on the tiny bench layout
#: (2 key / 4 value heads of 16) the core's forward+backward took 24-28 s with 4-chunk stretches,
#: 15.5 s with 16, 13.7-17.4 s for the old all-graph kernel (one process, loaded machine).
STRETCH_CHUNKS = 16
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class HeadLayout:
    """How the channels of `mixed` split into q [H_k, K], k [H_k, K] and v [H_v, V]."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def split(self) -> list[int]:
        keys = self.key_heads * self.key_dim
        return [keys, keys, self.value_heads * self.value_dim]


@dataclass(frozen=True)
class _Spec:
    """The static arguments of one call of the core."""

    lengths: tuple[int, ...]
    layout: HeadLayout
    #: The conv's activation; None when `mixed` is q|k|v already (no conv).
    activation: Callable[[torch.Tensor], torch.Tensor] | None
    #: Conv taps - 1 (0 without a conv).
    width: int
    #: Zero value columns appended to v (the affine pass of the DeltaNet hook's state chain).
    value_pad: int
    chunk: int
    stretch: int


def conv_delta_rule(
    mixed: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    left_context: torch.Tensor | None,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    initial_states: list[torch.Tensor | None],
    layout: HeadLayout,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
    value_pad: int = 0,
    chunk: int = CHUNK,
    stretch: int = STRETCH_CHUNKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """conv -> activation -> split -> gated delta rule (q/k L2-normalised, q scaled by K^-1/2),
    restarted at every segment, in pure torch (fp32 inside).

    mixed: [L, C_in] pre-conv channels q|k|v; weight: [C_in, 1, w+1] depthwise conv, or None when
    `mixed` is q|k|v itself (then `activation` is None too); bias: [C_in] or None; left_context:
    [w, C_in] rows before the first segment (None: zeros, as before every other segment);
    g (log decay), beta: [L, H_v]; lengths: N segment lengths summing to L; initial_states: N
    entries [H_v, K, V + value_pad] or None (zero state). Key head j serves value heads
    j*H_v/H_k ... (j+1)*H_v/H_k - 1. chunk: tokens per chunk; stretch: chunks per saved state.
    Returns (out [L, H_v, V + value_pad] in mixed's dtype, final states [N, H_v, K, V + value_pad]
    fp32).
    """
    if len(lengths) != len(initial_states) or sum(lengths) != mixed.shape[0]:
        raise ValueError(f"{len(initial_states)} initial states and segments {lengths} for "
                         f"{mixed.shape[0]} tokens")
    width = 0 if weight is None else weight.shape[-1] - 1
    spec = _Spec(tuple(lengths), layout, activation, width, value_pad, chunk, stretch)
    return _ConvDeltaRule.apply(spec, mixed, weight, bias, left_context, g, beta, *initial_states)


class _ConvDeltaRule(torch.autograd.Function):
    """`conv_delta_rule` with a stretch-wise recomputing backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, spec: _Spec, mixed, weight, bias, left, g, beta, *inits):
        outs, finals, starts = [], [], []
        for segment, stretches in enumerate(_stretches(spec)):
            state = _initial(inits[segment], spec, mixed)
            for index, (lo, a, b) in enumerate(stretches):
                if index:
                    starts.append(state)
                out, state = _stretch(spec, mixed[lo:b], _prefix(spec, left, mixed, segment, lo, a),
                                      weight, bias, g[a:b], beta[a:b], state)
                outs.append(out)
            finals.append(state)
        ctx.spec = spec
        ctx.save_for_backward(mixed, weight, bias, left, g, beta,
                              torch.stack(starts) if starts else None, *inits)
        return torch.cat(outs).to(mixed.dtype), torch.stack(finals)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_finals):
        spec = ctx.spec
        mixed, weight, bias, left, g, beta, starts, *inits = ctx.saved_tensors
        need_mixed, need_weight, need_bias, need_left, need_g, need_beta = ctx.needs_input_grad[1:7]
        need_inits = ctx.needs_input_grad[7:]
        grads = [torch.zeros_like(t) if need else None
                 for t, need in zip((mixed, weight, bias, left, g, beta), ctx.needs_input_grad[1:7])]
        d_mixed, d_weight, d_bias, d_left, d_g, d_beta = grads
        d_inits: list[torch.Tensor | None] = [None] * len(inits)
        weight_leaf, bias_leaf = _leaf(weight, need_weight), _leaf(bias, need_bias)
        remaining = 0 if starts is None else starts.shape[0]
        for segment, stretches in reversed(list(enumerate(_stretches(spec)))):
            d_state = grad_finals[segment]
            for index in reversed(range(len(stretches))):
                lo, a, b = stretches[index]
                if index:
                    remaining -= 1
                    state = starts[remaining].detach().requires_grad_(True)
                else:
                    tracked = inits[segment] is not None and need_inits[segment]
                    state = _initial(inits[segment], spec, mixed).detach().requires_grad_(tracked)
                rows = _leaf(mixed[lo:b], need_mixed)
                prefix = _prefix(spec, left, mixed, segment, lo, a)
                prefix = _leaf(prefix, need_left and segment == 0 and left is not None)
                g_part, beta_part = _leaf(g[a:b], need_g), _leaf(beta[a:b], need_beta)
                leaves = [t for t in (rows, prefix, weight_leaf, bias_leaf, g_part, beta_part, state)
                          if t is not None and t.requires_grad]
                with torch.enable_grad():
                    out, end = _stretch(spec, rows, prefix, weight_leaf, bias_leaf, g_part,
                                        beta_part, state)
                    found = torch.autograd.grad((out.to(mixed.dtype), end), leaves,
                                                (grad_out[a:b], d_state), allow_unused=True)
                grad_of = {id(t): grad for t, grad in zip(leaves, found) if grad is not None}
                for total, leaf, where in ((d_mixed, rows, slice(lo, b)), (d_weight, weight_leaf, ...),
                                           (d_bias, bias_leaf, ...), (d_g, g_part, slice(a, b)),
                                           (d_beta, beta_part, slice(a, b))):
                    if total is not None and id(leaf) in grad_of:
                        total[where] += grad_of[id(leaf)]
                if d_left is not None and id(prefix) in grad_of:
                    d_left[left.shape[0] - prefix.shape[0]:] += grad_of[id(prefix)]
                d_state = grad_of.get(id(state))
            if inits[segment] is not None and need_inits[segment]:
                d_inits[segment] = d_state
        return (None, *grads, *d_inits)


def _leaf(t: torch.Tensor | None, requires_grad: bool) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(requires_grad)


def _stretches(spec: _Spec) -> list[list[tuple[int, int, int]]]:
    """Per segment, its stretches (lo, a, b): tokens [a, b) of `spec.stretch` chunks (fewer at the
    segment's end), whose conv reads rows [lo, b) of the segment (lo = max(segment start, a - w))."""
    span = spec.chunk * spec.stretch
    out, start = [], 0
    for length in spec.lengths:
        stop = start + length
        out.append([(max(start, a - spec.width), a, min(a + span, stop)) for a in range(start, stop, span)])
        start = stop
    return out


def _initial(init: torch.Tensor | None, spec: _Spec, like: torch.Tensor) -> torch.Tensor:
    """A segment's starting state, fp32 [H_v, K, V + value_pad] (zeros for None)."""
    if init is not None:
        return init.to(torch.float32)
    layout = spec.layout
    return like.new_zeros(layout.value_heads, layout.key_dim, layout.value_dim + spec.value_pad,
                          dtype=torch.float32)


def _prefix(spec: _Spec, left: torch.Tensor | None, mixed: torch.Tensor, segment: int, lo: int,
            a: int) -> torch.Tensor | None:
    """The conv rows before row `lo` that the stretch starting at `a` reads, [w - (a - lo), C_in]:
    the left context's tail (first segment) or zeros. None when it reads no row before `lo`."""
    missing = spec.width - (a - lo)
    if missing <= 0:
        return None
    if segment == 0 and left is not None:
        return left[left.shape[0] - missing:]
    return mixed.new_zeros(missing, mixed.shape[1])


def _stretch(spec: _Spec, rows: torch.Tensor, prefix: torch.Tensor | None,
             weight: torch.Tensor | None, bias: torch.Tensor | None, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One stretch: rows [lead + n, C_in] (its n tokens after `lead` conv-context rows), prefix
    [w - lead, C_in] or None; g, beta: [n, H_v]; state [H_v, K, V'] fp32.
    Returns (out [n, H_v, V'] fp32, end state [H_v, K, V'] fp32)."""
    if spec.activation is None:
        act = rows
    else:
        window = rows if prefix is None else torch.cat([prefix, rows])
        conv = F.conv1d(window.to(weight.dtype).t().unsqueeze(0), weight, bias, groups=window.shape[1])
        act = spec.activation(conv[0].t().to(rows.dtype))
    layout, n = spec.layout, act.shape[0]
    q, k, v = act.split(layout.split, dim=-1)
    q = q.reshape(n, layout.key_heads, layout.key_dim)
    k = k.reshape(n, layout.key_heads, layout.key_dim)
    v = v.reshape(n, layout.value_heads, layout.value_dim)
    if spec.value_pad:
        v = F.pad(v, (0, spec.value_pad))
    return _recurrence(q, k, v, g, beta, state, spec.chunk)


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule on n tokens from `state`: q, k [n, H_k, K]; v [n, H_v, V];
    g, beta [n, H_v]; state [H_v, K, V] fp32. Returns (out [n, H_v, V] fp32, end state fp32).

    The chunk axis is split once (`unbind`) and the chunks' outputs stacked once, so the graph a
    backward recomputes is linear in n."""
    length = q.shape[0]
    heads, kdim, vdim = v.shape[1], q.shape[-1], v.shape[-1]
    groups = heads // q.shape[1]
    if groups != 1:
        q = q.repeat_interleave(groups, dim=1)
        k = k.repeat_interleave(groups, dim=1)
    q, k, v, g, beta = (
        t.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
        for t in (q, k, v, g, beta)
    )
    q = _l2norm(q) * kdim**-0.5
    k = _l2norm(k)
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    # [H_v, M, C, D] and [H_v, M, C]
    q, k, k_beta, v_beta = (t.reshape(heads, -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, -1, chunk).cumsum(dim=-1)

    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    chunks = zip(*(t.unbind(1) for t in (u, w, q_decayed, intra, k_decayed, chunk_decay)))
    outs = []
    for u_c, w_c, q_c, intra_c, k_c, decay_c in chunks:
        v_new = u_c - w_c @ state
        outs.append(q_c @ state + intra_c @ v_new)
        state = state * decay_c + k_c.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=1).reshape(heads, -1, vdim)[:, :length]
    return out.transpose(0, 1), state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the eps placement of transformers' and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)
