"""The job's torch optimizer and LR schedule (handed to `deepspeed.initialize`).

Used where the DeepSpeed config has no optimizer / scheduler block (training/ds/engine.py);
DeepSpeed's own optimizers JIT-compile ops on CPU (FusedAdam, CPUAdam), a torch optimizer never
does. The schedule is a `LambdaLR`: linear warmup from 0 over `warmup_steps`, then constant
or cosine decay to `min_lr_ratio * lr` at `train.max_steps`. DeepSpeed steps it once per optimizer
step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from vlmcp.config import OptimizerSection, SchedulerSection


class _VetoableStep:
    """Mixin: while `overflow` is true, step() changes nothing.

    DeepSpeed's engine reads `optimizer.overflow` after stepping, as it does for its own ZeRO and
    bf16/fp16 optimizers: a vetoed step also leaves the LR schedule where it was and counts in
    `engine.skipped_steps`. The training loop sets it on ZeRO-0 fp32, the one configuration where
    DeepSpeed does not check the gradients for NaN/Inf itself.
    """

    overflow = False

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch.optim.Optimizer.step's signature
        if self.overflow:
            return None
        return super().step(closure)


class AdamW(_VetoableStep, torch.optim.AdamW):
    """torch.optim.AdamW whose step can be vetoed (see `_VetoableStep`)."""


class SGD(_VetoableStep, torch.optim.SGD):
    """torch.optim.SGD whose step can be vetoed (see `_VetoableStep`)."""


def build_optimizer(params: Iterable[torch.nn.Parameter] | list[dict[str, Any]],
                    section: OptimizerSection) -> torch.optim.Optimizer:
    """AdamW or SGD (torch's, with a vetoable step) over `params` (the trainable ones, or param
    groups: dicts with "params")."""
    params = list(params)
    if params and isinstance(params[0], dict) and not any(group["params"] for group in params):
        raise ValueError("the model has no trainable parameters")
    if not params:
        raise ValueError("the model has no trainable parameters")
    if section.type == "adamw":
        return AdamW(params, lr=section.lr, betas=tuple(section.betas), eps=section.eps,
                     weight_decay=section.weight_decay, foreach=False)
    return SGD(params, lr=section.lr, momentum=section.momentum,
               weight_decay=section.weight_decay, foreach=False)


def lr_multiplier(step: int, section: SchedulerSection, max_steps: int) -> float:
    """LR factor applied at optimizer step `step` (0-based)."""
    if step < section.warmup_steps:
        return (step + 1) / (section.warmup_steps + 1)
    if section.type == "constant":
        return 1.0
    decay_steps = max(1, max_steps - section.warmup_steps)
    progress = min(1.0, (step - section.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return section.min_lr_ratio + (1.0 - section.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, section: SchedulerSection,
                    max_steps: int) -> LambdaLR:
    """The job's LambdaLR schedule."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, section, max_steps))


def can_veto(optimizer: object) -> bool:
    """Whether the loop can veto `optimizer`'s next step (a vlmcp torch optimizer; DeepSpeed's
    own optimizers, built from a config's optimizer block, cannot be vetoed)."""
    return isinstance(optimizer, _VetoableStep)
