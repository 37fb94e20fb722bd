"""vLLM's in-process `LLM` as the engine: an orchestrator that runs in vLLM's own environment.

    from vllm import LLM
    from vlmcp.engine.vllm_local import VllmLocalClient

    llm = LLM(model="checkpoints/Qwen3.5", logprobs_mode="processed_logprobs", ...)
    engine = VllmLocalClient(llm, "runs/rl/weights", "checkpoints/Qwen3.5")
    engine.serve(3)                        # WEIGHTS/step_3, in place
    llm.generate(...)                      # every token is labelled weight version "3"

A reload is `llm.collective_rpc("reload_weights", kwargs={"weights_path": DIR})` (vLLM's loader
reads one model.safetensors or an index with shards); the client then resets the encoder cache
(`llm.llm_engine.reset_encoder_cache()`) and the prefix cache (`llm.reset_prefix_cache()`) and
labels the weights (`llm.llm_engine.set_weight_version("3")`); a prefix cache reset that fails
is an EngineError. The `LLM` runs its requests within `generate` calls, so none is in flight while
`serve` reloads (nothing frozen holds blocks, unlike the server's keep mode) and the plain reset
suffices. For an MoE policy it first
repacks the CPU experts (`llm.collective_rpc(vllm_worker.repack_cpu_moe_experts)`), and when it
is built it refuses an MoE whose CPU experts vLLM padded (`vllm_worker.padded_cpu_moe_experts`),
which vLLM cannot reload in place.

This module imports only the standard library (and vLLM's objects it is given), so it runs in
the engine venv with the checkout on PYTHONPATH, without vlmcp's own dependencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmcp.engine.client import EngineClient
from vlmcp.engine.vllm_worker import padded_cpu_moe_experts, repack_cpu_moe_experts
from vlmcp.errors import EngineError


class VllmLocalClient(EngineClient):
    """Serves published steps through the in-process `llm` (a `vllm.LLM`, started on
    `model_dir`, policy version `version`)."""

    def __init__(self, llm: Any, weights_dir: str | Path, model_dir: str | Path, *,
                 version: int = 0):
        super().__init__(weights_dir, model_dir, version)
        self.llm = llm
        if self.served_config.moe:
            self.refuse_padded_moe_experts(
                [line for found in llm.collective_rpc(padded_cpu_moe_experts) for line in found])
        self.llm.llm_engine.set_weight_version(str(version))

    def _reload(self, path: Path, step: int, moe: bool) -> int:
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            repacked = sum(self.llm.collective_rpc(repack_cpu_moe_experts)) if moe else 0
        except Exception as exc:  # vLLM raises whatever its loader raised
            raise EngineError(f"reloading {path} into the in-process vLLM engine failed "
                              f"({type(exc).__name__}: {exc}); it may hold a mix of weights: "
                              "serve a complete step or build the LLM anew") from exc
        self.llm.llm_engine.reset_encoder_cache()
        if not self.llm.reset_prefix_cache():
            raise EngineError("the in-process vLLM engine could not reset its prefix cache after "
                              "the reload (blocks still held by requests)")
        self.llm.llm_engine.set_weight_version(str(step))
        return repacked

    def close(self) -> None:
        """Nothing to stop: the `LLM` is the caller's."""
