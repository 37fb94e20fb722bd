"""The gated delta-rule recurrence over packed segments: one entry point, a kernel per device.

Each segment is an independent sequence with its own initial state. On CPU the segments run one
by one through transformers' pure-torch chunked kernel (the function the unsharded reference
runs on a machine without triton); on CUDA they run in one flash-linear-attention varlen call
(`cu_seqlens`).

transformers decorates `torch_chunk_gated_delta_rule` so that, wherever fla and triton import
(every CUDA torch install), the name calls fla's Triton kernel instead, even for CPU tensors.
`pure_torch_chunk_gated_delta_rule` is the undecorated function, so the CPU branch is pure torch
on every machine.

Legend: L tokens, H_k key heads, H_v value heads (a multiple of H_k), K key dim, V value dim,
N segments.
"""

from __future__ import annotations

import inspect

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

pure_torch_chunk_gated_delta_rule = inspect.unwrap(torch_chunk_gated_delta_rule)


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
        out, final = pure_torch_chunk_gated_delta_rule(
            q[None, sl],
            k[None, sl],
            v[None, sl],
            g=g[None, sl],
            beta=beta[None, sl],
            initial_state=None if init is None else init[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(out[0])
        finals.append(final[0])
        start += length
    return torch.cat(outs, dim=0), finals


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
