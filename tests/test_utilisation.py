"""The peak a step's MFU is measured against: a GPU's published dense peak found by its name for
the step's dtype (TF32 where fp32 matmuls may use it), an unknown GPU gives no peak (and no mfu),
a CPU peak is measured on the step's GEMMs; and the row keys' arithmetic."""

from __future__ import annotations

import pytest
import torch

from vlmcp.training.utilisation import CUDA_PEAKS, cpu_gemm_peak, cuda_peak, utilisation


@pytest.mark.parametrize("name,dtype,tf32,expected", [
    ("NVIDIA H200", torch.bfloat16, False, CUDA_PEAKS["H200"][0]),
    ("NVIDIA H200 NVL", torch.bfloat16, False, CUDA_PEAKS["H200 NVL"][0]),
    ("NVIDIA H100 80GB HBM3", torch.float32, False, CUDA_PEAKS["H100"][2]),
    ("NVIDIA H100 PCIe", torch.float16, False, CUDA_PEAKS["H100 PCIe"][0]),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, CUDA_PEAKS["A100"][1]),
    ("NVIDIA L40S", torch.bfloat16, False, CUDA_PEAKS["L40S"][0]),
    ("NVIDIA GH200 480GB", torch.bfloat16, False, CUDA_PEAKS["GH200"][0]),
    ("NVIDIA B200", torch.bfloat16, False, 2250.0),
    ("NVIDIA A10G", torch.bfloat16, False, None),
])
def test_a_gpu_gets_its_published_dense_peak_by_name_and_dtype(name, dtype, tf32, expected):
    peak = cuda_peak(name, dtype, tf32)
    assert peak.tflops == expected
    assert ("not in vlmcp's table" in peak.source) == (expected is None)


def test_the_cpu_peak_is_measured_on_the_steps_gemms_on_the_given_threads():
    threads = torch.get_num_threads()
    peak = cpu_gemm_peak([(64, 128), (128, 64)], rows=256, dtype=torch.float32, threads=1)
    assert peak.tflops > 0 and "on 1 CPU thread(s)" in peak.source and "float32" in peak.source
    assert torch.get_num_threads() == threads


def test_row_keys_are_per_device_rates_against_the_peak():
    assert utilisation(8e12, 2.0, 4, 2.0) == {"model_tflops": 8.0, "tflops_per_s": 1.0, "mfu": 0.5}
    assert utilisation(8e12, 2.0, 4, None)["mfu"] is None
    assert utilisation(8e12, 0.0, 4, 2.0)["tflops_per_s"] is None
