"""On CUDA, the loss terms with the model-side tensors (logp, entropy, keep) on cuda:0 and the
batch on the host, as in training: every objective and option of tests/helpers/loss_cases.py
(the mismatch correction at token and sequence level, several terms, the preference objectives)
and the chunked logprobs on every path run without a device error, keep the loss and the
gradient on the GPU, bring the metric sums back to the host, and agree with the same run on the
CPU; the cap of a log-ratio is finite under CUDA's exp and the sentinel cases stay finite.
tests/test_loss_devices.py checks the same placement on CPU-only machines.

Marked `cuda`: the suite hides GPUs unless VLMCP_TEST_CUDA=1, so these run only under
`make gpu-check` (or `VLMCP_TEST_CUDA=1 pytest tests/cuda/test_cuda_loss_terms.py`).

Bounds: both sides are fp32 on values of order 1 summed over at most 30 tokens; CUDA's exp, log
and sums round differently from the CPU's by a few units of fp32's 6e-8, so rel 1e-5 (with
1e-6 absolute on values near 0) separates rounding from a wrong result.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.loss_cases import (SENTINELS, batch_for, objectives, place_sentinel,
                                      shard_inputs, shard_step, token_batch)
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.log_ratio import LOG_RATIO_MAX
from vlmcp.model.loss_terms import Loss
from vlmcp.model.token_logprobs import shard_token_logprobs
from vlmcp.parallel.shard import ShardPlan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and VLMCP_TEST_CUDA=1 (make gpu-check)"),
]

CUDA = torch.device("cuda", 0)
RTOL, ATOL = 1e-5, 1e-6


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach().double().cpu(), want.detach().double()
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), f"{what}: {got} != {want}"


@pytest.mark.parametrize("sp_rank", [(1, 0), (2, 1)], ids=["sp1", "sp2_rank1"])
@pytest.mark.parametrize("name", list(objectives()))
def test_cuda_loss_terms_keep_model_tensors_on_the_gpu_and_match_the_cpu(name, sp_rank):
    loss = objectives()[name]
    batch = batch_for(loss)
    plan = ShardPlan.build(batch.seq_lens, *sp_rank)
    host = shard_step(loss, batch, plan, *shard_inputs(batch, plan))
    total, stats, grad = shard_step(loss, batch, plan,
                                    *(t.to(CUDA) for t in shard_inputs(batch, plan)))
    assert total.device == CUDA and grad.device == CUDA and stats.device.type == "cpu"
    for got, want, what in zip((total, stats, grad), host, ("loss", "metric sums", "grad")):
        _assert_close(got, want, what)


def test_cuda_exp_of_the_capped_log_ratio_is_finite_and_the_next_fp32_overflows():
    edge = torch.tensor(LOG_RATIO_MAX, device=CUDA)
    above = torch.nextafter(edge, torch.tensor(torch.inf, device=CUDA))
    assert torch.isfinite(edge.exp()) and torch.isinf(above.exp())


@pytest.mark.parametrize("name", list(SENTINELS))
def test_cuda_a_large_finite_log_ratio_gives_a_finite_loss_gradient_and_metrics(name):
    term, sentinel, _ = SENTINELS[name]
    batch = token_batch()
    plan = ShardPlan.build(batch.seq_lens)
    logp, entropy, keep = shard_inputs(batch, plan)
    place_sentinel(batch, logp, sentinel)
    total, stats, grad = shard_step(Loss((term,)), batch, plan, logp.to(CUDA),
                                    entropy.to(CUDA), keep.to(CUDA))
    assert torch.isfinite(total) and torch.isfinite(grad).all() and torch.isfinite(stats).all()


@pytest.mark.parametrize("grad", [True, False], ids=["fused", "no_autograd"])
@pytest.mark.parametrize("zero3", [False, True], ids=["plain_head", "zero3_head"])
def test_cuda_chunked_logprobs_stay_on_the_gpu_and_match_the_cpu(grad, zero3):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 8, generator=gen)
    targets = torch.randint(0, 40, (9,), generator=gen)
    targets[[0, 4]] = IGNORE_INDEX
    temperatures = 0.5 + torch.rand(9, generator=gen)
    head = nn.Linear(8, 40)
    if zero3:
        head.weight.ds_id = 0
    results = {}
    for device in ("cpu", CUDA):
        moved = nn.Linear(8, 40).to(device)
        moved.load_state_dict(head.state_dict())
        if zero3:
            moved.weight.ds_id = 0
        with torch.set_grad_enabled(grad):
            h = hidden.to(device).requires_grad_(grad)
            out = shard_token_logprobs(h, targets.to(device), moved, 40 * 4 * 3 / 2**20,
                                       temperatures.to(device))
            if grad:
                (out.logprobs.sum() + out.anchor).backward()
        results[str(device)] = (out.logprobs, out.entropy, h.grad, moved.weight.grad)
    for got, want in zip(results[str(CUDA)], results["cpu"]):
        if want is None:
            assert got is None
            continue
        assert got.device == CUDA
        _assert_close(got, want, "logprobs, entropy or gradient")
