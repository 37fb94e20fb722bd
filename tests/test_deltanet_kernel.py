"""`model.deltanet_kernel`: "torch" is vlmcp's own kernel on any device, "auto" picks it on CPU
(also inside the training module), "fla" off CUDA is an error; the version gate refuses fla's GDN
backward below torch 2.13 / fla 0.6.0 and on Hopper with triton < 3.7.1, and "auto" there stops
with one error naming the versions and both ways out."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import build_model
from vlmcp.errors import KernelError
from vlmcp.model.deltanet_kernel import choose_kernel, fla_version_problem, resolve_kernel, version_tuple
from vlmcp.model.packed import PackedVLM

HOPPER, AMPERE = (9, 0), (8, 0)
# name -> (torch, fla, triton, capability, refused)
GATE_CASES = {
    "lent_h200_torch_2_11_triton_3_6": ((2, 11, 0), (0, 6, 0), (3, 6, 0), HOPPER, True),
    "torch_2_13_fla_0_6_triton_3_7_1_on_hopper": ((2, 13, 0), (0, 6, 0), (3, 7, 1), HOPPER, False),
    "torch_2_13_triton_3_6_on_hopper": ((2, 13, 0), (0, 6, 0), (3, 6, 0), HOPPER, True),
    "torch_2_13_triton_3_6_on_ampere": ((2, 13, 0), (0, 6, 0), (3, 6, 0), AMPERE, False),
    "fla_0_5_on_ampere": ((2, 13, 0), (0, 5, 9), (3, 7, 1), AMPERE, True),
    "torch_2_12_on_ampere": ((2, 12, 1), (0, 6, 0), (3, 7, 1), AMPERE, True),
    "fla_not_installed": ((2, 13, 0), None, (3, 7, 1), AMPERE, True),
}


@pytest.mark.parametrize("name", list(GATE_CASES))
def test_version_gate_refuses_fla_exactly_where_its_backward_fails(name):
    torch_version, fla, triton, capability, refused = GATE_CASES[name]
    assert (fla_version_problem(torch_version, fla, triton, capability) is not None) == refused


def test_auto_on_gated_cuda_names_the_versions_and_both_ways_out():
    problem = fla_version_problem((2, 11, 0), (0, 6, 0), (3, 6, 0), HOPPER)
    with pytest.raises(KernelError) as error:
        choose_kernel("auto", on_cuda=True, fla_problem=problem)
    message = str(error.value)
    for part in ("torch 2.11.0", "triton 3.6.0", "flash-linear-attention 0.6.0", "Upgrade torch",
                 "model.deltanet_kernel: torch"):
        assert part in message, part
    assert choose_kernel("auto", on_cuda=True, fla_problem=None) == "fla"
    assert choose_kernel("fla", on_cuda=True, fla_problem=problem) == "fla"


def test_torch_kernel_on_any_device_auto_picks_it_on_cpu_fla_needs_cuda():
    assert resolve_kernel("torch", torch.device("cuda", 0)) == "torch"  # touches no GPU
    assert resolve_kernel("auto", torch.device("cpu")) == "torch"
    with pytest.raises(KernelError, match="'fla' needs CUDA"):
        resolve_kernel("fla", torch.device("cpu"))
    assert PackedVLM(build_model()).deltanet_kernel == "torch"


def test_version_strings_parse_to_tuples():
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("0.6.0") == (0, 6, 0) and version_tuple(None) is None
