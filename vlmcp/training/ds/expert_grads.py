"""ZeRO stage 0 under AutoEP: the expert gradients' average, and the norm of the whole gradient.

At ZeRO 1-3 DeepSpeed's ZeRO optimizer reduces, measures and clips every gradient itself, and
gets expert parallelism right under SP. At stage 0 the engine does it (`buffered_allreduce_fallback`,
`clip_fp32_gradients`), and two things go wrong there under vlmcp's SP mpu (DeepSpeed 0.19.8):

1. **The average.** `DeepSpeedEngine._reduce_expert_gradients` sums each expert gradient over its
   expert-data-parallel (EDP) group and divides by the size of `groups._get_data_parallel_group()`.
   With an SP mpu that group is None, so the divisor is the world size W, not the data-parallel
   size W / P that the dense gradients are divided by (`_reduce_non_expert_gradients`): the routed
   experts trained P times too slowly, while the loss and the dense gradients looked right.
   `reduce_expert_gradients` is the same reduction with the dense gradients' divisor. Why a
   gradient summed over the EDP group is the world's: a rank's expert gradient holds every token
   its EP group routed to its experts, and the EDP group holds each EP group once.
2. **The norm.** `clip_fp32_gradients` (DeepSpeed's `clip_grad_norm_`) counts the parameters of
   the model-parallel rank 0 only (the SP mpu calls the SP group model-parallel) and averages the
   norms over the world: an EP rank's experts are left out or mixed in by the wrong weight.
   `global_grad_norm` is the L2 norm of the whole model's gradient: replicated gradients once, each
   routed expert once (a rank's experts' squares summed over its EP group, which holds every
   expert once). `clip_gradients` scales every gradient by that norm, the same factor on every
   rank, and vlmcp's training row reports the same norm (training/loop.py).

Both run on every rank at the accumulation boundary (after the gradients are reduced), and are
exact without expert parallelism too (no expert parameter: the local norm, every rank alike).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmcp.parallel import comm

#: DeepSpeed's clip coefficient guard (`clip_grad_norm_`'s max_norm / (norm + 1e-6)).
_CLIP_EPS = 1e-6


def is_expert_param(param: nn.Parameter) -> bool:
    """Whether `param` is one EP rank's own (AutoEP's routed experts and their LoRA factors):
    DeepSpeed reduces it over its EDP group only (`allreduce` False)."""
    return getattr(param, "allreduce", True) is False


def reduce_expert_gradients(engine: Any, expert_grads: dict[str, list[torch.Tensor]],
                            elements_per_buffer: int) -> None:
    """DeepSpeed's `_reduce_expert_gradients` with the dense gradients' divisor (module
    docstring): `expert_grads` {EP group name: gradients}, each summed over that group's EDP
    group and divided by the data-parallel size W / P, in place."""
    from deepspeed.runtime.engine import split_half_float_double_sparse
    from deepspeed.utils import groups

    dp_size = (comm.group_size(groups._get_sequence_data_parallel_group())
               / float(engine.sequence_parallel_size))
    for name, grads in expert_grads.items():
        edp_group = groups._get_expert_data_parallel_group(name)
        sparse, dense = split_half_float_double_sparse(grads)
        for found in sparse:
            if found:
                engine.sparse_allreduce_no_retain(found[1], dp_group=edp_group,
                                                  dp_world_size=dp_size)
        for found in dense:
            if found:
                engine.allreduce_no_retain(found[1], dp_group=edp_group,
                                           numel_per_bucket=elements_per_buffer,
                                           dp_world_size=dp_size)


def global_grad_norm(module: nn.Module) -> float:
    """The L2 norm of `module`'s whole gradient (every rank, after the reduction): the squares of
    the replicated gradients, plus those of this rank's experts summed over its EP group. The
    same value on every rank; inf or nan when a gradient is not finite."""
    from deepspeed.utils import groups

    squares = torch.zeros(2, dtype=torch.float64)
    expert_groups = set()
    for param in module.parameters():
        if param.grad is None:
            continue
        expert = is_expert_param(param)
        squares[int(expert)] += param.grad.detach().double().pow(2).sum()
        if expert:
            expert_groups.add(param.group_name)
    if len(expert_groups) > 1:
        raise ValueError(f"expert parameters of several EP groups ({sorted(expert_groups)}); "
                         "vlmcp runs one parallel.ep_size")
    if expert_groups:
        comm.all_reduce_sum(squares[1:], groups._get_expert_parallel_group(expert_groups.pop()))
    return float(squares.sum().sqrt())


def clip_gradients(module: nn.Module, max_norm: float) -> float:
    """Scale every gradient of `module` by min(1, max_norm / (norm + 1e-6)), `norm` =
    `global_grad_norm(module)` (every rank, the same factor); returns the norm before clipping."""
    norm = global_grad_norm(module)
    coef = max_norm / (norm + _CLIP_EPS)
    if coef < 1.0:
        for param in module.parameters():
            if param.grad is not None:
                param.grad.detach().mul_(coef)
    return norm
