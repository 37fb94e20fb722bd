"""The vectorized varlen causal conv equals a depthwise F.conv1d run on every segment alone (w zeros
or the halo before it), forward and backward, with many short segments and segments shorter than
the kernel. CPU, fp32: within fp32's own error (`assert_within_fp32_error`) of the per-segment
F.conv1d in float64, the same conv in fp32 being the fp32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.parity import assert_within_fp32_error
from vlmcp.model.causal_conv import causal_conv_segments

CHANNELS = 6
# segments of 1 and 2 tokens are shorter than the halo of a 4-tap kernel (w = 3)
LENGTHS = [1, 2, 5, 1, 1, 3, 7, 2, 4, 1, 9, 3]


def _per_segment_conv(x, weight, bias, lengths, left_context):
    """Reference: one F.conv1d per segment over [context or zeros (w rows); segment]."""
    width = weight.shape[-1] - 1
    outs, start = [], 0
    for i, n in enumerate(lengths):
        seg = x[start : start + n]
        before = left_context if i == 0 and left_context is not None else seg.new_zeros(width, seg.shape[1])
        inp = torch.cat([before, seg], dim=0).t().unsqueeze(0)
        outs.append(F.conv1d(inp, weight, bias, groups=weight.shape[0])[0].t())
        start += n
    return torch.cat(outs, dim=0)


def _leaves(kernel: int, halo: bool, with_bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENGTHS), CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, 1, kernel, generator=gen)
    bias = torch.randn(CHANNELS, generator=gen) if with_bias else None
    context = torch.randn(kernel - 1, CHANNELS, generator=gen) if halo else None
    grad_out = torch.randn(sum(LENGTHS), CHANNELS, generator=gen)
    return [x, weight, bias, context], grad_out


def _run(fn, leaves, grad_out, dtype=torch.float32):
    leaves = [None if t is None else t.to(dtype, copy=True).requires_grad_(True) for t in leaves]
    grad_out = grad_out.to(dtype)
    x, weight, bias, context = leaves
    out = fn(x, weight, bias, LENGTHS, context)
    (out * grad_out).sum().backward()
    return out.detach(), [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("halo", [False, True], ids=["no_halo", "halo"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_vectorized_conv_equals_per_segment_conv1d(kernel, halo, with_bias):
    leaves, grad_out = _leaves(kernel, halo, with_bias, seed=kernel + 2 * halo + 4 * with_bias)
    out, grads = _run(causal_conv_segments, leaves, grad_out)
    ref32_out, ref32_grads = _run(_per_segment_conv, leaves, grad_out)
    ref_out, ref_grads = _run(_per_segment_conv, leaves, grad_out, torch.float64)
    assert_within_fp32_error(out, ref32_out, ref_out, name="out")
    for name, grad, ref32, ref in zip(["x", "weight", "bias", "left_context"], grads, ref32_grads, ref_grads):
        if ref is not None:
            assert_within_fp32_error(grad, ref32, ref, name=name)

