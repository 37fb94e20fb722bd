"""On CUDA, each kernel vlmcp runs there agrees with a float64 reference computed on CPU, forward
and backward: the gated delta rule with per-segment initial states through vlmcp's pure-torch
kernel and through fla's varlen kernel (where the version gate allows fla; next to the pure-torch
CPU kernel, held to the same reference), the attention core (torch's `varlen_attn` in bf16,
flash-attn in bf16 when installed, fused sdpa in fp32, which must never take the flash branch),
and the DeltaNet causal conv (against its CPU run).

Marked `cuda`: the suite hides GPUs unless VLMCP_TEST_CUDA=1, so these run only under
`make gpu-check` (or `VLMCP_TEST_CUDA=1 pytest tests/cuda/test_cuda_kernels.py`).

fp32 bounds: fla's Triton kernels do fp32 dots in TF32 unless TRITON_F32_DEFAULT=ieee, and
`make gpu-check` sets it. With it the fp32 bound is 1e-4; without it the test holds fla to the
1e-2 that TF32 allows (fla's dk is 2.3e-3 off under TF32). cuDNN's TF32 is switched off for the
conv comparison.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.helpers.parity import rel_err
from tests.helpers.references import causal_attention_f64, delta_rule_inputs, gated_delta_rule_f64
from vlmcp.model import attention
from vlmcp.model.attention import flash_kernels_apply, varlen_causal_attention
from vlmcp.model.causal_conv import causal_conv_segments
from vlmcp.model.deltanet_kernel import delta_rule_segments, installed_fla_problem

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and VLMCP_TEST_CUDA=1 (make gpu-check)"),
]

IEEE = os.environ.get("TRITON_F32_DEFAULT") == "ieee"
FLA_FP32_TOL = 1e-4 if IEEE else 1e-2
BF16_TOL = 2e-2  # bf16 has 8 bits of mantissa: 4e-3 per rounding
LENGTHS = [70, 5, 130, 64]
CU = (0, 70, 75, 205, 269)


def _values_and_grads(fn, tensors, weights, device):
    """fn on CPU leaves moved to `device`: (outputs, input gradients), float64 on CPU.
    The loss is sum(output_i * weight_i), so every output receives a gradient."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    outs = fn(*(t.to(device) for t in leaves))
    sum(((o.double().cpu() * w).sum() for o, w in zip(outs, weights))).backward()
    return [o.detach().double().cpu() for o in outs], [t.grad.double() for t in leaves]


def _assert_close(got, expected, tol, what):
    for i, (a, b) in enumerate(zip(got, expected)):
        assert rel_err(a, b) <= tol, f"{what}[{i}]: rel err {rel_err(a, b):.2e} > {tol:.0e}"


def _delta(q, k, v, g, beta, s0, s1, rule=delta_rule_segments, kernel="torch"):
    if rule is delta_rule_segments:
        out, finals = rule(q, k, v, g, beta, LENGTHS, [s0, None, s1, None], kernel=kernel)
    else:
        out, finals = rule(q, k, v, g, beta, LENGTHS, [s0, None, s1, None])
    return [out, *finals]


@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_cuda_delta_rule_equals_float64_recurrence(kernel):
    """On CUDA: vlmcp's pure-torch kernel always; fla's varlen kernel where the version gate lets
    `auto` choose it (else skipped, with the gate's reason)."""
    if kernel == "fla":
        problem = installed_fla_problem(torch.device("cuda", 0))
        if problem:
            pytest.skip(f"fla gated: {problem}")
    gen = torch.Generator().manual_seed(0)
    tensors = delta_rule_inputs(gen, sum(LENGTHS)) + [0.1 * torch.randn(4, 32, 32, generator=gen) for _ in range(2)]
    weights = [torch.randn(sum(LENGTHS), 4, 32, dtype=torch.float64, generator=gen)]
    weights += [torch.randn(4, 32, 32, dtype=torch.float64, generator=gen) for _ in LENGTHS]
    exact = [t.double() for t in tensors]
    truth = _values_and_grads(lambda *t: _delta(*t, rule=gated_delta_rule_f64), exact, weights, "cpu")
    torch_cpu = _values_and_grads(_delta, tensors, weights, "cpu")
    on_cuda = _values_and_grads(lambda *t: _delta(*t, kernel=kernel), tensors, weights, "cuda")
    for got, name in ((torch_cpu, "pure torch (CPU)"), (on_cuda, f"{kernel} (CUDA)")):
        _assert_close(got[0], truth[0], FLA_FP32_TOL, f"{name} outputs")
        _assert_close(got[1], truth[1], FLA_FP32_TOL, f"{name} grads of q, k, v, g, beta, states")


def _attention_inputs(dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(dim)
    tensors = [torch.randn(CU[-1], h, dim, generator=gen).to(dtype) for h in (8, 2, 2)]
    weights = [torch.randn(CU[-1], 8, dim, dtype=torch.float64, generator=gen)]
    return tensors, weights


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("kernel", ["varlen_attn", "flash_attn"])
def test_bf16_flash_varlen_attention_matches_float64(kernel, dim, monkeypatch):
    if kernel == "flash_attn" and attention.flash_attn_varlen_func is None:
        pytest.skip("flash-attn is not installed")
    if kernel == "varlen_attn":
        if attention.varlen_attn is None:
            pytest.skip("this torch has no varlen_attn taking window_size and enable_gqa (torch < 2.13)")
        monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    tensors, weights = _attention_inputs(dim, torch.bfloat16)
    assert flash_kernels_apply(*(t.cuda().requires_grad_(True) for t in tensors), dropout=0.0)
    scale = dim**-0.5
    got = _values_and_grads(lambda *t: [varlen_causal_attention(*t, CU, scaling=scale)], tensors, weights, "cuda")
    exact = [t.double() for t in tensors]  # the same (rounded) input values, exact in float64
    ref = _values_and_grads(lambda *t: [causal_attention_f64(*t, CU, scale)], exact, weights, "cpu")
    _assert_close(got[0], ref[0], BF16_TOL, "output")
    _assert_close(got[1], ref[1], BF16_TOL, "grads of q, k, v")


@pytest.mark.parametrize("dim", [64, 256])
def test_fp32_attention_runs_fused_sdpa_never_flash(dim, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the flash-attn branch was taken for fp32 inputs")

    monkeypatch.setattr(attention, "flash_attn_varlen_func", refuse)
    tensors, weights = _attention_inputs(dim, torch.float32)
    assert not flash_kernels_apply(*(t.cuda() for t in tensors), dropout=0.0)
    scale = dim**-0.5
    fused = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):  # no math kernel: a fallback to it raises
        got = _values_and_grads(lambda *t: [varlen_causal_attention(*t, CU, scaling=scale)], tensors, weights, "cuda")
    exact = [t.double() for t in tensors]  # the same (rounded) input values, exact in float64
    ref = _values_and_grads(lambda *t: [causal_attention_f64(*t, CU, scale)], exact, weights, "cpu")
    _assert_close(got[0], ref[0], 1e-4, "output")
    _assert_close(got[1], ref[1], 1e-4, "grads of q, k, v")


def test_causal_conv_segments_on_cuda_match_cpu():
    gen = torch.Generator().manual_seed(3)
    channels, width, lengths = 24, 3, [7, 2, 40, 1, 30]
    tensors = [
        torch.randn(sum(lengths), channels, generator=gen),
        0.3 * torch.randn(channels, 1, width + 1, generator=gen),
        torch.randn(channels, generator=gen),
        torch.randn(width, channels, generator=gen),
    ]
    weights = [torch.randn(sum(lengths), channels, dtype=torch.float64, generator=gen)]

    def conv(x, weight, bias, left):
        return [causal_conv_segments(x, weight, bias, lengths, left)]

    cpu = _values_and_grads(conv, tensors, weights, "cpu")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        cuda = _values_and_grads(conv, tensors, weights, "cuda")
    _assert_close(cuda[0], cpu[0], 1e-5, "output")
    _assert_close(cuda[1], cpu[1], 1e-5, "grads of x, weight, bias, left context")
