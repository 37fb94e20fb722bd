"""A DeepSpeed config's own `optimizer` and `scheduler` blocks, with HF Trainer's semantics.

A block in the DeepSpeed config wins: DeepSpeed builds that optimizer (with
`zero_optimization.offload_optimizer` that is DeepSpeed's CPU Adam) or that LR scheduler, and
the job's `optimizer` / `scheduler` sections only fill the block's "auto" params:

    optimizer.params.lr            optimizer.lr
    optimizer.params.betas         optimizer.betas
    optimizer.params.eps           optimizer.eps
    optimizer.params.weight_decay  optimizer.weight_decay
    optimizer.params.momentum      optimizer.momentum
    scheduler.params.warmup_min_lr 0
    scheduler.params.warmup_max_lr the optimizer's lr (the block's, when DeepSpeed builds it)
    scheduler.params.warmup_num_steps  scheduler.warmup_steps (at least 1: DeepSpeed >= 0.19.6
                                   rejects 0, as HF Trainer does)
    scheduler.params.total_num_steps   train.max_steps
    scheduler.params.warmup_min_ratio  0
    scheduler.params.cos_min_ratio     scheduler.min_lr_ratio

A job key the job sets itself whose value the block overrides is logged as a warning naming both.
Without a block, vlmcp passes its own torch optimizer / LambdaLR (training/optim.py); an
optimizer block alone gets the job's LambdaLR on DeepSpeed's optimizer, a scheduler block alone
runs on the job's torch optimizer.

`zero_force_ds_cpu_optimizer: true` with `offload_optimizer` and no optimizer block asks for
DeepSpeed's CPU optimizer, so the job's AdamW section becomes an `AdamW` block (logged).
"""

from __future__ import annotations

import logging
from typing import Any

from vlmcp.config import JobConfig
from vlmcp.training.ds.edits import ABSENT, DeepSpeedEdits, get_path, shown

logger = logging.getLogger(__name__)

#: DeepSpeed devices that put the optimizer step on the CPU.
OFFLOAD_DEVICES = ("cpu", "nvme")


def offloads_optimizer(config: dict[str, Any]) -> bool:
    """Whether ZeRO offloads the optimizer (DeepSpeed then steps it with its CPU optimizer)."""
    return get_path(config, "zero_optimization.offload_optimizer.device") in OFFLOAD_DEVICES


def _fill_params(config: dict[str, Any], block: str, values: dict[str, tuple[Any, str]],
                 job: JobConfig, edits: DeepSpeedEdits) -> None:
    """Fill "auto" params of `block` from `values` (param -> (value, job key)); warn where a
    number the block gives overrides a job key the job set itself."""
    params = config[block].setdefault("params", {})
    for name, (value, job_key) in values.items():
        current = params.get(name, ABSENT)
        if current == "auto":
            edits.set(config, f"{block}.params.{name}", value, f"\"auto\" from {job_key}")
        elif (current is not ABSENT and job_key in job.explicit_keys
              and current != value):
            logger.warning("deepspeed config %s.params.%s=%s wins over the job's %s=%s (HF "
                           "Trainer semantics: the DeepSpeed block is used as written)",
                           block, name, shown(current), job_key, shown(value))


def _warn_unused(job: JobConfig, section: str, keys: list[str], block_type: Any) -> None:
    unused = [k for k in keys if f"{section}.{k}" in job.explicit_keys]
    for key in unused:
        logger.warning("the job's %s.%s is not used: the deepspeed config's %s block (type %s) "
                       "is what DeepSpeed runs", section, key, section, shown(block_type))


def fill_optimizer_block(config: dict[str, Any], job: JobConfig, edits: DeepSpeedEdits) -> None:
    """Fill the optimizer block's "auto" params from the job; make one from the job when
    `zero_force_ds_cpu_optimizer` asks for DeepSpeed's CPU optimizer (see module docstring)."""
    section = job.optimizer
    if "optimizer" not in config:
        force = config.get("zero_force_ds_cpu_optimizer", ABSENT)
        if not (offloads_optimizer(config) and force is True):
            return
        if section.type != "adamw":
            edits.problem(f"config key 'deepspeed.zero_force_ds_cpu_optimizer' is true with "
                          f"offload_optimizer, which needs DeepSpeed's CPU Adam, but "
                          f"optimizer.type={section.type!r}; use adamw, or set it to false to "
                          "step the torch optimizer on the CPU")
            return
        edits.set(config, "optimizer", {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "zero_force_ds_cpu_optimizer=true with offload_optimizer: DeepSpeed's CPU Adam "
            "from the job's optimizer section")
    block = config["optimizer"]
    if not isinstance(block, dict) or "type" not in block:
        edits.problem("config key 'deepspeed.optimizer': expected an object with a \"type\"")
        return
    _fill_params(config, "optimizer", {
        "lr": (section.lr, "optimizer.lr"),
        "betas": (list(section.betas), "optimizer.betas"),
        "eps": (section.eps, "optimizer.eps"),
        "weight_decay": (section.weight_decay, "optimizer.weight_decay"),
        "momentum": (section.momentum, "optimizer.momentum"),
    }, job, edits)
    _warn_unused(job, "optimizer", ["type"], block["type"])
    logger.info("optimizer: DeepSpeed builds the deepspeed config's %s block; the job's optimizer "
                "section fills its \"auto\" params only", shown(block["type"]))


def fill_scheduler_block(config: dict[str, Any], job: JobConfig, edits: DeepSpeedEdits) -> None:
    """Fill the scheduler block's "auto" params from the job (see module docstring)."""
    if "scheduler" not in config:
        return
    block = config["scheduler"]
    if not isinstance(block, dict) or "type" not in block:
        edits.problem("config key 'deepspeed.scheduler': expected an object with a \"type\"")
        return
    lr = get_path(config, "optimizer.params.lr")
    lr_key = "deepspeed optimizer.params.lr"
    if lr is ABSENT or not isinstance(lr, (int, float)):
        lr, lr_key = job.optimizer.lr, "optimizer.lr"
    _fill_params(config, "scheduler", {
        "warmup_min_lr": (0.0, "0 (warmup starts from zero)"),
        "warmup_max_lr": (lr, lr_key),
        "warmup_num_steps": (max(1, job.scheduler.warmup_steps), "scheduler.warmup_steps"),
        "total_num_steps": (job.train.max_steps, "train.max_steps"),
        "warmup_min_ratio": (0.0, "0 (warmup starts from zero)"),
        "cos_min_ratio": (job.scheduler.min_lr_ratio, "scheduler.min_lr_ratio"),
    }, job, edits)
    _warn_unused(job, "scheduler", ["type"], block["type"])
    logger.info("scheduler: DeepSpeed builds the deepspeed config's %s block; the job's "
                "scheduler section fills its \"auto\" params only", shown(block["type"]))
