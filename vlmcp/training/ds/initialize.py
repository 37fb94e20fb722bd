"""`deepspeed.initialize`, with one of DeepSpeed's refusals lifted: AutoEP under ZeRO-3 with SP.

DeepSpeed 0.19.8's engine asserts, while it sets up ZeRO-3 (`DeepSpeedEngine.
_validate_zero3_moe_compatibility`): "AutoEP with ZeRO Stage 3 does not support sequence
parallelism yet (sequence_parallel_size=P)". That is a guard, not a missing piece: ZeRO-3 already
partitions AutoEP's expert parameters over their expert-data-parallel group and the dense ones
over the sequence-data-parallel group, whatever P is. What SP needs of ZeRO-3 is that its
gradients average over DP, not over the world, and `zero3_sp.sp_exact_zero_settings` already sets
that up for every ZeRO-3 run under SP. tests/test_expert_parallel.py holds the result to the
float64 truth (plain transformers, each sample alone) at (SP, EP) = (2, 2), (2, 4) with DP 2 and
(4, 2) (expert-data-parallel groups of 2 ranks under SP) at ZeRO 3: loss and every gradient,
experts and routers included, within fp32's own error.

So for that one combination the engine is built from `_AutoEPSequenceParallelEngine`, DeepSpeed's
engine with every other ZeRO-3 MoE check kept, by the same steps `deepspeed.initialize` takes for
a plain (non-pipeline) module (`fill_deepspeed_config` refuses DeepSpeed's hybrid engine there).
`deepspeed.initialize` has no way to name the engine class, and patching `DeepSpeedEngine` itself
would change every engine of the process. Everything else goes through `deepspeed.initialize`
unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vlmcp.training.ds.config import zero_stage


def _lifts_sp_refusal(config: dict[str, Any], mpu: Any) -> bool:
    """ZeRO-3 with AutoEP on (the filled `expert_parallel` section) under SP > 1."""
    return (zero_stage(config) == 3
            and bool(config.get("expert_parallel", {}).get("enabled"))
            and mpu is not None and mpu.get_sequence_parallel_world_size() > 1)


def initialize_engine(module: nn.Module, config: dict[str, Any], mpu: Any, **kwargs: Any) -> Any:
    """The DeepSpeed engine of `module` (what `deepspeed.initialize(model=module, config=config,
    mpu=mpu, **kwargs)` returns first), on every rank; see the module docstring for the one
    combination it builds itself. `kwargs`: `optimizer`, `lr_scheduler`, `model_parameters`."""
    import deepspeed

    if not _lifts_sp_refusal(config, mpu):
        return deepspeed.initialize(model=module, config=config, mpu=mpu, **kwargs)[0]
    return _build_sequence_parallel_autoep(module, config, mpu, **kwargs)


def _build_sequence_parallel_autoep(module: nn.Module, config: dict[str, Any], mpu: Any,
                                    **kwargs: Any) -> Any:
    """`deepspeed.initialize`'s steps for a plain module, with the engine class below."""
    from deepspeed import comm, set_optimizer_flags, zero
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    class _AutoEPSequenceParallelEngine(DeepSpeedEngine):
        """DeepSpeed's engine; its ZeRO-3 MoE checks run as if SP were 1 (module docstring)."""

        def _validate_zero3_moe_compatibility(self) -> None:
            size = self.sequence_parallel_size
            self.sequence_parallel_size = 1
            try:
                super()._validate_zero3_moe_compatibility()
            finally:
                self.sequence_parallel_size = size

    zero.partition_parameters.shutdown_init_context()
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config_class = DeepSpeedConfig(config, mpu)
    set_optimizer_flags(config_class, module)
    engine = _AutoEPSequenceParallelEngine(args=None, model=module, mpu=mpu, config=config,
                                           config_class=config_class, **kwargs)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
