"""`train.offload_activations`: DeepSpeed's `CheckpointHiddenStatesOffload` on the decoder
layers' checkpointed inputs, marked where ZeRO-3 cannot hide them.

DeepSpeed's `deepspeed.runtime.activation_checkpointing.offload_activations
.CheckpointHiddenStatesOffload` is a `saved_tensors_hooks` context: it moves the tensors it was
told to (`mark`, by identity) to pinned host buffers on a side stream when autograd saves them,
and brings each back when backward needs it. While entered, it marks the first argument of every
transformers `GradientCheckpointingLayer` call. Under ZeRO-3 that argument is not what the layer's
checkpoint saves: ZeRO-3's forward pre-hooks hand the forward a new tensor (its backward-tracking
wrapper), so DeepSpeed's mark never matches and nothing would move. `mark_layer_inputs` therefore
also marks the hidden states as the layer's forward receives them, after every hook (an instance
`forward`; the class and its checkpointing are untouched). A tensor marked twice (no ZeRO-3) is
consumed once by the save and once by DeepSpeed's own clean-up.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def mark_layer_inputs(layers: list[nn.Module], offload: Any) -> None:
    """Have each checkpointed decoder layer in `layers` mark its input hidden states
    [1, S_local, H] with `offload` (a CheckpointHiddenStatesOffload) when it checkpoints."""
    for layer in layers:
        layer.forward = functools.partial(_marking_forward, layer, type(layer).forward.__get__(layer), offload)


def _marking_forward(layer: nn.Module, forward, offload, hidden_states: torch.Tensor, *args, **kwargs):
    if layer.training and torch.is_grad_enabled() and getattr(layer, "gradient_checkpointing", False):
        offload.mark(hidden_states)
    return forward(hidden_states, *args, **kwargs)
