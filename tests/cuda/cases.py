"""Rank-side code of the CUDA DeltaNet hook check (imported by spawned processes)."""

from __future__ import annotations

import copy

import torch

from tests.helpers.deltanet_cases import sharded_layer_grads


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {key: _to_cpu(value) for key, value in tree.items()}
    return tree


def sharded_layer_grads_cpu_and_cuda(cases: dict[str, tuple], kernels: list[str]) -> dict[str, dict]:
    """`sharded_layer_grads` of every case in one SP group: "<name>/cpu" on CPU tensors (the torch
    kernel), and "<name>/cuda/<kernel>" on a copy on cuda:0 for each of `kernels` (fp32, cuDNN
    TF32 off). Every result comes back on CPU."""
    both = {}
    for name, (layer, x, weight, seq_lens, mode) in cases.items():
        both[f"{name}/cpu"] = (layer, x, weight, seq_lens, mode, "torch")
        for kernel in kernels:
            both[f"{name}/cuda/{kernel}"] = (copy.deepcopy(layer).cuda(), x.cuda(), weight.cuda(), seq_lens,
                                             mode, kernel)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        return _to_cpu(sharded_layer_grads(both))
