"""PackedVLM: a Qwen3.5 VLM that trains on packed (and sequence-parallel) micro-batches.

Data flow for one micro-batch, on every rank of an SP group of size P (all ranks get the same
PackedBatch):

    pad to a multiple of P, this rank's input embeddings   [S_local, hidden]  (model.merge)
        "split" (default): embed the shard's tokens, encode a cost-balanced share of the
            vision units (whole images, single video temporal groups: model.vision_routing),
            all-to-all feature rows to the ranks holding their placeholders
        "replicated": embeddings + vision tower on the whole pack [S, hidden], keep the shard
    decoder layers on the shard                           [1, S_local, hidden]
        full attention: Ulysses all-to-all, causal per sample   (model.attention)
        Gated DeltaNet: conv halo + state chain, or heads mode   (model.deltanet)
    final norm, lm_head + CE on this shard's targets             (model.loss)
        or, for any other objective or data with per-token temperatures or inference
        logprobs, per-token logprobs at each token's temperature     (model.token_logprobs)
        and the objectives on them                                   (model.loss_terms)
            whole-sample sums over the SP group, when one needs them (model.sample_sums)
            and the train-inference mismatch metrics                 (model.mismatch)
    with model.router_aux_loss: router statistics of the shard's real tokens, summed over the
        SP group, give this rank's share of the load-balancing loss   (model.router_loss)
    with routes in the pack (MoE): every MoE layer selects the routed experts of the shard's
        tokens, with the router's own gates                           (model.router_replay)
    MoE: the experts each layer selected, counted once per forward   (model.expert_load)

With P == 1 the same code is the exact packed single-rank path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.model.attention import ATTENTION_KEY, register_attention
from vlmcp.device import compute_device
from vlmcp.model.deltanet import install_deltanet_hooks
from vlmcp.config.schema import LossTerm
from vlmcp.model.deltanet_kernel import resolve_kernel
from vlmcp.model.loss import DEFAULT_LOSS_CHUNK_MB, shard_ce_and_entropy
from vlmcp.model.loss_terms import Loss
from vlmcp.model.merge import merge_embeddings, shard_first_embeddings
from vlmcp.model.recompute import install_recompute
from vlmcp.model.token_logprobs import TokenLogprobs, shard_token_logprobs
from vlmcp.model.router_loss import RouterAuxLoss
from vlmcp.model.router_replay import RouterReplay, moe_routers
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.parallel.modes import VISION_MODES
from vlmcp.parallel.shard import ShardPlan
from vlmcp.model.vision import replicated_copy

logger = logging.getLogger(__name__)

#: Per-token arrays that need the per-token logprob path even under plain CE: the temperature
#: enters the logprob itself, and the mismatch metrics compare logprobs token by token.
_PER_TOKEN_ARRAYS = ("temperatures", "inference_logprobs")


class PackedVLM(nn.Module):
    """Wraps a `Qwen3_5ForConditionalGeneration` (dense or MoE) for packed training.

    Registered submodules (what DeepSpeed sees): the text model and the lm_head, plus the vision
    tower when it is trainable. A frozen vision tower is held outside the module tree: it is
    replicated on every rank, never enters the optimizer and never gets ZeRO-3 partitioned (when
    it was loaded partitioned, it is gathered once, here).

    `objective` is the job's loss: one `LossTerm` or a `Loss` of several (default: plain
    token-mean CE); held as a `Loss`.

    `vision_mode` is `parallel.vision`: "split" (default) spreads the image and video encoding over
    the SP group and never builds the whole pack's embeddings; "replicated" runs embeddings and the
    vision tower on the whole pack on every rank (see model.merge). The vision tower is the module
    `self.vision`; under "split" each rank calls it at most once per micro-batch (module hooks on it
    time one rank's share).

    `tiled_mlp` (`train.tiled_mlp`): every decoder layer's MLP (a MoE layer's sparse block) runs
    through DeepSpeed's TiledMLP (model.tiled_mlp). `offload_activations`
    (`train.offload_activations`, with `gradient_checkpointing`): DeepSpeed's
    `CheckpointHiddenStatesOffload` moves the checkpointed decoder-layer inputs to pinned host
    memory on a side stream while `micro_batch(batch)` is entered (a no-op move on CPU;
    model.activation_offload).

    `deltanet_kernel` is `model.deltanet_kernel` ("auto", "fla", "torch"); an impossible choice
    raises KernelError here.

    Always, whichever kernel: the full-attention layers' `q_norm` and `k_norm` keep only a compact
    copy of their input for backward, the DeltaNet layers' gated norm + `out_proj` only the norm's
    two inputs, and the routed experts' gate only its input, recomputing the rest exactly
    (model.recompute).

    `router_aux_loss` (MoE only, `model.router_aux_loss`): `forward` also returns this rank's
    share of the micro-batch's router load-balancing loss (model.router_loss), and
    `router_aux_coef` is the checkpoint's `router_aux_loss_coef` (0.0 when off).

    A MoE model replays the routes a pack carries (`PackedBatch.routes`, model.router_replay:
    `router_replay`, None for a dense model, where routes are an error); a pack with routes
    trains inside `micro_batch(batch)`, and `replay_metrics` reports the replay.

    The wrapped model keeps working with plain transformers calls (`generate`, `save_pretrained`):
    the text attention key and the DeltaNet hooks fall back to the stock computation whenever no
    shard plan is passed.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        sp: SequenceParallel | None = None,
        deltanet_cp: str = "state",
        gradient_checkpointing: bool = False,
        vision_mode: str = "split",
        loss_chunk_mb: float = DEFAULT_LOSS_CHUNK_MB,
        objective: LossTerm | Loss | None = None,
        router_aux_loss: bool = False,
        deltanet_kernel: str = "auto",
        tiled_mlp: bool = False,
        offload_activations: bool = False,
    ) -> None:
        super().__init__()
        if offload_activations and not gradient_checkpointing:
            raise ValueError("train.offload_activations moves the checkpointed layer inputs: it needs "
                             "train.gradient_checkpointing")
        if vision_mode not in VISION_MODES:
            raise ValueError(f"parallel.vision must be one of {list(VISION_MODES)}, got {vision_mode!r}")
        self.vision_mode = vision_mode
        object.__setattr__(self, "hf_model", hf_model)
        self.sp = sp or SequenceParallel.single()
        self.loss_chunk_mb = loss_chunk_mb
        self.objective = Loss.of(objective)
        config = hf_model.config
        self.image_token_id = config.image_token_id
        self.video_token_id = config.video_token_id
        text_config = config.text_config
        self.conv_halo = text_config.linear_conv_kernel_dim - 1
        if getattr(text_config, "output_router_logits", False) and not router_aux_loss:
            logger.warning("output_router_logits is set, but vlmcp trains on token cross-entropy only "
                           "(no router aux loss); set model.router_aux_loss: true to add it")

        register_attention()
        vision_attention = config.vision_config._attn_implementation or "sdpa"
        hf_model.set_attn_implementation({"text_config": ATTENTION_KEY, "vision_config": vision_attention})
        self.language_model = hf_model.model.language_model
        self.lm_head = hf_model.lm_head
        vision = hf_model.model.visual
        self.vision_trainable = any(p.requires_grad for p in vision.parameters())
        if self.vision_trainable:
            self.visual = vision
        else:
            vision = replicated_copy(vision)
            hf_model.model.visual = vision
            object.__setattr__(self, "frozen_visual", vision)
        #: The kernel the DeltaNet layers run on this run's device ("fla" or "torch"; a model
        #: without DeltaNet layers runs none, so no fla version gate can refuse it).
        has_deltanet = "linear_attention" in (getattr(text_config, "layer_types", None) or ())
        self.deltanet_kernel = resolve_kernel(deltanet_kernel if has_deltanet else "torch",
                                              compute_device())
        self.deltanet_layers = install_deltanet_hooks(self.language_model, deltanet_cp, deltanet_kernel)
        self.recomputed = install_recompute(self.language_model)
        self.router_loss = RouterAuxLoss(self.language_model, text_config) if router_aux_loss else None
        self.router_aux_coef = self.router_loss.coef if self.router_loss is not None else 0.0
        self.router_replay = RouterReplay(self.language_model, text_config.num_hidden_layers) \
            if moe_routers(self.language_model) else None
        if gradient_checkpointing:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tiled_mlps = self.activation_offload = None
        if tiled_mlp:
            from vlmcp.model.tiled_mlp import TiledMLPs

            self.tiled_mlps = TiledMLPs(self.language_model, self.router_replay)
        if offload_activations:
            from deepspeed.runtime.activation_checkpointing.offload_activations import (
                CheckpointHiddenStatesOffload)

            from vlmcp.model.activation_offload import mark_layer_inputs

            self.activation_offload = CheckpointHiddenStatesOffload()
            mark_layer_inputs(list(self.language_model.layers), self.activation_offload)

    @contextlib.contextmanager
    def micro_batch(self, batch: PackedBatch | None = None, weight: float = 1.0) -> Iterator[None]:
        """The context to hold around one training micro-batch's forward *and* backward: DeepSpeed's
        activation offload with `offload_activations` (leaving it drops what it moved), and on a MoE
        model the replay of `batch`'s routes (its forward's replay counts join `replay_metrics`,
        times `weight`)."""
        with contextlib.ExitStack() as stack:
            if self.activation_offload is not None:
                stack.enter_context(self.activation_offload)
            if batch is not None and self.router_replay is not None:
                stack.enter_context(self.router_replay.micro_batch(batch, self.plan(batch), weight))
            yield

    def adopt_expert_parallel(self) -> None:
        """After `deepspeed.initialize` under expert parallelism (its AutoEP replaced every MoE
        block, router and experts included): hook the new routers for routing replay and the
        router loss, tile the new blocks under `tiled_mlp`, and let go of the replaced experts
        modules the recompute hooks held (each held every expert)."""
        live = {id(m) for m in self.language_model.modules()}
        self.recomputed = [m for m in self.recomputed if id(m) in live]
        if self.tiled_mlps is not None:
            self.tiled_mlps.rebind()
        if self.router_replay is not None:
            self.router_replay.rebind()
        if self.router_loss is not None:
            self.router_loss.rebind()

    def replay_metrics(self) -> dict[str, Any]:
        """The training row's routing-replay entries over the world since the last call (every
        rank calls it together; empty for a dense model): `router_replay_tokens`, the replayed
        (token, MoE layer) rows, and `router_replay_agreement`, the fraction of them whose native
        top-k set equals the replayed one (None when none was replayed)."""
        if self.router_replay is None:
            return {}
        replayed, agreed = self.router_replay.take_totals()
        return {"router_replay_tokens": int(replayed),
                "router_replay_agreement": agreed / replayed if replayed else None}

    def expert_load_metrics(self) -> dict[str, Any]:
        """The training row's expert-load entries over the world since the last call (every rank
        calls it together; empty for a dense model): the worst MoE layer's busiest-expert tokens
        over its mean tokens per expert, its index, max and mean (model.expert_load)."""
        return {} if self.router_replay is None else self.router_replay.take_load()

    @property
    def vision(self) -> nn.Module:
        """The vision tower; a frozen one follows the text model to its device on first use."""
        if self.vision_trainable:
            return self.visual
        device = self.language_model.embed_tokens.weight.device
        if next(self.frozen_visual.parameters()).device != device:
            self.frozen_visual.to(device)
        return self.frozen_visual

    def plan(self, batch: PackedBatch) -> ShardPlan:
        """This rank's shard of `batch` (built once per micro-batch, handed to every layer): over
        the SP group, or, for a pack of `sp_degree` 1, the whole pack on this rank, a plan
        without peers."""
        min_local_len = max(self.conv_halo, 1)
        if batch.sp_degree is None or batch.sp_degree == self.sp.size:
            return ShardPlan.build(batch.seq_lens, self.sp.size, self.sp.rank, self.sp.group,
                                   min_local_len=min_local_len)
        if batch.sp_degree != 1:
            raise ValueError(f"a pack of SP degree {batch.sp_degree}: the SP group has "
                             f"{self.sp.size} ranks (degrees 1 and {self.sp.size} run)")
        return ShardPlan.build(batch.seq_lens, min_local_len=min_local_len)

    def forward(self, batch: PackedBatch, stats: bool = False,
                objective: LossTerm | Loss | None = None, scores: bool = False,
                denominators: Sequence[float] | None = None, routes: bool = False
                ) -> tuple[Any, ...]:
        """Loss sum over this rank's shard of the pack, its number of target tokens, and this
        rank's share of the router aux loss; with `stats` also the shard's metric sums.

        Returns (0-dim fp32 tensor, int, 0-dim fp32 tensor or None without `router_aux_loss`),
        plus with `stats` the metric sums ([len(Loss.stat_specs())] float64). The loss is that
        of `objective` (else the module's; model.loss_terms): with `denominators` (the step's
        global N_k of each term) this shard's share of the step's loss; without, its sum
        sum_t c_t l_t of one term, to divide by N_0 (model.loss). The router shares of an SP
        group sum to the micro-batch's aux loss (model.router_loss).

        With `scores`, no loss: `token_scores(batch, routes)` (called through the engine so that
        ZeRO-3 gathers as in training).
        """
        if scores:
            return self.token_scores(batch, routes)
        objective = self.objective if objective is None else Loss.of(objective)
        plan = self.plan(batch)
        hidden, router_share = self.shard_hidden(batch, plan)
        targets = plan.shard(batch.targets.to(hidden.device), dim=0, pad_value=IGNORE_INDEX)
        if objective.plain_ce and not any(name in batch.token_arrays
                                          for name in _PER_TOKEN_ARRAYS):
            loss, count, entropy = shard_ce_and_entropy(hidden, targets, self.lm_head,
                                                        self.loss_chunk_mb)
            sums = torch.zeros(len(objective.stat_specs()), dtype=torch.float64)
            sums[0] = float(entropy)
        else:
            objective.check_batch(batch)
            scored = self._scored(batch, plan, hidden, targets)
            loss, sums = objective.shard_loss(scored.logprobs, scored.entropy, scored.keep,
                                              batch, plan, denominators)
            loss, count = loss + scored.anchor, int(scored.keep.sum())
        return (loss, count, router_share, sums) if stats else (loss, count, router_share)

    def shard_hidden(self, batch: PackedBatch, plan: ShardPlan
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final-norm hidden states of this rank's shard ([S_local, hidden]) and, with
        `router_aux_loss`, this rank's share of the router aux loss (else None); the pack's routes
        replayed (model.router_replay)."""
        with contextlib.ExitStack() as stack:
            if self.router_replay is not None:
                stack.enter_context(self.router_replay.for_forward(batch, plan))
                stack.enter_context(self.router_replay.counting(plan.local_len))
            elif batch.routes is not None:
                raise ValueError(f"{batch.sample_ids[0] if batch.sample_ids else 'the pack'}: "
                                 "routes on a dense model (it has no MoE router to replay them)")
            return self._shard_hidden(batch, plan)

    def _shard_hidden(self, batch: PackedBatch, plan: ShardPlan
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.shard_embeddings(batch, plan).unsqueeze(0)
        device = hidden.device
        positions = plan.shard(batch.position_ids.to(device), dim=1).unsqueeze(1)
        if self.router_loss is None:
            return self.decode(hidden, positions, plan)[0], None
        real = plan.shard(torch.ones(len(batch.input_ids), device=device), dim=0, pad_value=0.0)
        with self.router_loss.capture(real) as router_stats:
            hidden = self.decode(hidden, positions, plan)
        return hidden[0], router_stats.share(plan.group)

    def _scored(self, batch: PackedBatch, plan: ShardPlan, hidden: torch.Tensor,
                targets: torch.Tensor) -> TokenLogprobs:
        """Per-token logprobs of the shard's targets ([S_local] hidden and targets), at the data's
        per-token temperatures when the pack carries them."""
        temperatures = batch.token_arrays.get("temperatures")
        if temperatures is not None:
            temperatures = plan.shard(temperatures.to(hidden.device), dim=0, pad_value=1.0)
        return shard_token_logprobs(hidden, targets, self.lm_head, self.loss_chunk_mb,
                                    temperatures)

    @torch.no_grad()
    def token_scores(self, batch: PackedBatch, routes: bool = False) -> tuple[torch.Tensor, ...]:
        """Per-position logprob of the target and policy entropy on this rank's shard, no
        backward: ([S_local] fp32, [S_local] fp32), NaN where the target is IGNORE_INDEX or
        padding. Position t holds log pi(targets[t]), i.e. of the sample's label t+1, at its
        sampling temperature when the pack carries `temperatures`. The pack's routes are replayed.
        With `routes` (MoE only) also the experts each of the shard's tokens went to in each MoE
        layer, replayed or native: [S_local, L_moe, K] long."""
        plan = self.plan(batch)
        if routes and self.router_replay is None:
            raise ValueError("routes of a dense model: it has no MoE router")
        with self.router_replay.recording(plan.local_len) if routes else \
                contextlib.nullcontext() as recorded:
            hidden, _ = self.shard_hidden(batch, plan)
        targets = plan.shard(batch.targets.to(hidden.device), dim=0, pad_value=IGNORE_INDEX)
        scored = self._scored(batch, plan, hidden, targets)
        logprobs = torch.full(targets.shape, float("nan"), device=targets.device)
        entropy = logprobs.clone()
        logprobs[scored.keep] = scored.logprobs
        entropy[scored.keep] = scored.entropy
        return (logprobs, entropy, recorded) if routes else (logprobs, entropy)

    def shard_embeddings(self, batch: PackedBatch, plan: ShardPlan) -> torch.Tensor:
        """This rank's input embeddings, image and video features merged: [S_local, hidden]."""
        embed_tokens = self.language_model.embed_tokens
        if self.vision_mode == "split":
            return shard_first_embeddings(embed_tokens, self.vision, batch, plan, self.image_token_id,
                                          self.video_token_id, self.vision_trainable)
        embeds = merge_embeddings(embed_tokens, self.vision, batch, self.image_token_id,
                                  self.video_token_id, self.vision_trainable)
        return plan.shard(embeds, dim=0)

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
        """Decoder stack on one shard: [1, S_local, hidden] -> final-norm [1, S_local, hidden].

        positions: [3, 1, S_local] MRoPE (t, h, w) positions of the shard's tokens.
        """
        lm = self.language_model
        if self.tiled_mlps is not None and torch.is_grad_enabled():
            self.tiled_mlps.plan(plan.local_len)
        position_embeddings = lm.rotary_emb(hidden, positions)
        for layer in lm.layers[: lm.config.num_hidden_layers]:
            hidden = layer(
                hidden,
                position_embeddings=position_embeddings,
                attention_mask=None,
                position_ids=None,
                shard_plan=plan,
            )
        return lm.norm(hidden)
