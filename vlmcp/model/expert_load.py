"""Visible expert load: how many tokens each MoE layer's routed experts received in an optimizer
step, summed over the world's ranks, and how far the busiest expert is from the mean.

Definition. For MoE layer l and expert e, load[l, e] = the (token, expert) pairs of the step's
micro-batches, on every rank, in which layer l selected e (the selection the experts computed:
the router's own top-k, or the replayed route; model.router_replay counts it, once per forward,
so a recompute in backward (activation checkpointing, TiledMLP) adds nothing). The rows of a
shard's padding are routed and computed like tokens, and count. A micro-batch of weight 0 (a
repeated pack that only keeps a rank's collectives in step) counts nothing.

Per layer, mean[l] = sum_e load[l, e] / E = tokens x K / E, and the imbalance is
max_e load[l, e] / mean[l] (1.0: every expert got the same; E / K: every token of the layer went
to the same K experts). The row reports the worst layer: its imbalance, its index, its max and
mean. A list per layer per expert (64 experts x 40 layers) would be most of a row; it is not
written.

Cost: one scatter-add of a forward's [n, K] selection into a [L_moe, E] counter per router call,
on the device, no sync; one all-reduce of L_moe x E float64 per optimizer step.

Legend: L_moe = MoE layers, E = num_experts, K = num_experts_per_tok.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmcp.parallel import comm

#: The row keys, in the order `ExpertLoad.take_row` writes them.
ROW_KEYS = ("expert_load_max_over_mean", "expert_load_layer", "expert_load_max",
            "expert_load_mean")


def count_selection(counts: torch.Tensor, layer: int, chosen: torch.Tensor) -> None:
    """Add one router call's selection `chosen` ([n, K] integer expert ids) to row `layer` of
    `counts` ([L_moe, E] long, on the same device): counts[layer, e] += how often e was chosen."""
    flat = chosen.reshape(-1)
    counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))


class ExpertLoad:
    """One rank's expert load since the last `take_row`; `add` a forward's counts, `take_row`
    (every rank together) for the world's."""

    def __init__(self, layers: int, num_experts: int) -> None:
        self.layers = layers
        self.num_experts = num_experts
        #: [L_moe, E] float64 on the routers' device, the micro-batches' counts times their weight
        self._step: torch.Tensor | None = None

    def add(self, counts: torch.Tensor, weight: float) -> None:
        """Add one forward's counts ([L_moe, E] long, this rank's shard) times `weight`."""
        if self._step is None:
            self._step = torch.zeros(counts.shape, dtype=torch.float64, device=counts.device)
        self._step.add_(counts, alpha=weight)

    def take_row(self, device: torch.device) -> dict[str, Any]:
        """The training row's expert-load entries over the world since the last call, and start
        again (every rank calls it together: one all-reduce of [L_moe, E]; `device` holds the
        counter when no forward counted yet). None entries when no token was routed."""
        if self._step is None:
            self._step = torch.zeros(self.layers, self.num_experts, dtype=torch.float64,
                                     device=device)
        load = comm.all_reduce_sum(self._step.clone()).cpu()
        self._step.zero_()
        return load_row(load)


def load_row(load: torch.Tensor) -> dict[str, Any]:
    """The row entries of a step's world load ([L_moe, E] tokens per expert): the worst layer's
    max / mean, its index, its max and its mean (all None when no token was routed)."""
    mean = load.mean(dim=1)
    if not bool((mean > 0).any()):
        return dict.fromkeys(ROW_KEYS)
    peak = load.max(dim=1).values
    ratio = torch.where(mean > 0, peak / mean.clamp(min=1e-300), torch.zeros_like(mean))
    worst = int(ratio.argmax())
    return {"expert_load_max_over_mean": float(ratio[worst]), "expert_load_layer": worst,
            "expert_load_max": int(round(float(peak[worst]))),
            "expert_load_mean": float(mean[worst])}
