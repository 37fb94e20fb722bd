"""The gated delta-rule recurrence over packed segments: one entry point, a kernel per device.

Each segment is an independent sequence with its own initial state. On CPU the segments run one
by one through `chunked_delta_rule`, vlmcp's own pure-torch chunked kernel; on CUDA they run in
one flash-linear-attention varlen call (`cu_seqlens`).

`chunked_delta_rule` computes what transformers' pure-torch `torch_chunk_gated_delta_rule` (the
unsharded reference on a machine without triton) computes, with the same operations in the same
order so fp32 rounding stays close, but its autograd graph is linear in the sequence length: the
chunk axis is split once (`unbind`, whose backward is one `stack`) and the per-chunk outputs are
gathered in a list and stacked once. transformers' kernel indexes chunk i of full-length tensors
and writes into a full-length output in place, so its backward materialises a full-length
gradient per chunk (quadratic in L).

The math, per value head and chunk of C = 64 tokens (G the cumulative log decay inside the chunk,
D[i, j] = exp(G_i - G_j) for j <= i and 0 above the diagonal, k_b = beta k, v_b = beta v):
T = (I + strictly_lower(k_b k^T * D))^-1 (a unit triangular solve), u = T v_b,
w = T (k_b exp(G)); then chunk by chunk from the state S [K, V]: v_new = u - w S,
o = (q exp(G)) S + (q k^T * D) v_new, S <- exp(G_last) S + (k exp(G_last - G))^T v_new.

Legend: L tokens, H_k key heads, H_v value heads (a multiple of H_k), K key dim, V value dim,
N segments, C chunk size, M chunks in a segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2NORM_EPS = 1e-6


def delta_rule_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    initial_states: list[torch.Tensor | None],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the gated delta rule (q/k L2-normalised in the kernel, scale K^-1/2) per segment.

    q, k: [L, H_k, K]; v: [L, H_v, V]; g (log decay), beta: [L, H_v]; lengths: N segment lengths
    summing to L; initial_states: N entries of [H_v, K, V] or None (zero state).
    Returns (out [L, H_v, V], final states: N tensors [H_v, K, V], fp32).
    """
    if q.is_cuda:
        return _fla_varlen(q, k, v, g, beta, lengths, initial_states)
    outs, finals, start = [], [], 0
    for length, init in zip(lengths, initial_states):
        sl = slice(start, start + length)
        out, final = chunked_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], init)
        outs.append(out)
        finals.append(final)
        start += length
    return torch.cat(outs, dim=0), finals


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment of the gated delta rule in pure torch, fp32 inside, linear in L both ways.

    q, k: [L, H_k, K]; v: [L, H_v, V]; g (log decay), beta: [L, H_v]; initial_state:
    [H_v, K, V] or None (zeros). Key head j serves value heads j*H_v/H_k ... (j+1)*H_v/H_k - 1.
    Returns (out [L, H_v, V] in q's dtype, final state [H_v, K, V] fp32).
    """
    dtype, length = q.dtype, q.shape[0]
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
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    # [H_v, M, C, D] and [H_v, M, C]
    q, k, k_beta, v_beta = (t.reshape(heads, -1, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(heads, -1, CHUNK).cumsum(dim=-1)

    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
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

    state = (
        q.new_zeros(heads, kdim, vdim) if initial_state is None else initial_state.to(torch.float32)
    )
    chunks = zip(*(t.unbind(1) for t in (u, w, q_decayed, intra, k_decayed, chunk_decay)))
    outs = []
    for u_c, w_c, q_c, intra_c, k_c, decay_c in chunks:
        v_new = u_c - w_c @ state
        outs.append(q_c @ state + intra_c @ v_new)
        state = state * decay_c + k_c.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=1).reshape(heads, -1, vdim)[:, :length]
    return out.transpose(0, 1).to(dtype, memory_format=torch.contiguous_format), state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the eps placement of transformers' and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _fla_varlen(q, k, v, g, beta, lengths, initial_states):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    heads, kdim, vdim = v.shape[1], q.shape[-1], v.shape[-1]
    zero = q.new_zeros(heads, kdim, vdim, dtype=torch.float32)
    init = torch.stack([zero if s is None else s.float() for s in initial_states])
    cu = torch.tensor([0] + lengths, device=q.device).cumsum(0)
    out, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None].float(),
        beta=beta[None],
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    return out[0], list(final.unbind(0))
