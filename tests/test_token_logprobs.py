"""Per-token logprobs and entropies of the chunked lm_head equal float64 log-softmax on the whole
shard, and the gradients of any weighted sum of them too: on the fused autograd path at any chunk
size, without autograd, and through the checkpointed chunks of a ZeRO-3-partitioned head (fp32,
within fp32's own error of the float64 value, `assert_within_fp32_error`, with fp32 log-softmax on
the whole shard as the fp32 reference; the one-row-chunk hidden gradient gets the matrix-vector
multiple of test_loss_chunks), at temperature 1 and at a temperature that varies from token to
token (log_softmax(logits / tau)). The entropy by-product of the plain CE path equals the same
reference."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.parity import (FP32_ERROR_MULTIPLE, MATRIX_VECTOR_MULTIPLE, assert_within_fp32_error,
                                  random_lm_head)
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.loss import CE_BYTES_PER_LOGIT, CHECKPOINTED_CE_BYTES_PER_LOGIT, shard_ce_and_entropy
from vlmcp.model.token_logprobs import shard_token_logprobs

VOCAB, HIDDEN, ROWS = 5_000, 16, 120


def _inputs(bias: bool = True):
    generator = torch.Generator().manual_seed(0)
    head, hidden, targets = random_lm_head(VOCAB, HIDDEN, ROWS, bias, 5, generator)
    coefficients = torch.randn(int((targets != IGNORE_INDEX).sum()), generator=generator)
    return head, hidden, targets, coefficients


def _temperatures() -> torch.Tensor:
    """[ROWS] sampling temperatures between 0.3 and 2, a different one at every position."""
    return 0.3 + 1.7 * torch.rand(ROWS, generator=torch.Generator().manual_seed(1))


@functools.cache
def _reference(dtype: torch.dtype = torch.float64, tempered: bool = False):
    """(logp, entropy, hidden grad, weight grad, bias grad) of plain log-softmax on the whole
    shard, of logits / tau when `tempered`, computed in `dtype` (float64: the truth; float32:
    fp32's own error)."""
    head, hidden, targets, coefficients = _inputs()
    head = head.to(dtype)
    hidden = hidden.to(dtype).requires_grad_(True)
    keep = targets != IGNORE_INDEX
    logits = head(hidden[keep])
    if tempered:
        logits = logits / _temperatures().to(dtype)[keep, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[keep, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(1)
    (logp * coefficients.to(dtype)).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, head.weight.grad, head.bias.grad


def _budget(rows: int, bytes_per_logit: int) -> float:
    return rows * VOCAB * bytes_per_logit / 2**20


@pytest.mark.parametrize("tempered", [False, True], ids=["tau_1", "tau_per_token"])
@pytest.mark.parametrize("rows,zero3", [(1, False), (16, False), (ROWS, False), (16, True)])
def test_chunked_logprobs_entropy_and_weighted_gradients_equal_float64_log_softmax(rows, zero3,
                                                                                   tempered):
    head, hidden, targets, coefficients = _inputs()
    if zero3:
        head.weight.ds_id = 0  # DeepSpeed's mark of a ZeRO-3-partitioned parameter
    hidden.requires_grad_(True)
    per_logit = CHECKPOINTED_CE_BYTES_PER_LOGIT if zero3 else CE_BYTES_PER_LOGIT
    scored = shard_token_logprobs(hidden, targets, head, _budget(rows, per_logit),
                                  _temperatures() if tempered else None)
    ((scored.logprobs * coefficients).sum() + scored.anchor).backward()
    got = (scored.logprobs, scored.entropy, hidden.grad, head.weight.grad, head.bias.grad)
    hidden_multiple = MATRIX_VECTOR_MULTIPLE if rows < 4 else FP32_ERROR_MULTIPLE
    multiples = (FP32_ERROR_MULTIPLE, FP32_ERROR_MULTIPLE, hidden_multiple) + (FP32_ERROR_MULTIPLE,) * 2
    for name, multiple, value, ref32, ref64 in zip(("logp", "entropy", "hidden", "weight", "bias"), multiples,
                                                   got, _reference(torch.float32, tempered),
                                                   _reference(torch.float64, tempered), strict=True):
        assert_within_fp32_error(value.detach(), ref32, ref64, multiple=multiple, name=name)


@pytest.mark.parametrize("zero3", [False, True])
def test_tempered_logprobs_without_autograd_equal_float64_log_softmax_of_logits_over_tau(zero3):
    head, hidden, targets, _ = _inputs()
    if zero3:
        head.weight.ds_id = 0
    (logp32, entropy32, *_) = _reference(torch.float32, tempered=True)
    (logp, entropy, *_) = _reference(torch.float64, tempered=True)
    per_logit = CHECKPOINTED_CE_BYTES_PER_LOGIT if zero3 else CE_BYTES_PER_LOGIT
    with torch.no_grad():
        scored = shard_token_logprobs(hidden, targets, head, _budget(16, per_logit),
                                      _temperatures())
    assert_within_fp32_error(scored.logprobs, logp32, logp, name="logp")
    assert_within_fp32_error(scored.entropy, entropy32, entropy, name="entropy")


def test_logprobs_without_autograd_and_ce_entropy_by_product_equal_the_reference():
    head, hidden, targets, _ = _inputs()
    (logp32, entropy32, *_), (logp, entropy, *_) = _reference(torch.float32), _reference()
    with torch.no_grad():
        scored = shard_token_logprobs(hidden, targets, head, _budget(16, CE_BYTES_PER_LOGIT))
        ce, count, entropy_sum = shard_ce_and_entropy(hidden, targets, head,
                                                      _budget(16, CE_BYTES_PER_LOGIT))
    assert_within_fp32_error(scored.logprobs, logp32, logp, name="logp")
    assert_within_fp32_error(scored.entropy, entropy32, entropy, name="entropy")
    assert count == len(logp)
    assert_within_fp32_error(ce, -logp32.sum(), -logp.sum(), name="CE sum")
    assert_within_fp32_error(entropy_sum, entropy32.sum(), entropy.sum(), name="entropy sum")
    head.weight.ds_id = 0
    _, _, zero3_entropy = shard_ce_and_entropy(hidden, targets, head,
                                               _budget(16, CHECKPOINTED_CE_BYTES_PER_LOGIT))
    assert_within_fp32_error(zero3_entropy, entropy32.sum(), entropy.sum(), name="ZeRO-3 entropy sum")
