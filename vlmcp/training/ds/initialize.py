"""`deepspeed.initialize`, with AutoEP (`parallel.ep_size` > 1) built by a DeepSpeed engine
subclass that changes three things.

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
3. ZeRO stage 0's expert gradients and clipping: the engine reduces and clips there itself, and
   under an SP mpu it divides the expert gradients by the world size instead of the data-parallel
   size and clips by a norm that misses other EP ranks' experts; training/ds/expert_grads.py
   says why and does both over the right groups. ZeRO 1-3 do their own and are left alone.

tests/test_expert_parallel.py holds both to the float64 truth (plain transformers, each sample
alone; PEFT's adapters for LoRA): at (SP, EP) = (2, 2), (2, 4) with DP 2 and (4, 2) at ZeRO 3,
(2, 2) at ZeRO 0 and 1 (also with DP 2), and LoRA on the routed experts at (2, 2): loss and every
gradient within fp32's own error; at ZeRO 0 also the clipped update.

The engine is built by the same steps `deepspeed.initialize` takes for a plain (non-pipeline)
module (`fill_deepspeed_config` refuses DeepSpeed's hybrid engine under EP): `deepspeed.initialize`
has no way to name the engine class, and patching `DeepSpeedEngine` itself would change every
engine of the process. Without AutoEP everything goes through `deepspeed.initialize` unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vlmcp.training.ds.expert_grads import (clip_gradients, is_expert_param,
                                           reduce_expert_gradients)
from vlmcp.training.ds.expert_lora import attach_expert_adapters, take_expert_adapters


def initialize_engine(module: nn.Module, config: dict[str, Any], mpu: Any, **kwargs: Any) -> Any:
    """The DeepSpeed engine of `module` (what `deepspeed.initialize(model=module, config=config,
    mpu=mpu, **kwargs)` returns first), on every rank; with AutoEP on (the filled
    `expert_parallel` section) it is built by `build_own_engine` (module docstring).
    `kwargs`: `optimizer`, `lr_scheduler`, `model_parameters`."""
    import deepspeed

    if not config.get("expert_parallel", {}).get("enabled"):
        return deepspeed.initialize(model=module, config=config, mpu=mpu, **kwargs)[0]
    return build_own_engine(module, config, mpu, **kwargs)


def build_own_engine(module: nn.Module, config: dict[str, Any], mpu: Any, **kwargs: Any) -> Any:
    """`deepspeed.initialize`'s steps for a plain module, with the engine class below: on a
    module without AutoEP the same engine as `deepspeed.initialize`'s (tests/test_engine_build.py
    holds it to that: its optimizer, its groups, its config and a step)."""
    from deepspeed import comm, set_optimizer_flags, zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    class _ExpertParallelEngine(DeepSpeedEngine):
        """DeepSpeed's engine; its ZeRO-3 MoE checks run as if SP were 1, the routed experts'
        LoRA adapters survive AutoEP's replacement, and at ZeRO 0 the expert gradients are
        averaged and clipped over the right groups (module docstring)."""

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

        def _reduce_expert_gradients(self, expert_grads: Any, elements_per_buffer: int) -> None:
            reduce_expert_gradients(self, expert_grads, elements_per_buffer)

        def clip_fp32_gradients(self) -> None:
            if any(map(is_expert_param, self.module.parameters())):
                clip_gradients(self.module, self.gradient_clipping())
            else:  # DeepSpeed's own norm is right without experts (and bit for bit its own)
                super().clip_fp32_gradients()

    zero.partition_parameters.shutdown_init_context()
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config_class = DeepSpeedConfig(config, mpu)
    set_optimizer_flags(config_class, module)
    engine = _ExpertParallelEngine(args=None, model=module, mpu=mpu, config=config,
                                   config_class=config_class, **kwargs)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
