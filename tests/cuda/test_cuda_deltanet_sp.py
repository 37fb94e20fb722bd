"""The DeltaNet CP hook at SP 2 on one GPU: two processes, both on cuda:0, talking over gloo
(which stages CUDA tensors through host memory for all_gather, all_reduce and all_to_all).
Every case runs in the same SP group on CPU tensors (the path tests/test_deltanet_hook.py pins
to plain transformers) and on CUDA tensors (vlmcp's pure-torch kernel, and fla's varlen kernel
where the version gate allows it); outputs, input gradients and parameter gradients must agree on
every rank.

Marked `cuda` (runs only under `make gpu-check` / VLMCP_TEST_CUDA=1). Bound 1e-4 with
TRITON_F32_DEFAULT=ieee, else the 1e-2 that fla's TF32 dots allow.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.cuda.cases import sharded_layer_grads_cpu_and_cuda
from tests.helpers.distributed import run_ranks
from tests.helpers.parity import build_model, rel_err
from vlmcp.model.deltanet_kernel import installed_fla_problem

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and VLMCP_TEST_CUDA=1 (make gpu-check)"),
]

TOL = 1e-4 if os.environ.get("TRITON_F32_DEFAULT") == "ieee" else 1e-2
ONE_GPU_OVER_GLOO = {"DS_ACCELERATOR": "cuda", "VLMCP_DIST_BACKEND": "gloo", "LOCAL_RANK": "0"}
LOCAL = 80  # tokens per rank: more than one 64-token chunk of fla's kernel

# name -> (seq_lens, DeltaNet mode); two ranks
CASES = {
    "state_boundary_at_edge": ([LOCAL, LOCAL], "state"),
    "state_sample_across_edge": ([LOCAL - 10, 20, LOCAL - 10], "state"),
    "state_one_sample_over_both_ranks": ([2 * LOCAL - 3], "state"),
    "heads_mixed": ([LOCAL - 5, 3, LOCAL + 2], "heads"),
}


def _inputs(name: str):
    seq_lens, mode = CASES[name]
    heads = {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
    layer = copy.deepcopy(build_model(**heads).model.language_model.layers[0].linear_attn)
    gen = torch.Generator().manual_seed(len(name))
    total = sum(seq_lens)
    x = torch.randn(total, layer.hidden_size, generator=gen)
    weight = torch.randn(total, layer.hidden_size, generator=gen)
    return layer, x, weight, seq_lens, mode


@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_deltanet_hook_at_sp2_on_one_gpu_over_gloo_matches_cpu(kernel):
    """Each kernel on CUDA: vlmcp's pure-torch one always, fla's where the version gate allows it."""
    if kernel == "fla":
        problem = installed_fla_problem(torch.device("cuda", 0))
        if problem:
            pytest.skip(f"fla gated: {problem}")
    per_rank = run_ranks(
        sharded_layer_grads_cpu_and_cuda, 2, {name: _inputs(name) for name in CASES}, [kernel], env=ONE_GPU_OVER_GLOO
    )
    for rank, results in enumerate(per_rank):
        for name in CASES:
            cpu, cuda = results[f"{name}/cpu"], results[f"{name}/cuda/{kernel}"]
            for key in ("out", "x_grad"):
                assert rel_err(cuda[key], cpu[key]) <= TOL, f"{name} rank {rank} {key}"
            for pname, grad in cpu["param_grads"].items():
                assert rel_err(cuda["param_grads"][pname], grad) <= TOL, f"{name} rank {rank} {pname}"
