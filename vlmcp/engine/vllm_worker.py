"""Runs inside vLLM's worker: what an in-place reload of an MoE policy leaves undone on a CPU.

vLLM 0.32's CPU experts keep their weights prepacked for the CPU grouped GEMM
(`cpu_moe.py`: `process_weights_after_loading` -> `cpu_prepack_moe_weight`). A reload
(`reload_weights`) copies the new weights into the same parameters in the loader's plain
layout, and `unquantized_fused_moe_method.py` calls the experts' `process_weights_after_loading`
only on the first load (`if not is_weight_update`), so after a reload the CPU kernel reads plain
weights as packed ones: measured up to 5.3 nats off, also after reloading the very weights it
started with. Running the experts' own post-load step once more after each reload repacks them:
measured bit-identical to the first run after reloading the first weights, and within bf16's
error of transformers on new weights (`tests/test_engine_local.py`). GPU experts are not touched
(their reload path converts the weights itself).

Experts whose intermediate size is not a multiple of the CPU kernel's alignment (32) are padded
at the first load (`_pad_moe_intermediate`): their parameters then hold `[E, 2 * padded, H]`,
and vLLM's reload fails on them itself (`RuntimeError: The size of tensor a (128) must match the
size of tensor b (96)` for 48 padded to 64), before any repack could run. `padded_cpu_moe_experts`
finds such layers, so that a client refuses the engine up front instead of leaving it with half
its layers reloaded.

`repack_cpu_moe_experts(worker)` and `padded_cpu_moe_experts(worker)` are the steps, for
`LLM.collective_rpc(...)`; `repack_cpu_moe_experts_of(model)` is the repack on a model itself
(what the gloo weight push, `vllm_gloo`, runs after its layerwise reload); `VlmcpWorkerExtension` gives the server's workers the same steps as
methods, for `POST /collective_rpc {"method": "repack_cpu_moe_experts"}` (server flag
`--worker-extension-cls vlmcp.engine.vllm_worker.VlmcpWorkerExtension`, with vlmcp's checkout on
the server's PYTHONPATH). Standard library only: it is imported by vLLM's worker.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

#: The module of vLLM's CPU experts, whose weights are prepacked after loading.
CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def cpu_moe_experts(model: Any) -> Iterator[tuple[Any, Any]]:
    """(MoE layer, its CPU experts) for every layer of `model` that runs on vLLM's CPU
    experts."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__ == CPU_EXPERTS_MODULE:
            yield module, experts


def padded_cpu_moe_experts(worker: Any) -> list[str]:
    """One line per MoE layer of `worker`'s model whose CPU experts were padded at load
    ("LAYER: intermediate size I padded to P"), read off the loaded `w13_weight` `[E, 2 * P, H]`
    against the config's I per partition; empty for a dense model, GPU experts, or sizes the
    kernel takes as they are."""
    found = []
    for module, experts in cpu_moe_experts(worker.model_runner.model):
        size = experts.moe_config.intermediate_size_per_partition
        held = module.w13_weight.shape[-2] // 2
        if held != size:
            name = getattr(module, "layer_name", type(module).__name__)
            found.append(f"{name}: intermediate size {size} padded to {held}")
    return found


def repack_cpu_moe_experts_of(model: Any, only: Container[Any] | None = None) -> int:
    """Prepack the CPU experts of every MoE layer of `model` again (after a reload), or of those
    layers (modules) among `only`: a layer that was not reloaded holds packed weights already, and
    packing them twice scrambles them. Returns how many layers it repacked (0 for a dense model or
    GPU experts)."""
    repacked = 0
    for module, experts in cpu_moe_experts(model):
        if only is not None and module not in only:
            continue
        experts.process_weights_after_loading(module)
        repacked += 1
    return repacked


def repack_cpu_moe_experts(worker: Any) -> int:
    """`repack_cpu_moe_experts_of` on `worker`'s model."""
    return repack_cpu_moe_experts_of(worker.model_runner.model)


class VlmcpWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: the steps above as methods."""

    def repack_cpu_moe_experts(self) -> int:
        """`repack_cpu_moe_experts(self)`: this worker's MoE layers repacked after a reload."""
        return repack_cpu_moe_experts(self)

    def padded_cpu_moe_experts(self) -> list[str]:
        """`padded_cpu_moe_experts(self)`: this worker's MoE layers with padded CPU experts."""
        return padded_cpu_moe_experts(self)
