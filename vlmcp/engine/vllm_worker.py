"""Runs inside vLLM's worker: what an in-place reload of an MoE policy leaves undone on a CPU.

vLLM 0.32's CPU experts keep their weights prepacked for the CPU grouped GEMM
(`cpu_moe.py`: `process_weights_after_loading` -> `cpu_prepack_moe_weight`). A reload
(`reload_weights`) copies the new weights into the same parameters in the loader's plain
layout, and `unquantized_fused_moe_method.py` calls the experts' `process_weights_after_loading`
only on the first load (`if not is_weight_update`), so after a reload the CPU kernel reads plain
weights as packed ones: measured up to 5.3 nats off, also after reloading the very weights it
started with. Running the experts' own post-load step once more after each reload repacks them:
measured bit-identical to a fresh engine on the new weights (greedy tokens and logprobs, tiny
Qwen3.5 MoE, docs/rl-loop.md). GPU experts are not touched (their reload path converts the
weights itself).

`repack_cpu_moe_experts(worker)` is the step, for `LLM.collective_rpc(repack_cpu_moe_experts)`;
`VlmcpWorkerExtension` gives the server's workers the same step as a method, for
`POST /collective_rpc {"method": "repack_cpu_moe_experts"}` (server flag
`--worker-extension-cls vlmcp.engine.vllm_worker.VlmcpWorkerExtension`, with vlmcp's checkout on
the server's PYTHONPATH). Standard library only: it is imported by vLLM's worker.
"""

from __future__ import annotations

from typing import Any

#: The module of vLLM's CPU experts, whose weights are prepacked after loading.
CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def repack_cpu_moe_experts(worker: Any) -> int:
    """Prepack the CPU experts of every MoE layer of `worker`'s model again (after a reload);
    returns how many layers it repacked (0 for a dense model or GPU experts). Raises
    RuntimeError for experts whose intermediate size vLLM pads (not proven here)."""
    repacked = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__ == CPU_EXPERTS_MODULE:
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                raise RuntimeError("the CPU experts pad their intermediate size, which the repack "
                                   "after a reload was not proven for: restart the engine on "
                                   "each step instead")
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


class VlmcpWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `repack_cpu_moe_experts`."""

    def repack_cpu_moe_experts(self) -> int:
        """`repack_cpu_moe_experts(self)`: this worker's MoE layers repacked after a reload."""
        return repack_cpu_moe_experts(self)
