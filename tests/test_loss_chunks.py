"""The lm_head + cross-entropy chunks are sized by bytes, and chunking never changes the loss or
its gradients: any budget gives plain `F.cross_entropy` on the whole shard, on every path (fused
autograd Function, no autograd, checkpointed chunks of a ZeRO-3-partitioned head), with and
without a bias, and a bf16 head stays within bf16 rounding (1e-2; measured 5.5e-3 on the
hidden-state gradient, 7.7e-3 on the weight's, 6.8e-3 on the bias', the same as the checkpointed
path).

fp32 results are held to float64 `F.cross_entropy` by `assert_within_fp32_error`: within 4x the
distance of fp32 `F.cross_entropy` on the whole shard from float64, plus 8 eps. Measured on a
2-core AMD EPYC (the same at 1 and 2 threads): fp32 `F.cross_entropy` is 1.5e-6 from float64 on
the weight gradient and 2.6e-6 on the hidden-state gradient; the fused path's weight gradient is
3.4e-7 away, the checkpointed ZeRO-3 path (the same fp32 `F.cross_entropy`, per chunk) 1.5e-6 and
2.7e-6 (issue 14 reports 5.2e-6 on the hidden-state gradient in a full-suite run on such a
machine, where the fixed bound of 5e-6 failed).

One exception, measured: a chunk of fewer than 4 rows computes its hidden-state gradient
([rows, vocab] @ [vocab, hidden]) with the BLAS matrix-vector kernel, which rounds a 50,000-term
sum differently from the matrix-matrix kernel: 8.9e-6 from float64, where 4-row chunks are 9.3e-7
away. Those chunks get 8x instead of 4x on that gradient (`MATRIX_VECTOR_MULTIPLE`).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.parity import (FP32_ERROR_MULTIPLE, MATRIX_VECTOR_MULTIPLE, assert_within_fp32_error,
                                  float64_reference, random_lm_head)
from vlmcp.config import TrainSection
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.loss import (
    CE_BYTES_PER_LOGIT,
    CHECKPOINTED_CE_BYTES_PER_LOGIT,
    DEFAULT_LOSS_CHUNK_MB,
    shard_loss_sum,
    vocab_chunk_rows,
)

VOCAB, HIDDEN, ROWS = 50_000, 16, 300


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_chunk_rows_follow_the_byte_budget_and_the_vocabulary():
    assert vocab_chunk_rows(256.0, 248_320, CE_BYTES_PER_LOGIT) == 180
    assert vocab_chunk_rows(256.0, 248_320, CHECKPOINTED_CE_BYTES_PER_LOGIT) == 90
    assert vocab_chunk_rows(256.0, 512, CE_BYTES_PER_LOGIT) == 87_381
    exact_mb = 100 * VOCAB * CE_BYTES_PER_LOGIT / 2**20
    assert vocab_chunk_rows(exact_mb, VOCAB, CE_BYTES_PER_LOGIT) == 100
    assert vocab_chunk_rows(exact_mb * 0.999, VOCAB, CE_BYTES_PER_LOGIT) == 99
    assert vocab_chunk_rows(1e-3, VOCAB, CE_BYTES_PER_LOGIT) == 1
    with pytest.raises(ValueError, match="budget"):
        vocab_chunk_rows(0.0, VOCAB, CE_BYTES_PER_LOGIT)


def test_job_default_budget_is_the_model_default():
    assert TrainSection().loss_chunk_mb == DEFAULT_LOSS_CHUNK_MB


def _head_and_inputs(bias: bool, dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    head, hidden, targets = random_lm_head(VOCAB, HIDDEN, ROWS, bias, 7, torch.Generator().manual_seed(0))
    return head.to(dtype), hidden.to(dtype).requires_grad_(True), targets


def _loss_and_grads(chunk_mb: float | None, bias: bool = False, dtype: torch.dtype = torch.float32,
                    zero3_head: bool = False, reference_dtype: torch.dtype = torch.float64
                    ) -> tuple[torch.Tensor, ...]:
    """Loss, hidden grad, weight grad (and bias grad), as float64. chunk_mb None: the reference,
    plain `F.cross_entropy` on the whole shard, on the same (possibly bf16-rounded) values,
    computed in `reference_dtype` (float64: the truth; float32: fp32's own error)."""
    head, hidden, targets = _head_and_inputs(bias, dtype)
    if chunk_mb is None:
        head = head.to(reference_dtype)
        hidden = hidden.detach().to(reference_dtype).requires_grad_(True)
        loss = F.cross_entropy(head(hidden), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        if zero3_head:
            head.weight.ds_id = 0  # DeepSpeed's mark of a ZeRO-3-partitioned parameter
        loss, count = shard_loss_sum(hidden, targets, head, chunk_mb)
        assert count == int((targets != IGNORE_INDEX).sum())
    loss.backward()
    grads = (hidden.grad, head.weight.grad) + ((head.bias.grad,) if bias else ())
    return (loss.detach().double(),) + tuple(grad.double() for grad in grads)


_NAMES = ("loss", "hidden grad", "lm_head grad", "lm_head bias grad")


@functools.cache
def _references(bias: bool) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(fp32, float64) `F.cross_entropy` on the whole shard: `_loss_and_grads(None)` in both."""
    return (_loss_and_grads(None, bias=bias, reference_dtype=torch.float32),
            _loss_and_grads(None, bias=bias))


def _assert_equals_cross_entropy(chunked: tuple[torch.Tensor, ...], bias: bool = False,
                                 hidden_multiple: float = FP32_ERROR_MULTIPLE) -> None:
    """Each of `chunked` (`_loss_and_grads` of an fp32 path) within fp32's own error of float64
    `F.cross_entropy` on the whole shard; `hidden_multiple` for the hidden-state gradient."""
    fp32, truth = _references(bias)
    multiples = (FP32_ERROR_MULTIPLE, hidden_multiple) + (FP32_ERROR_MULTIPLE,) * 2
    for name, multiple, got, ref32, ref64 in zip(_NAMES, multiples, chunked, fp32, truth):
        assert_within_fp32_error(got, ref32, ref64, multiple=multiple, name=name)


def _budget(rows_per_chunk: int, bytes_per_logit: int = CE_BYTES_PER_LOGIT) -> float:
    chunk_mb = rows_per_chunk * VOCAB * bytes_per_logit / 2**20
    assert vocab_chunk_rows(chunk_mb, VOCAB, bytes_per_logit) == rows_per_chunk
    return chunk_mb


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 64, ROWS])
def test_fused_chunked_loss_and_gradients_equal_unchunked_cross_entropy(rows_per_chunk):
    chunked = _loss_and_grads(_budget(rows_per_chunk))
    multiple = FP32_ERROR_MULTIPLE if rows_per_chunk >= 4 else MATRIX_VECTOR_MULTIPLE
    _assert_equals_cross_entropy(chunked, hidden_multiple=multiple)


def test_fused_loss_of_a_head_with_bias_equals_unchunked_cross_entropy():
    chunked = _loss_and_grads(_budget(64), bias=True)
    assert len(chunked) == len(_NAMES)
    _assert_equals_cross_entropy(chunked, bias=True)


def test_bf16_fused_loss_stays_within_bf16_rounding_of_the_fp32_reference():
    reference = _loss_and_grads(None, bias=True, dtype=torch.bfloat16)
    chunked = _loss_and_grads(_budget(64), bias=True, dtype=torch.bfloat16)
    for name, got, want in zip(_NAMES, chunked, reference, strict=True):
        assert _rel(got, want) <= 1e-2, (name, _rel(got, want))


def test_zero3_partitioned_head_takes_the_checkpointed_module_path_with_the_same_result():
    """A head whose weight carries DeepSpeed's `ds_id` runs every chunk through the module (its
    hooks gather the weight under ZeRO-3): forward and checkpoint recomputation, 2 calls per chunk,
    where the fused path never calls the module."""
    calls = {}
    for zero3 in (False, True):
        head, hidden, targets = _head_and_inputs(False, torch.float32)
        if zero3:
            head.weight.ds_id = 0
        calls[zero3] = []
        head.register_forward_hook(lambda *_, c=calls[zero3]: c.append(1))
        shard_loss_sum(hidden, targets, head, _budget(64, CHECKPOINTED_CE_BYTES_PER_LOGIT))[0].backward()
    chunks = -(-int((targets != IGNORE_INDEX).sum()) // 64)
    assert (len(calls[False]), len(calls[True])) == (0, 2 * chunks)
    _assert_equals_cross_entropy(_loss_and_grads(_budget(64, CHECKPOINTED_CE_BYTES_PER_LOGIT), zero3_head=True))


def test_loss_without_autograd_equals_unchunked_cross_entropy():
    head, hidden, targets = _head_and_inputs(True, torch.float32)
    with torch.no_grad():
        got, _ = shard_loss_sum(hidden, targets, head, _budget(64))
    fp32, truth = _references(bias=True)
    assert_within_fp32_error(got, fp32[0], truth[0], name="loss")


def test_packed_module_hands_its_budget_to_the_loss(tiny_checkpoint):
    from vlmcp.bench.inputs import synthetic_pack
    from vlmcp.model.load import load_model
    from vlmcp.model.packed import PackedVLM

    losses, head_calls = [], []
    for chunk_mb in (DEFAULT_LOSS_CHUNK_MB, 1e-6):
        module = PackedVLM(load_model(tiny_checkpoint), loss_chunk_mb=chunk_mb)
        batch = synthetic_pack(48, 2, module.hf_model.config)
        calls = []
        module.lm_head.register_forward_hook(lambda *_: calls.append(1))
        with torch.no_grad():
            loss, count, _ = module(batch)
        losses.append(loss)
        head_calls.append(len(calls))
    assert head_calls == [1, count]
    with torch.no_grad():
        truth = float64_reference(lambda model: PackedVLM(model)(batch)[0], load_model(tiny_checkpoint))
    assert_within_fp32_error(losses[1], losses[0], truth, name="loss of one-row chunks")
