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

from tests.helpers.loss_cases import (SENTINELS, case_step, chunked_logprobs, logprob_inputs,
                                      objectives, sentinel_step)
from vlmcp.model.log_ratio import LOG_RATIO_MAX

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
    host = case_step(name, *sp_rank)
    total, stats, grad = case_step(name, *sp_rank, move=lambda t: t.to(CUDA))
    assert total.device == CUDA and grad.device == CUDA and stats.device.type == "cpu"
    for got, want, what in zip((total, stats, grad), host, ("loss", "metric sums", "grad")):
        _assert_close(got, want, what)


def test_cuda_exp_of_the_capped_log_ratio_is_finite_and_the_next_fp32_overflows():
    edge = torch.tensor(LOG_RATIO_MAX, device=CUDA)
    above = torch.nextafter(edge, torch.tensor(torch.inf, device=CUDA))
    assert torch.isfinite(edge.exp()) and torch.isinf(above.exp())


@pytest.mark.parametrize("name", list(SENTINELS))
def test_cuda_a_large_finite_log_ratio_gives_a_finite_loss_gradient_and_metrics(name):
    total, stats, grad = sentinel_step(name, lambda t: t.to(CUDA))
    assert torch.isfinite(total) and torch.isfinite(grad).all() and torch.isfinite(stats).all()


@pytest.mark.parametrize("grad", [True, False], ids=["fused", "no_autograd"])
@pytest.mark.parametrize("zero3", [False, True], ids=["plain_head", "zero3_head"])
def test_cuda_chunked_logprobs_stay_on_the_gpu_and_match_the_cpu(grad, zero3):
    hidden, targets, temperatures, head = logprob_inputs()
    want = chunked_logprobs(hidden, targets, temperatures, head, grad, zero3)
    moved = nn.Linear(8, 40).to(CUDA)
    moved.load_state_dict(head.state_dict())
    got = chunked_logprobs(hidden.to(CUDA), targets.to(CUDA), temperatures.to(CUDA), moved, grad,
                           zero3)
    for value, expected in zip(got, want):
        if expected is None:
            assert value is None
            continue
        assert value.device == CUDA
        _assert_close(value, expected, "logprobs, entropy, keep or gradient")
