"""The lm_head + cross-entropy chunks are sized by bytes, and chunking never changes the loss or
its gradients: any budget gives plain `F.cross_entropy` on the whole shard (fp32, rel <= 1e-6).

One exception, measured: a chunk of fewer than 4 rows computes its hidden-state gradient
([rows, vocab] @ [vocab, hidden]) with the BLAS matrix-vector kernel, which rounds a 50,000-term
sum differently from the matrix-matrix kernel of the reference: 8.9e-6 apart, while both are within
8.6e-6 and 2.6e-6 of float64. Those chunks get a 2e-5 bound on that gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmcp.config import TrainSection
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.loss import CE_BYTES_PER_LOGIT, DEFAULT_LOSS_CHUNK_MB, shard_loss_sum, vocab_chunk_rows

VOCAB, HIDDEN, ROWS = 50_000, 16, 300


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_chunk_rows_follow_the_byte_budget_and_the_vocabulary():
    assert vocab_chunk_rows(256.0, 248_320, CE_BYTES_PER_LOGIT) == 90
    assert vocab_chunk_rows(256.0, 512, CE_BYTES_PER_LOGIT) == 43_690
    exact_mb = 100 * VOCAB * CE_BYTES_PER_LOGIT / 2**20
    assert vocab_chunk_rows(exact_mb, VOCAB, CE_BYTES_PER_LOGIT) == 100
    assert vocab_chunk_rows(exact_mb * 0.999, VOCAB, CE_BYTES_PER_LOGIT) == 99
    assert vocab_chunk_rows(1e-3, VOCAB, CE_BYTES_PER_LOGIT) == 1
    with pytest.raises(ValueError, match="budget"):
        vocab_chunk_rows(0.0, VOCAB, CE_BYTES_PER_LOGIT)


def test_job_default_budget_is_the_model_default():
    assert TrainSection().loss_chunk_mb == DEFAULT_LOSS_CHUNK_MB


def _loss_and_grads(chunk_mb: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
    hidden = torch.randn(ROWS, HIDDEN, generator=generator).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[::7] = IGNORE_INDEX
    if chunk_mb is None:
        loss = F.cross_entropy(head(hidden), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        loss, count = shard_loss_sum(hidden, targets, head, chunk_mb)
        assert count == int((targets != IGNORE_INDEX).sum())
    loss.backward()
    return loss.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 64, ROWS])
def test_chunked_loss_and_gradients_equal_unchunked_cross_entropy(rows_per_chunk):
    chunk_mb = rows_per_chunk * VOCAB * CE_BYTES_PER_LOGIT / 2**20
    assert vocab_chunk_rows(chunk_mb, VOCAB, CE_BYTES_PER_LOGIT) == rows_per_chunk
    reference = _loss_and_grads(None)
    chunked = _loss_and_grads(chunk_mb)
    bounds = {"loss": 1e-6, "hidden grad": 1e-6 if rows_per_chunk >= 4 else 2e-5, "lm_head grad": 1e-6}
    for (name, bound), got, want in zip(bounds.items(), chunked, reference):
        assert _rel(got, want) <= bound, (name, _rel(got, want))


def test_packed_module_hands_its_budget_to_the_loss(tiny_checkpoint):
    from vlmcp.bench_inputs import synthetic_pack
    from vlmcp.model.load import load_model
    from vlmcp.model.packed import PackedVLM

    losses, head_calls = [], []
    for chunk_mb in (DEFAULT_LOSS_CHUNK_MB, 1e-6):
        module = PackedVLM(load_model(tiny_checkpoint), loss_chunk_mb=chunk_mb)
        batch = synthetic_pack(48, 2, module.hf_model.config)
        calls = []
        module.lm_head.register_forward_hook(lambda *_: calls.append(1))
        with torch.no_grad():
            loss, count = module(batch)
        losses.append(loss)
        head_calls.append(len(calls))
    assert head_calls == [1, count]
    assert _rel(losses[1], losses[0]) <= 1e-6
