"""Where vlmcp computes: CUDA when torch sees a GPU, unless `DS_ACCELERATOR=cpu` says CPU.

DeepSpeed picks its accelerator from the same variable, so vlmcp's own choices (the model's
device, NCCL or gloo) always agree with DeepSpeed's. Every device decision in vlmcp goes through
`use_cuda`; nothing else calls `torch.cuda.is_available()` to choose.
"""

from __future__ import annotations

import os

import torch

from vlmcp.errors import DeviceError

ACCELERATOR_ENV = "DS_ACCELERATOR"
#: The CUDA caching allocator setting ALST recommends for long sequences (less fragmentation);
#: set unless the user set PYTORCH_CUDA_ALLOC_CONF.
CUDA_ALLOC_CONF = "expandable_segments:True"


def use_cuda() -> bool:
    """True when vlmcp runs on CUDA.

    DS_ACCELERATOR unset or empty: CUDA exactly when torch sees a GPU. "cpu": never CUDA, even
    with a GPU present (torch.cuda is not touched). "cuda": CUDA, and a DeviceError when torch sees
    no GPU. Any other value is a DeviceError: vlmcp runs on CPU or CUDA only.
    """
    choice = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    if choice == "cpu":
        return False
    if choice not in ("", "cuda"):
        raise DeviceError(f"{ACCELERATOR_ENV}={choice!r}: vlmcp runs on 'cpu' or 'cuda' only")
    available = torch.cuda.is_available()
    if choice == "cuda" and not available:
        raise DeviceError(f"{ACCELERATOR_ENV}=cuda, but torch sees no CUDA device")
    return available


def compute_device() -> torch.device:
    """The current CUDA device when `use_cuda()`, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda() else torch.device("cpu")


def settle_accelerator() -> bool:
    """Resolve the device once per process and tell DeepSpeed: sets DS_ACCELERATOR to "cpu" or
    "cuda" when it is unset, so DeepSpeed never probes on its own; on CUDA sets
    PYTORCH_CUDA_ALLOC_CONF to `CUDA_ALLOC_CONF` unless the user set it (before the allocator's
    first use). Returns `use_cuda()`."""
    cuda = use_cuda()
    if not os.environ.get(ACCELERATOR_ENV, "").strip():
        os.environ[ACCELERATOR_ENV] = "cuda" if cuda else "cpu"
    if cuda:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    return cuda
