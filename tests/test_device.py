"""The device choice honours DS_ACCELERATOR (cpu wins even where a GPU is visible), the process
group backend follows it, bad values fail with one clear error, and the CPU suite hides GPUs
(`make gpu-check` without a GPU: tests/test_gpu_wheels.py)."""

from __future__ import annotations

import os

import pytest
import torch

from vlmcp import device
from vlmcp.errors import DeviceError
from vlmcp.parallel import comm


@pytest.fixture
def gpu_visible(monkeypatch):
    """Pretend torch sees a GPU: only the decision is under test, no kernel runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_ds_accelerator_cpu_wins_over_a_visible_gpu(monkeypatch, gpu_visible):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert not device.use_cuda()
    assert device.compute_device() == torch.device("cpu")
    monkeypatch.delenv("VLMCP_DIST_BACKEND", raising=False)
    assert comm.dist_backend() == "gloo"


def test_unset_accelerator_follows_torch(monkeypatch, gpu_visible):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("VLMCP_DIST_BACKEND", raising=False)
    assert device.use_cuda()
    assert comm.dist_backend() == "nccl"
    monkeypatch.setenv("VLMCP_DIST_BACKEND", "gloo")
    assert comm.dist_backend() == "gloo"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"DS_ACCELERATOR": "cuda"}, "DS_ACCELERATOR=cuda, but torch sees no CUDA device"),
        ({"DS_ACCELERATOR": "xpu"}, "DS_ACCELERATOR='xpu': vlmcp runs on 'cpu' or 'cuda' only"),
        ({"DS_ACCELERATOR": "cpu", "VLMCP_DIST_BACKEND": "nccl"}, "VLMCP_DIST_BACKEND=nccl needs CUDA"),
        ({"DS_ACCELERATOR": "cpu", "VLMCP_DIST_BACKEND": "mpi"}, "VLMCP_DIST_BACKEND='mpi'"),
    ],
)
def test_unusable_device_settings_are_one_clear_error(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DeviceError) as exc:
        comm.dist_backend()
    assert exc.value.problems[0].startswith(message)


def test_cpu_suite_hides_gpus():
    if os.environ.get("VLMCP_TEST_CUDA") == "1":
        pytest.skip("GPUs are visible on purpose (VLMCP_TEST_CUDA=1)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not device.use_cuda()
