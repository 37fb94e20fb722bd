"""Exact recompute of the cheap elementwise steps that would otherwise keep fp32 tensors for backward.

Three places of Qwen3.5's decoder keep for backward more than their inputs although everything
they compute is elementwise per token (per-token KiB at Qwen3.5-35B-A3B's layout, measured with
`vlmcp bench --saved-bytes`):
  * full attention's per-head RMSNorms `q_norm`, `k_norm`: their input, fp32 `rsqrt`, output; and
    `q_norm`'s input is a view into `q_proj`'s output, so the gate half beside it stays too (48);
  * a Gated DeltaNet layer's gated RMSNorm (its input, gate, four fp32 intermediates: 80) and the
    norm's output, which `out_proj` keeps (16);
  * a MoE layer's routed-expert gate `act(gate) * up` (`_apply_gate` of transformers' grouped_mm
    and batched_mm experts): the activation's output, which the product keeps (16 per layer).
Here each runs transformers' own code under torch's non-reentrant checkpoint, which keeps the
step's inputs only and replays the same ops on the same inputs in backward, so values and every
gradient are those of the plain forward.

Why torch's checkpoint and not a hand-written autograd function: it replays transformers' own
forward (whatever the class is, and its rounding), it calls modules as modules during the replay
(ZeRO-3's gathers, PEFT's LoRA layers, hooks all work), it nests inside the decoder layers'
gradient checkpointing, and its early stop ends the replay as soon as the last saved tensor is
rebuilt. The early stop is what makes the norm + `out_proj` pair cheap: `out_proj` saves its input
before it multiplies, so the replay stops before the matmul and only the elementwise norm runs
again (with LoRA on `out_proj` the base matmul and the adapter's rank-r `lora_A` product run
before the adapter's last saved input, so they are replayed: one extra `[N, V] x [V, hidden]` and
one `[N, V] x [V, r]` product).

Applied always, whichever `model.deltanet_kernel` runs: these steps sit outside the DeltaNet core,
the recompute is exact, and it costs elementwise work only. Installed per module instance (an
instance `forward` or `_apply_gate`), never on transformers' classes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def is_head_norm_attention(module: nn.Module) -> bool:
    """True for a Qwen3.5 (dense or MoE) full-attention layer with per-head q/k RMSNorms."""
    return (type(module).__name__.endswith("Attention") and isinstance(getattr(module, "q_norm", None), nn.Module)
            and isinstance(getattr(module, "k_norm", None), nn.Module))


def has_gated_experts(module: nn.Module) -> bool:
    """True for transformers' routed experts with a gate (`_apply_gate`, `has_gate` set by
    `use_experts_implementation`)."""
    return callable(getattr(type(module), "_apply_gate", None)) and getattr(module, "has_gate", False)


def install_recompute(model: nn.Module) -> list[nn.Module]:
    """Run every full-attention layer's `q_norm` and `k_norm` in `model` through
    `recomputed_head_norm` and every gated routed-experts module's `_apply_gate` through
    `recomputed_expert_gate`. Returns the modules changed (for `uninstall_recompute`)."""
    changed = []
    for module in model.modules():
        if is_head_norm_attention(module):
            for norm in (module.q_norm, module.k_norm):
                norm.forward = functools.partial(recomputed_head_norm, norm)
                changed.append(norm)
        elif has_gated_experts(module):
            module._apply_gate = functools.partial(recomputed_expert_gate, module)
            changed.append(module)
    return changed


def uninstall_recompute(modules: list[nn.Module]) -> None:
    """Restore transformers' code on the modules `install_recompute` returned."""
    for module in modules:
        for name in ("forward", "_apply_gate"):
            module.__dict__.pop(name, None)


def recomputed_head_norm(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A per-head RMSNorm ([..., heads, D] -> the same): transformers' forward, under checkpoint
    when autograd records, so backward keeps one compact copy of its input.

    The input is copied when it is a strided view (`q_norm`'s is the query half of `q_proj`'s
    output, the gate half beside it): the checkpoint keeps the copy, and `q_proj`'s output, which
    nothing else keeps, is freed (48 -> 16 KiB per token at Qwen3.5-35B-A3B's layout). The copy
    is exact; its backward passes the gradient through."""
    if not torch.is_grad_enabled():
        return type(norm).forward(norm, hidden_states)
    return checkpoint(type(norm).forward, norm, hidden_states.contiguous(), use_reentrant=False)


def recomputed_expert_gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The routed experts' gate, [S, 2 I] (gate and up of each token-expert pair) -> [S, I]: the
    class's own `_apply_gate`, under checkpoint when autograd records, so backward keeps
    `gate_up` (which the activation and the product keep anyway) and not the activation's output
    (80 -> 64 KiB per token per layer at Qwen3.5-35B-A3B's layout)."""
    if not torch.is_grad_enabled():
        return type(experts)._apply_gate(experts, gate_up)
    return checkpoint(type(experts)._apply_gate, experts, gate_up, use_reentrant=False)


def gated_norm_then_project(norm: nn.Module, project: nn.Module, hidden_states: torch.Tensor,
                            gate: torch.Tensor) -> torch.Tensor:
    """A DeltaNet layer's gated RMSNorm then its `out_proj`: hidden_states, gate [L, H_v, V] ->
    [L, hidden], the norm over each head's V channels, `out_proj` over all H_v * V; both called
    as modules. Under autograd, one non-reentrant checkpoint keeps the norm's two inputs only:
    neither the norm's four fp32 intermediates nor `out_proj`'s input (80 + 16 -> 32 KiB per
    token at Qwen3.5-35B-A3B's layout); backward replays the norm, not the matmul (see the
    module docstring)."""
    if not torch.is_grad_enabled():
        return _norm_then_project(norm, project, hidden_states, gate)
    return checkpoint(_norm_then_project, norm, project, hidden_states, gate, use_reentrant=False)


def _norm_then_project(norm: nn.Module, project: nn.Module, hidden_states: torch.Tensor,
                       gate: torch.Tensor) -> torch.Tensor:
    length, heads, dim = hidden_states.shape
    normed = norm(hidden_states.reshape(length * heads, dim), gate.reshape(length * heads, dim))
    return project(normed.reshape(length, heads * dim))
