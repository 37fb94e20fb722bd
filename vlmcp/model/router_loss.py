"""The MoE router load-balancing loss of a packed, sequence-parallel micro-batch.

transformers (`load_balancing_loss_func`, Switch Transformer eqs. 4-6) computes, for one forward
of a padded batch with an attention mask, over the real tokens t of the batch and the MoE layers l:

    counts[e] = sum_{l,t} [e in top-k(softmax(logits_{l,t}))]     (no gradient; the selected
                                                                   experts under replay)
    probs[e]  = sum_{l,t} softmax(logits_{l,t})[e]
    rows      = (number of MoE layers) x (number of real tokens)
    aux       = E * sum_e (counts[e] / rows) * (probs[e] / rows)

vlmcp computes the same three sums from the router logits of this rank's shard (forward hooks on
each layer's router, registered for one forward and removed after it; padding rows weigh zero),
sums them over the SP group with a differentiable all-reduce, and so gets the micro-batch's `aux`
on every rank of the group: SP=P equals SP=1, and a pack of several samples gives what
transformers gives for those samples batched and right-padded with an attention mask.

Gradient convention: every rank of the SP group returns its share `aux / P`; the shares of the
group sum to `aux`, and the all-reduce's backward sums the ranks' gradients, so the group's
gradients (which DeepSpeed sums over ranks) are exactly d(aux). The training step adds
`router_aux_loss_coef x share` to each micro-batch's backward value (see `router_objective`).

With routing replay (model.router_replay), counts[e] counts the experts the layers *selected*
(the replayed ones where a route is given, top-k elsewhere) and probs stays the router's own
softmax: the loss balances the load the experts actually carried in this step, and its gradient
reaches the router through the probabilities, as without replay. (Counting the router's native
top-k instead would balance a load no expert carried; either count has no gradient.) Without
routes the selected experts are the top-k, so nothing changes.

Under expert parallelism DeepSpeed's AutoEP replaces each MoE block and its router; `rebind`
captures its `TokenChoiceTopKRouter`, whose logits are its gate's output (computed once more in
the hook: the router returns gates, not logits) and whose selection is the one its experts ran.

Legend: S_local = this rank's shard length, E = num_experts, k = num_experts_per_tok.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

from vlmcp.model.router_replay import moe_routers
from vlmcp.parallel import comm


def router_config_problem(text_config: PretrainedConfig) -> str | None:
    """Why `model.router_aux_loss: true` cannot apply to a checkpoint (None when it can)."""
    needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    missing = [key for key in needed if getattr(text_config, key, None) is None]
    if missing:
        return (f"config key 'model.router_aux_loss': the checkpoint ({text_config.model_type}) is "
                f"not a mixture-of-experts model (its text config has no {', '.join(missing)})")
    return None


class RouterStats:
    """Running sums of one micro-batch's router statistics on this rank's shard.

    real: [S_local] fp32, 1 on real tokens, 0 on padding. After the forward: counts [E] fp32
    (top-k assignments, no gradient), probs [E] fp32 (softmax sums, differentiable), rows (0-dim
    fp32: real tokens x routed layers).
    """

    def __init__(self, real: torch.Tensor, num_experts: int, top_k: int) -> None:
        self.real = real
        self.top_k = top_k
        self.counts = torch.zeros(num_experts, dtype=torch.float32, device=real.device)
        self.probs = torch.zeros(num_experts, dtype=torch.float32, device=real.device)
        self.rows = torch.zeros((), dtype=torch.float32, device=real.device)

    def add(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        """Add one layer's router logits [S_local, E] (in the model's dtype) and the experts it
        selected [S_local, k] (its top-k, or the replayed ones)."""
        if logits.shape[0] != self.real.shape[0]:
            raise ValueError(f"router logits have {logits.shape[0]} rows; the shard has {self.real.shape[0]} tokens")
        # Saved tensors stay plain here: inside an activation-checkpointed layer, these ops are not
        # part of the recomputation, so they must not register with the checkpoint.
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            probs = F.softmax(logits, dim=-1)
            self.probs = self.probs + (probs.float() * self.real[:, None]).sum(dim=0)
        with torch.no_grad():
            self.counts.scatter_add_(0, chosen.reshape(-1), self.real.repeat_interleave(self.top_k))
            self.rows += self.real.sum()

    def share(self, group: comm.ProcessGroup | None) -> torch.Tensor:
        """This rank's share of the micro-batch's aux loss: aux / P (0-dim fp32, identical on the
        ranks of `group`). Every rank of the group must call it (one all-reduce of [2E + 1])."""
        num_experts = self.counts.numel()
        local = torch.cat([self.counts, self.rows.reshape(1), self.probs])
        total = comm.all_reduce_sum_autograd(local, group)
        counts, rows, probs = total[:num_experts], total[num_experts], total[num_experts + 1:]
        aux = num_experts * torch.sum((counts / rows) * (probs / rows))
        return aux / comm.group_size(group)


class RouterAuxLoss:
    """Captures the router logits of a Qwen3.5-MoE language model, one forward at a time.

    language_model: the text model whose layers hold `Qwen3_5MoeTopKRouter` routers;
    text_config: its config (num_experts, num_experts_per_tok, router_aux_loss_coef).
    Raises ValueError naming `model.router_aux_loss` when the model has no router.
    """

    def __init__(self, language_model: nn.Module, text_config: PretrainedConfig) -> None:
        problem = router_config_problem(text_config)
        routers = moe_routers(language_model)
        if problem is None and not routers:
            problem = "config key 'model.router_aux_loss': the model has no MoE router modules"
        if problem is not None:
            raise ValueError(problem)
        self._language_model = language_model
        self.routers = routers
        self.num_experts = int(text_config.num_experts)
        self.top_k = int(text_config.num_experts_per_tok)
        self.coef = float(text_config.router_aux_loss_coef)

    def rebind(self) -> None:
        """Capture the language model's routers as they are now: after DeepSpeed's AutoEP
        replaced the MoE blocks (`PackedVLM.adopt_expert_parallel`), its `TokenChoiceTopKRouter`s."""
        self.routers = moe_routers(self._language_model)

    @contextmanager
    def capture(self, real: torch.Tensor) -> Iterator[RouterStats]:
        """Within the block, every router call adds its logits to the yielded stats.

        real: [S_local] (bool or float), the shard's real (non-padding) tokens. The hooks exist
        only inside the block: a recomputation in backward (activation checkpointing) or a plain
        transformers call outside it adds nothing.
        """
        stats = RouterStats(real.to(torch.float32), self.num_experts, self.top_k)

        def record(module: nn.Module, args: tuple, output: tuple) -> None:
            if isinstance(module, Qwen3_5MoeTopKRouter):
                stats.add(output[0], output[2])
            else:
                # AutoEP's router returns (gates, experts, tokens per expert): its logits are its
                # gate's output, computed again here ([n, E], differentiable)
                stats.add(module.gate(args[0]), output[1])

        handles = [router.register_forward_hook(record) for router in self.routers]
        try:
            yield stats
        finally:
            for handle in handles:
                handle.remove()


def router_objective(share: torch.Tensor | None, coef: float) -> torch.Tensor | float:
    """What a micro-batch adds to the value handed to `engine.backward`: coef x share (0 without
    a router loss). DeepSpeed divides it by the accumulation steps and averages over DP, so the
    step's router term is coef x the mean of the micro-batches' aux losses, as in a plain
    transformers run over the same micro-batches."""
    return 0.0 if share is None else coef * share
