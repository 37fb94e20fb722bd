"""On CUDA, the flash-linear-attention varlen kernel and the attention core agree with the CPU
pure-torch path (the one the parity tests pin to plain transformers), forward and backward.

Skipped where there is no GPU (CI). Run on a GPU machine with flash-linear-attention and triton:
`python -m pytest -q tests/test_cuda_kernels.py`."""

from __future__ import annotations

import pytest
import torch

from tests.parity import rel_err
from vlmcp.model.attention import varlen_causal_attention
from vlmcp.model.delta_rule import delta_rule_segments

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [70, 5, 130, 64]


def _delta_inputs(gen):
    n, hk, hv, k, v = sum(LENGTHS), 2, 4, 32, 32
    q = torch.randn(n, hk, k, generator=gen)
    kk = torch.randn(n, hk, k, generator=gen)
    vv = torch.randn(n, hv, v, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 2
    beta = torch.rand(n, hv, generator=gen)
    init = torch.randn(hv, k, v, generator=gen) * 0.1
    return [q, kk, vv, g, beta], init


def _run_delta(tensors, init, device):
    leaves = [t.to(device).requires_grad_(True) for t in tensors]
    state = init.to(device).requires_grad_(True)
    inits = [state] + [None] * (len(LENGTHS) - 1)
    out, finals = delta_rule_segments(*leaves, LENGTHS, inits)
    (out.float().square().sum() + sum(f.square().sum() for f in finals)).backward()
    return out.float().cpu(), [t.grad.float().cpu() for t in leaves + [state]]


def test_fla_varlen_delta_rule_matches_cpu_reference():
    tensors, init = _delta_inputs(torch.Generator().manual_seed(0))
    out_cpu, grads_cpu = _run_delta(tensors, init, "cpu")
    out_gpu, grads_gpu = _run_delta(tensors, init, "cuda")
    assert rel_err(out_gpu, out_cpu) <= 1e-3
    for g_gpu, g_cpu in zip(grads_gpu, grads_cpu):
        assert rel_err(g_gpu, g_cpu) <= 1e-3


def test_cuda_varlen_attention_matches_cpu_sdpa():
    gen = torch.Generator().manual_seed(1)
    cu = (0, 70, 75, 205, 269)
    q, k, v = (torch.randn(cu[-1], h, 64, generator=gen) for h in (8, 2, 2))
    expected = varlen_causal_attention(q, k, v, cu, scaling=64**-0.5)
    dtype = torch.bfloat16
    got = varlen_causal_attention(*(t.cuda().to(dtype) for t in (q, k, v)), cu, scaling=64**-0.5)
    assert rel_err(got.float().cpu(), expected) <= 2e-2
