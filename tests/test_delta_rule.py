"""The CPU delta-rule kernel is transformers' own pure-torch function (never a kernel that
transformers swaps in when fla and triton import), and over packed segments with per-segment
initial states it equals a float64 token-by-token recurrence, forward and backward."""

from __future__ import annotations

import inspect

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from tests.parity import rel_err
from tests.references import delta_rule_inputs, gated_delta_rule_f64
from vlmcp.model.delta_rule import delta_rule_segments, pure_torch_chunk_gated_delta_rule

LENGTHS = [70, 5, 130, 64]


def test_cpu_kernel_is_the_undecorated_pure_torch_function():
    fn = pure_torch_chunk_gated_delta_rule
    assert not hasattr(fn, "__wrapped__")
    assert fn.__module__ == modeling_qwen3_5.__name__
    assert fn.__code__.co_name == "torch_chunk_gated_delta_rule"
    assert fn.__code__.co_filename == inspect.getsourcefile(modeling_qwen3_5)


def _run(fn, tensors, init):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    state = init.clone().requires_grad_(True)
    inits = [None, state, None, state * 0.5]
    out, finals = fn(*leaves, LENGTHS, inits)
    (out.double().square().sum() + sum(f.double().square().sum() for f in finals)).backward()
    return [out.detach().double()] + [f.detach().double() for f in finals], [t.grad.double() for t in leaves + [state]]


def test_cpu_delta_rule_segments_equal_float64_recurrence():
    gen = torch.Generator().manual_seed(0)
    tensors = delta_rule_inputs(gen, sum(LENGTHS))
    init = 0.1 * torch.randn(4, 32, 32, generator=gen)
    values, grads = _run(delta_rule_segments, tensors, init)
    ref_values, ref_grads = _run(gated_delta_rule_f64, tensors, init)
    for got, expected in zip(values + grads, ref_values + ref_grads):
        assert rel_err(got, expected) <= 1e-5
