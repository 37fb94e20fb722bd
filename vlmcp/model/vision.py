"""Keeping a frozen vision tower replicated, outside DeepSpeed's reach."""

from __future__ import annotations

from torch import nn


def replicated_copy(vision: nn.Module) -> nn.Module:
    """A frozen tower whose weights are whole on this rank.

    When the tower was loaded ZeRO-3-partitioned (parameters carry `ds_id`), its weights are
    gathered once into a fresh module of the same class; otherwise the tower is returned as it is.
    """
    params = list(vision.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return vision.requires_grad_(False)
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {name: t.detach().clone() for name, t in vision.state_dict().items()}
    plain = type(vision)(vision.config)
    plain.load_state_dict(state)
    plain.to(dtype=params[0].dtype)
    return plain.requires_grad_(False).eval()
