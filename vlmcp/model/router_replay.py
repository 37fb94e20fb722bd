"""MoE routing replay: every MoE layer selects the experts the data names, with the router's own
gates, on each rank's shard of a packed, sequence-parallel micro-batch.

Definition (R3, rollout routing replay; R2, trainer routing replay, whose routes come from
`vlmcp score --routes`). For token t of MoE layer l with a route r (K distinct expert ids) the
router computes its logits and probabilities p = softmax(W x_t) (fp32) as usual, then **selects r**
instead of its own top-k, with the gates p[r] / sum(p[r]) cast to the logits' dtype: Qwen3.5-MoE's
own top-k normalisation, applied at the replayed experts. The router weight so still gets its
gradient through p. A (token, layer) without a route routes natively (its top-k, the class's own
gates).

The hook: each `Qwen3_5MoeTopKRouter` instance (the `gate` of a `Qwen3_5MoeSparseMoeBlock`) gets
an instance `forward` that runs the class's forward (whatever kernel the class runs), then, where
the shard has routes, replaces the selection and recomputes the gates from the class's logits.
This is the narrowest point: the block hands the router's (weights, ids) to the experts, so the
routed experts (PEFT's LoRA on them too), their gate recompute (model.recompute), the shared
expert and ZeRO-3's gathers all run unchanged. Nothing global is patched; without routes the class's
output is returned as it is.

Under expert parallelism (`parallel.ep_size` > 1) DeepSpeed's AutoEP replaces each MoE block,
router included, inside `deepspeed.initialize`; `rebind` then hooks its `TokenChoiceTopKRouter`
the same way (the replayed experts, the softmax gates renormalised over them), and the
selection reaches the experts on whichever EP rank holds them through AutoEP's own all-to-all.

Where the routes come from: `RouterReplay.micro_batch` (entered by `PackedVLM.micro_batch(batch)`
around a micro-batch's forward *and* backward) holds this rank's shard of the pack's routes, so a
recomputation in backward (activation checkpointing, TiledMLP) replays the same routes. A MoE
layer's router sees all S_local rows of the shard at once, or under `train.tiled_mlp` one tile at a
time; `tile` then names the tile's rows (model.tiled_mlp).

Visible replay, per forward (`counting`): every MoE layer must see each of the shard's rows once
(a hook that did not fire, or fired twice, is an error: the failure of verl #7340), and it counts
the replayed (token, layer) rows and those whose native top-k *set* equals the replayed set; the
training rows report their sums (`router_replay_tokens`, `router_replay_agreement`). The same
count holds the experts each layer selected (replayed or native), the step's expert load
(model.expert_load).

Legend: S_local = this rank's shard length, L_moe = MoE layers, K = num_experts_per_tok,
E = num_experts, n = the rows one router call sees (S_local, or a tile).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from deepspeed.moe.ep_count import count_tokens_per_expert
from deepspeed.moe.ep_router import TokenChoiceTopKRouter
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

from vlmcp.data.batch import PackedBatch
from vlmcp.data.routes import no_route
from vlmcp.model.expert_load import ExpertLoad, count_selection
from vlmcp.parallel import comm
from vlmcp.parallel.shard import ShardPlan


def moe_routers(language_model: nn.Module) -> list[nn.Module]:
    """The MoE routers of a language model, in layer order (empty for a dense model):
    transformers' `Qwen3_5MoeTopKRouter`, or under expert parallelism the `TokenChoiceTopKRouter`
    DeepSpeed's AutoEP put in its place (training/ds/expert_parallel.py)."""
    return [m for m in language_model.modules()
            if isinstance(m, (Qwen3_5MoeTopKRouter, TokenChoiceTopKRouter))]


@dataclass
class ShardRoutes:
    """This rank's routes. ids: [S_local, L_moe, K] long (garbage where not routed); routed:
    [S_local, L_moe] bool, the (token, layer) rows that have a route (padding has none)."""

    ids: torch.Tensor
    routed: torch.Tensor

    @classmethod
    def of(cls, batch: PackedBatch, plan: ShardPlan, device: torch.device) -> ShardRoutes:
        """The shard of `batch.routes` (host [S, L_moe, K]) that `plan` gives this rank."""
        sentinel = no_route(batch.routes.dtype)
        # widened on the host (uint16 has few device kernels), this rank's rows only
        local = plan.shard(batch.routes, dim=0, pad_value=sentinel).long().to(device)
        return cls(ids=local, routed=(local != sentinel).all(dim=-1))


class ReplayCounts:
    """One forward's counts on this rank: rows each MoE layer saw, (token, layer) rows replayed,
    those whose native top-k set equalled the replayed one (0-dim tensors), and the times each
    layer selected each expert (`selected` [L_moe, E] long); on the device, no sync until read."""

    def __init__(self, layers: int, num_experts: int, device: torch.device) -> None:
        self.seen = [0] * layers
        self.replayed = torch.zeros((), dtype=torch.float64, device=device)
        self.agreed = torch.zeros((), dtype=torch.float64, device=device)
        self.selected = torch.zeros(layers, num_experts, dtype=torch.long, device=device)


class RouterReplay:
    """Replays routes on every MoE router of `language_model` (see the module docstring).

    Raises ValueError when the model has no MoE router, or when the routers are not one per decoder
    layer of `num_layers` (the layers a route covers).
    """

    def __init__(self, language_model: nn.Module, num_layers: int) -> None:
        self._language_model = language_model
        self._num_layers = num_layers
        self.routers: list[nn.Module] = []
        self.rebind()
        self._batch: PackedBatch | None = None
        self._routes: ShardRoutes | None = None
        self._rows: torch.Tensor | None = None
        self._counts: ReplayCounts | None = None
        self._recorded: torch.Tensor | None = None
        self._last: ReplayCounts | None = None
        #: [replayed rows, agreeing rows] of the micro-batches since the last `take_totals`,
        #: each micro-batch's weighted.
        self._totals = torch.zeros(2, dtype=torch.float64)
        #: The experts the layers selected in the micro-batches since the last `take_load`.
        self._load = ExpertLoad(self.layers, self.num_experts)

    def rebind(self) -> None:
        """Hook the language model's routers as they are now: called once at construction and
        again after DeepSpeed's AutoEP replaced the MoE blocks (`PackedVLM.adopt_expert_parallel`)."""
        routers = moe_routers(self._language_model)
        if len(routers) != self._num_layers:
            raise ValueError(f"routing replay: the model has {len(routers)} MoE routers for "
                             f"{self._num_layers} MoE layers; routes need one router per layer")
        for layer, router in enumerate(routers):
            hook = self._forward if isinstance(router, Qwen3_5MoeTopKRouter) else self._autoep_forward
            router.forward = functools.partial(hook, router, layer)
        self.routers = routers

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def num_experts(self) -> int:
        return self.routers[0].num_experts

    @property
    def device(self) -> torch.device:
        """Where the routers run (read per micro-batch: the engine may move the model)."""
        return next(self.routers[0].parameters()).device

    def shard_routes(self, batch: PackedBatch, plan: ShardPlan) -> ShardRoutes | None:
        """This rank's `ShardRoutes` of `batch` (None without routes); ValueError when the routes
        cover another number of MoE layers than the model has (verl #7340)."""
        if batch.routes is None:
            return None
        if batch.routes.shape[1] != self.layers:
            raise ValueError(f"{', '.join(batch.sample_ids[:3])}: routes of "
                             f"{batch.routes.shape[1]} MoE layers for a model with {self.layers}")
        return ShardRoutes.of(batch, plan, self.device)

    @contextmanager
    def micro_batch(self, batch: PackedBatch, plan: ShardPlan, weight: float = 1.0
                    ) -> Iterator[None]:
        """Replay `batch`'s routes (its shard under `plan`) while the block runs: its forward and
        its backward. On leaving, the last forward's counts join the totals and the expert load,
        times `weight`."""
        self._last = None
        with self._holding(batch, plan):
            yield
        if self._last is not None:
            self._totals += torch.stack([self._last.replayed, self._last.agreed]).cpu() * weight
            self._load.add(self._last.selected, weight)

    def for_forward(self, batch: PackedBatch, plan: ShardPlan) -> Any:
        """The context one forward of `batch` runs in: nothing more when `micro_batch(batch)`
        holds it; else, without autograd (scoring, evaluation), its routes for this forward.
        A pack with routes that trains outside `micro_batch` is an error: its backward could
        recompute without them."""
        if self._batch is batch or (batch.routes is None and self._routes is None):
            return nullcontext()
        if batch.routes is not None and torch.is_grad_enabled():
            raise RuntimeError("a micro-batch with routes must train inside "
                               "PackedVLM.micro_batch(batch): its backward replays them too")
        return self._holding(batch, plan)

    @contextmanager
    def _holding(self, batch: PackedBatch, plan: ShardPlan) -> Iterator[None]:
        previous = (self._batch, self._routes)
        self._batch, self._routes = batch, self.shard_routes(batch, plan)
        try:
            yield
        finally:
            self._batch, self._routes = previous

    @contextmanager
    def counting(self, local_len: int) -> Iterator[ReplayCounts]:
        """Count one forward of a shard of `local_len` rows (see the module docstring); on leaving,
        a MoE layer that did not see every row once is a RuntimeError."""
        counts = self._counts = ReplayCounts(self.layers, self.num_experts, self.device)
        try:
            yield counts
        finally:
            self._counts = None
        wrong = [(layer, seen) for layer, seen in enumerate(counts.seen) if seen != local_len]
        if wrong and self._routes is not None:
            raise RuntimeError(f"routing replay: MoE layer {wrong[0][0]} routed {wrong[0][1]} rows "
                               f"in one forward of a {local_len}-row shard (a router hook that did "
                               "not fire, or fired twice)")
        self._last = counts

    @contextmanager
    def recording(self, local_len: int) -> Iterator[torch.Tensor]:
        """Within the block, the experts each MoE layer selects (replayed or native) are written
        into the yielded [local_len, L_moe, K] long tensor."""
        top_k = self.routers[0].top_k
        self._recorded = torch.full((local_len, self.layers, top_k), -1, dtype=torch.long,
                                    device=self.device)
        try:
            yield self._recorded
        finally:
            self._recorded = None

    @contextmanager
    def tile(self, rows: torch.Tensor) -> Iterator[None]:
        """Within the block, router calls see the shard's rows `rows` ([n] long) only."""
        previous, self._rows = self._rows, rows
        try:
            yield
        finally:
            self._rows = previous

    @property
    def needs_rows(self) -> bool:
        """Whether router calls must know which of the shard's rows they see (routes replayed)."""
        return self._routes is not None

    def take_load(self) -> dict[str, Any]:
        """The expert-load entries of the training row over the world since the last call (every
        rank calls it together: one all-reduce; model.expert_load)."""
        return self._load.take_row(self.device)

    def take_totals(self) -> tuple[float, float]:
        """(replayed rows, agreeing rows) over the world since the last call (every rank calls it
        together: one all-reduce), and start again."""
        totals = comm.all_reduce_sum(self._totals.clone())
        self._totals.zero_()
        return float(totals[0]), float(totals[1])

    def _forward(self, router: nn.Module, layer: int, hidden_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """transformers' router: [n, H] -> (logits [n, E], gates [n, K], experts [n, K] long),
        the class's forward with the replayed selection where this rank's routes have one."""
        logits, gates, chosen = type(router).forward(router, hidden_states)
        replayed = self._replay(layer, chosen, lambda: logits)
        if replayed is not None:
            chosen, picked = replayed
            gates = (picked / picked.sum(dim=-1, keepdim=True)).to(logits.dtype)
        return logits, gates, chosen

    def _autoep_forward(self, router: nn.Module, layer: int, x: torch.Tensor,
                        expert_bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """AutoEP's router: [n, H] -> (gates [n, K] fp32, experts [n, K] long, tokens per expert
        [E] int32), the class's forward with the replayed selection where this rank's routes have
        one; its gates are the class's own normalisation (sum 1, times `route_scale`) of the
        softmax at the selected experts, from a second call of its gate (the logits it does not
        return)."""
        gates, chosen, per_expert = type(router).forward(router, x, expert_bias)
        replayed = self._replay(layer, chosen, lambda: router.gate(x))
        if replayed is not None:
            chosen, picked = replayed
            gates = picked / picked.sum(dim=-1, keepdim=True) * router.route_scale
            per_expert = count_tokens_per_expert(chosen, router.num_experts)
        return gates, chosen, per_expert

    def _replay(self, layer: int, native: torch.Tensor, logits_of: Any
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s selection given its router's native one [n, K]: (the selected experts
        [n, K] long, their softmax probabilities [n, K] fp32) where this rank's routes replay, else
        None; `logits_of()` gives the router's logits [n, E]. Counts (within `counting`: once
        per forward, never in a recompute) and records the selection."""
        rows = self._rows if self._rows is not None else slice(None)
        chosen, result = native, None
        if self._routes is not None:
            routed = self._routes.routed[rows, layer]
            ids = self._routes.ids[rows, layer]
            if routed.shape[0] != native.shape[0]:
                raise RuntimeError(f"routing replay: MoE layer {layer} got {native.shape[0]} rows "
                                   f"where the routes hold {routed.shape[0]}")
            chosen = torch.where(routed[:, None], ids, native)
            probs = F.softmax(logits_of(), dim=-1, dtype=torch.float)
            result = chosen, probs.gather(-1, chosen)
            if self._counts is not None:
                same = (native.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1)
                self._counts.replayed += routed.sum()
                self._counts.agreed += (routed & same).sum()
        if self._counts is not None:
            self._counts.seen[layer] += native.shape[0]
            count_selection(self._counts.selected, layer, chosen)
        if self._recorded is not None:
            self._recorded[rows, layer] = chosen.detach()
        return result
