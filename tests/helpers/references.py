"""Float64 references for the kernel tests, written from the definitions (no vlmcp, no library
kernel): causal softmax attention per segment, and the gated delta rule token by token.

Both take and return CPU tensors and are differentiable, so a test can compare forward outputs and
the gradients of the same loss. `dtype=torch.float32` evaluates the same definition in fp32: how
far a plain fp32 evaluation lands from float64 is fp32's own error, for `assert_within_fp32_error`.
Legend: S tokens, Hq/Hk query/key heads, D head dim; for the delta rule H_k key heads, H_v value
heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch


def causal_attention_f64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: tuple[int, ...], scale: float,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """q: [S, Hq, D], k, v: [S, Hk, D] -> [S, Hq, D]: softmax(q k^T * scale) v with a causal mask
    inside each segment [cu[i], cu[i+1]); query head h reads kv head h // (Hq / Hk)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[a:b].transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale
        future = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        outs.append((weights @ vs).transpose(0, 1))
    return torch.cat(outs, dim=0)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_f64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: list[int],
    initial_states: list[torch.Tensor | None],
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule per segment, one token at a time, in float64.

    q, k: [L, H_k, K]; v: [L, H_v, V]; g (log decay), beta: [L, H_v]; q and k are L2-normalised
    and q is scaled by K^-1/2; key head j serves value heads j*H_v/H_k ... Per token t and value
    head: S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t, with S [K, V]
    starting from the segment's initial state (zeros when None).
    Returns (out [L, H_v, V], final states: one [H_v, K, V] per segment).
    """
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    groups = v.shape[1] // q.shape[1]
    q = _l2norm(q).repeat_interleave(groups, dim=1) * q.shape[-1] ** -0.5
    k = _l2norm(k).repeat_interleave(groups, dim=1)
    outs, finals, start = [], [], 0
    for length, init in zip(lengths, initial_states):
        state = v.new_zeros(v.shape[1], q.shape[-1], v.shape[-1]) if init is None else init.to(dtype)
        for t in range(start, start + length):
            state = state * g[t].exp()[:, None, None]
            delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
            state = state + k[t][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        finals.append(state)
        start += length
    return torch.stack(outs), finals


def delta_rule_inputs(
    gen: torch.Generator, length: int, key_heads: int = 2, value_heads: int = 4, dim: int = 32
) -> list[torch.Tensor]:
    """Random fp32 (q, k, v, g, beta) for `gated_delta_rule_f64`: decays exp(g) in [e^-2, 1],
    beta in [0, 1] (well conditioned, so fp32 kernels agree with float64 to about 1e-6)."""
    q = torch.randn(length, key_heads, dim, generator=gen)
    k = torch.randn(length, key_heads, dim, generator=gen)
    v = torch.randn(length, value_heads, dim, generator=gen)
    g = -2 * torch.rand(length, value_heads, generator=gen)
    beta = torch.rand(length, value_heads, generator=gen)
    return [q, k, v, g, beta]
