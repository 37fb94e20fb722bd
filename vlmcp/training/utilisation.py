"""How close a step comes to the machine's limit: the peak FLOP rate of a device, and the
`model_tflops`, `tflops_per_s` and `mfu` keys of bench and training rows (docs/mfu.md).

    model_tflops  the step's model FLOPs (`vlmcp.model.flops`) over every rank, in 10^12
    tflops_per_s  per device: model FLOPs / step time / devices, in 10^12
    mfu           tflops_per_s / the device's peak (null where no peak is known)

The peak, per device:
- CUDA: the device's published dense peak, by device name (`CUDA_PEAKS`, from NVIDIA's datasheets,
  whose tensor-core figures are quoted with 2:4 sparsity: halved here): the bf16/fp16 tensor-core
  peak for a bf16/fp16 step; for fp32, the TF32 tensor-core peak where torch lets fp32 matmuls run
  in TF32 (`torch.get_float32_matmul_precision()` not "highest"), else the fp32 (CUDA core) peak.
- CPU: measured, the best rate of a GEMM of the step's shapes (`gemm_shapes`: rows x in @ in x out)
  in the step's dtype on the threads a rank runs with, once per bench run or training run: a CPU
  has no datasheet figure that its BLAS reaches at these shapes and thread counts, so the peak is
  what the same BLAS does with the same products outside the step.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmcp.device import compute_device
from vlmcp.model.flops import AdapterFlops, Trains, batch_flops, gemm_shapes
from vlmcp.model.load import DTYPES
from vlmcp.model.lora import adapter_flops
from vlmcp.parallel import comm

logger = logging.getLogger(__name__)

#: Dense peak TFLOPS per GPU: (bf16/fp16 tensor core, TF32 tensor core, fp32), by the name's
#: words as `torch.cuda.get_device_name` gives them ("NVIDIA H100 80GB HBM3" is the SXM part).
#: Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe, NVL), H200 datasheet (SXM, NVL),
#: GH200 Grace Hopper Superchip datasheet, A100 datasheet (SXM and PCIe alike), L40S, L40 and L4
#: datasheets, A10 datasheet, HGX B200 and GB200 NVL72 datasheets (per GPU).
CUDA_PEAKS: dict[str, tuple[float, float, float]] = {
    "H100": (989.5, 494.5, 67.0),
    "H100 PCIe": (756.5, 378.0, 51.0),
    "H100 NVL": (835.5, 417.5, 60.0),
    "H200": (989.5, 494.5, 67.0),
    "H200 NVL": (835.5, 417.5, 60.0),
    "GH200": (989.5, 494.5, 67.0),
    "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6),
    "L40": (181.0, 90.5, 90.5),
    "L4": (121.0, 60.0, 30.3),
    "A10": (125.0, 62.5, 31.2),
    "B200": (2250.0, 1100.0, 75.0),
    "GB200": (2500.0, 1250.0, 80.0),
}
#: FLOPs of one timed GEMM of the CPU peak: its rows are cut to stay within this.
CPU_GEMM_FLOPS = 5e8
CPU_GEMM_REPEATS = 3


@dataclass(frozen=True)
class Peak:
    """A device's peak in 10^12 FLOP/s (None: not known) and where it comes from."""

    tflops: float | None
    source: str


def cuda_peak(name: str, dtype: torch.dtype, tf32: bool) -> Peak:
    """The published dense peak of the GPU called `name` for `dtype` (`CUDA_PEAKS`); `tf32`: fp32
    matmuls run in TF32. The longest table entry whose words all appear in the name wins."""
    words = set(re.split(r"[\s\-_]+", name))
    known = [key for key in CUDA_PEAKS if set(key.split()) <= words]
    if not known:
        return Peak(None, f"{name}: not in vlmcp's table of published peaks")
    key = max(known, key=len)
    bf16, tf32_peak, fp32 = CUDA_PEAKS[key]
    if dtype in (torch.bfloat16, torch.float16):
        return Peak(bf16, f"{key} datasheet, dense {str(dtype).removeprefix('torch.')} tensor core")
    if tf32:
        return Peak(tf32_peak, f"{key} datasheet, dense TF32 tensor core (fp32 matmuls in TF32)")
    return Peak(fp32, f"{key} datasheet, fp32")


def cpu_gemm_peak(shapes: Sequence[tuple[int, int]], rows: int, dtype: torch.dtype,
                  threads: int | None = None) -> Peak:
    """The best rate of `rows x in @ in x out` GEMMs over `shapes` (rows cut so that one stays
    within `CPU_GEMM_FLOPS`), each timed `CPU_GEMM_REPEATS` times after one untimed run, on
    `threads` threads (default: the current count) in `dtype`."""
    previous = torch.get_num_threads()
    threads = threads or previous
    torch.set_num_threads(threads)
    best, best_shape = 0.0, (0, 0, 0)
    generator = torch.Generator().manual_seed(0)
    try:
        for inner, outer in shapes:
            m = max(1, min(rows, int(CPU_GEMM_FLOPS // (2 * inner * outer))))
            a = torch.randn(m, inner, generator=generator).to(dtype)
            b = torch.randn(inner, outer, generator=generator).to(dtype)
            out = torch.mm(a, b)
            for _ in range(CPU_GEMM_REPEATS):
                started = time.perf_counter()
                torch.mm(a, b, out=out)
                rate = 2 * m * inner * outer / max(time.perf_counter() - started, 1e-9)
                if rate > best:
                    best, best_shape = rate, (m, inner, outer)
    finally:
        torch.set_num_threads(previous)
    m, inner, outer = best_shape
    return Peak(best / 1e12, f"measured: {m} x {inner} @ {inner} x {outer} "
                             f"{str(dtype).removeprefix('torch.')} GEMM on {threads} CPU thread(s)")


def device_peak(device: torch.device, dtype: torch.dtype, shapes: Sequence[tuple[int, int]],
                rows: int, threads: int | None = None) -> Peak:
    """`cuda_peak` of `device` on CUDA, else `cpu_gemm_peak` of the step's `shapes`."""
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return cuda_peak(torch.cuda.get_device_name(device), dtype, tf32)
    return cpu_gemm_peak(shapes, rows, dtype, threads)


def utilisation(flops: float, seconds: float, devices: int, peak_tflops: float | None) -> dict[str, Any]:
    """The row keys of a step of `flops` model FLOPs over `devices` devices taking `seconds`."""
    per_device = flops / seconds / devices / 1e12 if seconds > 0 else None
    mfu = per_device / peak_tflops if per_device is not None and peak_tflops else None
    return {"model_tflops": flops / 1e12, "tflops_per_s": per_device, "mfu": mfu}


class RunUtilisation:
    """A training run's model FLOPs per pack and its device peak (looked up, or measured on CPU,
    once at the start on every rank); `row` gives a step's keys."""

    def __init__(self, config: Any, trains: Trains, adapters: AdapterFlops, peak: Peak) -> None:
        self.config, self.trains, self.adapters, self.peak = config, trains, adapters, peak

    @classmethod
    def of_run(cls, job: Any, module: Any, engine: Any, adapter: Any) -> RunUtilisation:
        """The run's: the engine's compute dtype, LoRA (`adapter`: the PeftModel, or None) and a
        trained vision tower; on CPU the GEMMs of a `data.max_seq_len` / sp shard."""
        if engine.bfloat16_enabled():
            dtype = torch.bfloat16
        elif engine.fp16_enabled():
            dtype = torch.float16
        else:
            dtype = DTYPES[job.model.dtype]
        config = module.hf_model.config
        rows = max(1, job.data.max_seq_len // module.sp.size)
        peak = device_peak(compute_device(), dtype, gemm_shapes(config), rows)
        if peak.tflops is None:
            logger.warning("mfu is null in the metrics: %s (vlmcp.training.utilisation.CUDA_PEAKS)",
                           peak.source)
        else:
            logger.info("peak for mfu: %.3g TFLOP/s per device (%s)", peak.tflops, peak.source)
        adapters = adapter_flops(module.hf_model) if adapter is not None else AdapterFlops()
        return cls(config, Trains(text_weights=adapter is None, vision=module.vision_trainable),
                   adapters, peak)

    def pack_flops(self, batch: Any) -> float:
        """Model FLOPs of one forward + backward of `batch` (a PackedBatch)."""
        return float(batch_flops(self.config, batch, self.trains, self.adapters).total)

    def row(self, flops: float, seconds: float) -> dict[str, Any]:
        """A step's keys: `flops` summed over the world's packs, in `seconds`."""
        return utilisation(flops, seconds, comm.world_size(), self.peak.tflops)
