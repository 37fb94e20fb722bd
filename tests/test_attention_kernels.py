"""The packed causal attention core on CPU: it equals a float64 causal softmax computed per
segment (forward and backward, GQA, several segments; fp32 within fp32's own error of it, the
definition evaluated in fp32 being the fp32 reference), it runs on sdpa's fused kernel, and no
tensor of segment x segment size is ever created, forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.parity import assert_within_fp32_error
from tests.helpers.references import causal_attention_f64
from vlmcp.model.attention import (
    cpu_backward_kv_heads,
    flash_kernels_apply,
    kv_groups_as_batch,
    varlen_attn_usable,
    varlen_causal_attention,
)

CU = (0, 5, 6, 23, 40)  # segments of 5, 1, 17 and 17 tokens


def _inputs(kv_heads: int, cu: tuple[int, ...] = CU, heads: int = 4, dim: int = 16):
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(cu[-1], heads, dim, generator=gen)
    k = torch.randn(cu[-1], kv_heads, dim, generator=gen)
    v = torch.randn(cu[-1], kv_heads, dim, generator=gen)
    weight = torch.randn(cu[-1], heads, dim, generator=gen, dtype=torch.float64)
    return [q, k, v], weight


def _out_and_grads(fn, tensors, weight):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    (out.double() * weight).sum().backward()
    return out.detach().double(), [t.grad.double() for t in leaves]


@pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def intra_op_threads(request):
    """torch's intra-op thread count for one test (with 2 and 3, CPU training repeats kv heads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_varlen_attention_equals_float64_causal_softmax_per_segment(kv_heads, intra_op_threads):
    tensors, weight = _inputs(kv_heads)
    scale = 0.3
    out, grads = _out_and_grads(lambda q, k, v: varlen_causal_attention(q, k, v, CU, scaling=scale), tensors, weight)
    ref, ref_grads = _out_and_grads(lambda q, k, v: causal_attention_f64(q, k, v, CU, scale), tensors, weight)
    ref32, ref32_grads = _out_and_grads(lambda q, k, v: causal_attention_f64(q, k, v, CU, scale, torch.float32),
                                        tensors, weight)
    assert_within_fp32_error(out, ref32, ref, name="out")
    for name, got, fp32, expected in zip("qkv", grads, ref32_grads, ref_grads, strict=True):
        assert_within_fp32_error(got, fp32, expected, name=name)


def test_cpu_training_hands_the_kernel_the_fewest_kv_heads_that_reach_the_thread_count():
    assert cpu_backward_kv_heads(q_heads=4, kv_heads=1, threads=1) == 1
    assert cpu_backward_kv_heads(q_heads=4, kv_heads=1, threads=2) == 2
    assert cpu_backward_kv_heads(q_heads=4, kv_heads=1, threads=3) == 4
    assert cpu_backward_kv_heads(q_heads=4, kv_heads=2, threads=2) == 2
    assert cpu_backward_kv_heads(q_heads=16, kv_heads=2, threads=5) == 8
    assert cpu_backward_kv_heads(q_heads=6, kv_heads=1, threads=4) == 6
    assert cpu_backward_kv_heads(q_heads=8, kv_heads=2, threads=16) == 8
    assert cpu_backward_kv_heads(q_heads=4, kv_heads=4, threads=8) == 4


class _FlashKvHeads(TorchDispatchMode):
    """Records the kv head count of every call of CPU's fused attention forward."""

    def __init__(self):
        super().__init__()
        self.kv_heads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.kv_heads.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


def test_cpu_training_with_more_threads_than_kv_heads_hands_the_kernel_repeated_kv_heads(intra_op_threads):
    tensors, _ = _inputs(kv_heads=1)
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    with _FlashKvHeads() as training:
        varlen_causal_attention(*leaves, CU, scaling=None)
    with torch.no_grad(), _FlashKvHeads() as inference:
        varlen_causal_attention(*tensors, CU, scaling=None)
    expected = cpu_backward_kv_heads(q_heads=4, kv_heads=1, threads=intra_op_threads)
    assert training.kv_heads == [expected] * (len(CU) - 1)
    assert inference.kv_heads == [1] * (len(CU) - 1)


def test_varlen_attention_on_cpu_runs_on_the_fused_kernel():
    """With sdpa restricted to its fused CPU kernel, a math-kernel fallback would raise."""
    tensors, weight = _inputs(kv_heads=2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        _out_and_grads(lambda q, k, v: varlen_causal_attention(q, k, v, CU, scaling=None), tensors, weight)


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_each_kv_groups_query_heads_as_a_batch_entry_is_gqa_attention_on_a_fused_kernel(kv_heads):
    """The layout CUDA's fused kernels get for GQA instead of sdpa's broadcast (which they refuse):
    within fp32's error of the float64 definition, forward and backward, and on CPU too it runs
    on a fused kernel (restricted to it, a math fallback would raise)."""
    length = CU[2] - CU[1] + 17
    tensors, weight = _inputs(kv_heads, cu=(0, length))
    scale = 0.3

    def grouped(q, k, v):
        heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = kv_groups_as_batch(*heads, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)

    out, grads = _out_and_grads(grouped, tensors, weight)
    ref, ref_grads = _out_and_grads(lambda q, k, v: causal_attention_f64(q, k, v, (0, length), scale),
                                    tensors, weight)
    ref32, ref32_grads = _out_and_grads(
        lambda q, k, v: causal_attention_f64(q, k, v, (0, length), scale, torch.float32), tensors, weight)
    assert_within_fp32_error(out, ref32, ref, name="out")
    for name, got, fp32, expected in zip("qkv", grads, ref32_grads, ref_grads, strict=True):
        assert_within_fp32_error(got, fp32, expected, name=name)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_varlen_attention_never_creates_a_segment_by_segment_tensor():
    length = 1024
    tensors, weight = _inputs(kv_heads=2, cu=(0, length))
    leaves = [t.requires_grad_(True) for t in tensors]
    with _LargestTensor() as mode:
        out = varlen_causal_attention(*leaves, (0, length), scaling=None)
        (out * weight.float()).sum().backward()
    assert mode.largest < length * length, f"largest tensor has {mode.largest} elements (L x L = {length**2})"


def test_flash_kernels_are_never_chosen_on_cpu():
    tensors, _ = _inputs(kv_heads=2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert not flash_kernels_apply(*(t.to(dtype) for t in tensors), dropout=0.0)


def test_torch_varlen_attn_is_used_only_where_it_takes_window_size_and_enable_gqa():
    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise AssertionError

    def current(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                enable_gqa=False):
        raise AssertionError

    assert not varlen_attn_usable(None) and not varlen_attn_usable(older)
    assert varlen_attn_usable(current)
