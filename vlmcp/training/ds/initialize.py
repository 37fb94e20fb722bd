"""`deepspeed.initialize`, with AutoEP (`parallel.ep_size` > 1) built by a DeepSpeed engine
subclass that changes two things.

1. One refusal lifted: AutoEP under ZeRO-3 with SP. DeepSpeed 0.19.8's engine asserts, while it
   sets up ZeRO-3 (`DeepSpeedEngine._validate_zero3_moe_compatibility`): "AutoEP with ZeRO Stage 3
   does not support sequence parallelism yet (sequence_parallel_size=P)". That is a guard, not a
   missing piece: ZeRO-3 already partitions AutoEP's expert parameters over their
   expert-data-parallel group and the dense ones over the sequence-data-parallel group, whatever
   P is. What SP needs of ZeRO-3 is that its gradients average over DP, not over the world, and
   `zero3_sp.sp_exact_zero_settings` already sets that up for every ZeRO-3 run under SP. The
   check runs with SP read as 1; every other ZeRO-3 MoE check is kept.
2. LoRA on the routed experts kept: AutoEP's replacement (`_configure_expert_parallel`) drops
   PEFT's expert adapters; the subclass takes them out before it and attaches this rank's experts'
   slice after it (training/ds/expert_lora.py), before DeepSpeed lists the parameters for the
   optimizer and ZeRO.

tests/test_expert_parallel.py holds both to the float64 truth (plain transformers, each sample
alone; PEFT's adapters for LoRA): at (SP, EP) = (2, 2), (2, 4) with DP 2 and (4, 2) at ZeRO 3,
and LoRA on the routed experts at (2, 2): loss and every gradient within fp32's own error.

The engine is built by the same steps `deepspeed.initialize` takes for a plain (non-pipeline)
module (`fill_deepspeed_config` refuses DeepSpeed's hybrid engine under EP): `deepspeed.initialize`
has no way to name the engine class, and patching `DeepSpeedEngine` itself would change every
engine of the process. Without AutoEP everything goes through `deepspeed.initialize` unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vlmcp.training.ds.expert_lora import attach_expert_adapters, take_expert_adapters


def initialize_engine(module: nn.Module, config: dict[str, Any], mpu: Any, **kwargs: Any) -> Any:
    """The DeepSpeed engine of `module` (what `deepspeed.initialize(model=module, config=config,
    mpu=mpu, **kwargs)` returns first), on every rank; with AutoEP on (the filled
    `expert_parallel` section) it is built by `_build_expert_parallel_engine` (module docstring).
    `kwargs`: `optimizer`, `lr_scheduler`, `model_parameters`."""
    import deepspeed

    if not config.get("expert_parallel", {}).get("enabled"):
        return deepspeed.initialize(model=module, config=config, mpu=mpu, **kwargs)[0]
    return _build_expert_parallel_engine(module, config, mpu, **kwargs)


def _build_expert_parallel_engine(module: nn.Module, config: dict[str, Any], mpu: Any,
                                  **kwargs: Any) -> Any:
    """`deepspeed.initialize`'s steps for a plain module, with the engine class below."""
    from deepspeed import comm, set_optimizer_flags, zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    class _ExpertParallelEngine(DeepSpeedEngine):
        """DeepSpeed's engine; its ZeRO-3 MoE checks run as if SP were 1, and the routed experts'
        LoRA adapters survive AutoEP's replacement (module docstring)."""

        def _validate_zero3_moe_compatibility(self) -> None:
            size = self.sequence_parallel_size
            self.sequence_parallel_size = 1
            try:
                super()._validate_zero3_moe_compatibility()
            finally:
                self.sequence_parallel_size = size

        def _configure_expert_parallel(self, model: nn.Module, collect_sources: Any = None) -> Any:
            adapters = take_expert_adapters(model)
            sources = super()._configure_expert_parallel(model, collect_sources)
            attach_expert_adapters(model, adapters)
            return sources

    zero.partition_parameters.shutdown_init_context()
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config_class = DeepSpeedConfig(config, mpu)
    set_optimizer_flags(config_class, module)
    engine = _ExpertParallelEngine(args=None, model=module, mpu=mpu, config=config,
                                   config_class=config_class, **kwargs)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
