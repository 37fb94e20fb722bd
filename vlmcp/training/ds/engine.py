"""What `deepspeed.initialize` gets for the optimizer and LR schedule, and what it then runs.

HF Trainer's split (training/ds/blocks.py): a DeepSpeed config block is built by DeepSpeed, the
job's section by vlmcp:

    optimizer block   scheduler block   deepspeed.initialize gets
    no                no                the job's torch optimizer and its LambdaLR
    yes               no                no optimizer; a callable building the job's LambdaLR on
                                        DeepSpeed's optimizer
    no                yes               the job's torch optimizer; no scheduler
    yes               yes               neither

Under expert parallelism (`parallel.ep_size` > 1, no optimizer block) the job's optimizer is
handed over as a callable instead: DeepSpeed builds it after AutoEP's replacement, over the MoE
param groups (training/ds/expert_parallel.py), and the LR schedule the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmcp.config import JobConfig
from vlmcp.training.ds.edits import ABSENT, get_path
from vlmcp.training.ds.expert_parallel import moe_optimizer_factory
from vlmcp.training.optim import build_optimizer, build_scheduler


def engine_optim_args(job: JobConfig, ds_config: dict[str, Any],
                      trainable: list[torch.nn.Parameter]) -> dict[str, Any]:
    """`optimizer` and `lr_scheduler` keyword arguments of `deepspeed.initialize` (see above)."""
    optimizer: Any = None
    if "optimizer" not in ds_config:
        optimizer = (moe_optimizer_factory(lambda groups: build_optimizer(groups, job.optimizer))
                     if job.parallel.ep_size > 1 else build_optimizer(trainable, job.optimizer))
    if "scheduler" in ds_config:
        scheduler: Any = None
    elif not isinstance(optimizer, torch.optim.Optimizer):
        def scheduler(built: torch.optim.Optimizer) -> Any:
            return build_scheduler(built, job.scheduler, job.train.max_steps)
    else:
        scheduler = build_scheduler(optimizer, job.scheduler, job.train.max_steps)
    return {"optimizer": optimizer, "lr_scheduler": scheduler}


def _offload(config: dict[str, Any], what: str) -> str:
    device = get_path(config, f"zero_optimization.offload_{what}.device")
    return "none" if device is ABSENT else str(device)


def describe_engine(engine: Any, config: dict[str, Any]) -> str:
    """One line: what DeepSpeed runs (optimizer class, scheduler, ZeRO stage, offload devices,
    precision, accumulation, clipping, and AutoEP's expert parallelism when it runs)."""
    basic = getattr(engine, "basic_optimizer", None) or engine.optimizer
    source = "deepspeed config" if "optimizer" in config else "job"
    scheduler = type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else "none"
    scheduler_source = "deepspeed config" if "scheduler" in config else "job"
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    clip = engine.gradient_clipping()
    return (f"DeepSpeed runs: optimizer {type(basic).__module__}.{type(basic).__name__} "
            f"(from the {source}), wrapped by {type(engine.optimizer).__name__}; "
            f"scheduler {scheduler} (from the {scheduler_source}); "
            f"ZeRO stage {engine.zero_optimization_stage()}; offload optimizer "
            f"{_offload(config, 'optimizer')}, params {_offload(config, 'param')}; "
            f"precision {precision}; gradient accumulation "
            f"{engine.gradient_accumulation_steps()}; gradient clipping {clip or 'off'}"
            + _expert_parallel_part(config))


def _expert_parallel_part(config: dict[str, Any]) -> str:
    size = get_path(config, "expert_parallel.autoep_size")
    if get_path(config, "expert_parallel.enabled") is not True or size is ABSENT:
        return ""
    return f"; expert parallelism {size} (DeepSpeed AutoEP)"
