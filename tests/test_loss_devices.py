"""The loss terms never mix the host's tensors with the model's device: every objective and
option (tests/helpers/loss_cases.py: the mismatch correction at token and sequence level,
several terms, the preference objectives), and the chunked per-token logprobs on every path,
run with the model-side tensors on a device that is not the host (tests/helpers/off_host.py:
CPU data held to CUDA's device rules, so a host tensor indexed by a device tensor raises as it
does on a GPU). The loss, its gradient and the shard's per-token results stay on the model's
device, the metric sums come back on the host, and every value equals the all-host run bit for
bit. tests/cuda/test_cuda_loss_terms.py runs the same cases on a real GPU (make gpu-check).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.loss_cases import case_step, chunked_logprobs, logprob_inputs, objectives
from tests.helpers.off_host import MODEL_DEVICE, MixedDevices, OffHost, off_host, to_model_device


@pytest.mark.parametrize("sp_rank", [(1, 0), (2, 1)], ids=["sp1", "sp2_rank1"])
@pytest.mark.parametrize("name", list(objectives()))
def test_every_loss_term_keeps_model_tensors_on_the_model_device(name, sp_rank):
    host = case_step(name, *sp_rank)
    with off_host():
        total, stats, grad = case_step(name, *sp_rank, move=to_model_device)
    assert total.device == MODEL_DEVICE and grad.device == MODEL_DEVICE
    assert stats.device.type == "cpu" and not isinstance(stats, OffHost)
    for got, want in zip((total.elem, stats, grad.elem), host):
        assert torch.equal(got, want)


def test_the_device_check_catches_a_host_tensor_indexed_by_a_device_tensor():
    with off_host():
        index = torch.tensor([0, 2], device=MODEL_DEVICE)
        with pytest.raises(MixedDevices):
            torch.zeros(3, dtype=torch.float64)[index]
        with pytest.raises(MixedDevices):
            torch.ones(3) + torch.ones(3, device=MODEL_DEVICE)
        assert torch.ones(3, device=MODEL_DEVICE)[torch.tensor([0, 2])].device == MODEL_DEVICE


@pytest.mark.parametrize("grad", [True, False], ids=["fused", "no_autograd"])
@pytest.mark.parametrize("zero3", [False, True], ids=["plain_head", "zero3_head"])
def test_chunked_logprobs_keep_every_tensor_on_the_model_device(grad, zero3):
    hidden, targets, temperatures, head = logprob_inputs()
    moved = nn.Linear(8, 40)
    with off_host():
        moved.weight = nn.Parameter(to_model_device(head.weight.detach()))
        moved.bias = nn.Parameter(to_model_device(head.bias.detach()))
        got = chunked_logprobs(*to_model_device((hidden, targets, temperatures)), moved, grad,
                               zero3)
    for value, want in zip(got, chunked_logprobs(hidden, targets, temperatures, head, grad,
                                                 zero3)):
        if want is None:
            assert value is None
            continue
        assert value.device == MODEL_DEVICE
        assert torch.equal(value.elem, want)
