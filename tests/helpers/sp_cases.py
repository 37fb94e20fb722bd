"""Rank-side code of the end-to-end SP parity tests: the real DeepSpeed engine, one step."""

from __future__ import annotations

import gc

import torch
from deepspeed.utils import safe_get_full_grad
from transformers import AutoConfig, Qwen3_5ForConditionalGeneration
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from vlmcp.config import LoraSection
from vlmcp.model.lora import apply_lora
from vlmcp.model.loss import scale_for_deepspeed
from vlmcp.model.loss_terms import Loss
from vlmcp.model.packed import PackedVLM
from vlmcp.model.router_loss import router_objective
from vlmcp.parallel import comm
from vlmcp.training.ds.edits import DeepSpeedEdits
from vlmcp.training.ds.expert_comms import expert_a2a_row, fill_comms_logger
from vlmcp.training.ds.expert_grads import global_grad_norm
from vlmcp.training.ds.initialize import initialize_engine
from vlmcp.training.ds.expert_parallel import fill_expert_parallel, moe_optimizer_factory
from vlmcp.training.ds.zero3_sp import largest_tensor_numel, sp_exact_zero_settings
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.objective_step import objective_metrics, pack_counts, step_counts
from vlmcp.data.pack import build_batch
from vlmcp.training.score import score_samples
from tests.helpers.parity import seed_adapter_weights


#: The run name of a per-rank case's step with every micro-batch spread over the SP group (the
#: feature off), run beside the step as its layout gives it (`parallel.sp_dynamic`).
FEATURE_OFF = "feature_off"


def layout_degree(spec: dict, micro: int) -> int | None:
    """The SP degree of a test case's micro-batch `micro`: None (spread over the SP group), or in
    a `per_rank` case its `degrees` entry (1: a whole pack on each rank)."""
    return spec["degrees"][micro] if spec.get("per_rank") else None


def ds_config(stage: int, grad_accum: int, dp_size: int, bf16: bool = False) -> dict:
    return {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }


def _counted(forward, calls: list):
    """`forward`, appending to `calls` on every run (module hooks do not fire in a recompute)."""

    def run(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return run


def _record_tower_calls(vision: torch.nn.Module, calls: list):
    """Append (image grids, blank) to `calls` on every vision tower call (blank marks the all-zero
    dummy image); returns the hook's handle."""

    def record(module, args, kwargs):
        calls.append(([tuple(g) for g in kwargs["grid_thw"].tolist()], not bool(args[0].any())))

    return vision.register_forward_pre_hook(record, with_kwargs=True)


def engine_step(sp_size: int, cases: dict[str, dict]) -> dict[str, dict]:
    """For each case {checkpoint, stage, mode, grad_accum, vision, packs: list per DP rank of lists
    of PackedBatch, optionally lora: LoraSection keys, objective (a LossTerm or model.loss_terms.Loss) and
    score (rows of Samples, one or a pair's two, to run `score_samples` on after the step, with
    score_max_len; with score_dynamic, on training's degree plan), ep (parallel.ep_size: DeepSpeed's
    AutoEP splits the routed experts; the gradients then come under AutoEP's names, each rank's
    experts only), partition_all (ZeRO-3 partitions every parameter, however small), tiled_mlp
    and offload_activations (train.* switches) and clip (DeepSpeed's gradient_clipping: the
    gradients the optimizer steps with, clipped, come back as "stepped_grads"; under ZeRO 0, where
    the optimizer is torch's own); at ZeRO 0 in fp32 the result also holds vlmcp's "grad_norm"
    (the norm `vlmcp train` reports and clips by there); each micro-batch runs inside
    `module.micro_batch(batch)` (its routes replayed on a MoE model)}: one DeepSpeed
    step; returns the step loss, the metrics (training/objective_step.objective_metrics), every trainable
    parameter's full gradient (HF names) as DeepSpeed holds them at the accumulation boundary,
    and the score records. A LoRA case injects vlmcp's adapters (then `seed_adapter_weights`)
    before the engine is built, as `vlmcp train` does. With `router_aux`, the step also trains
    the router aux loss, whose mean over the step's micro-batches (DP x accumulation) comes back as
    "router_aux". A MoE case returns the step's "expert_load" row entries, an EP case also its
    "expert_a2a" ones (vlmcp's comms_logger section on, as `vlmcp train` fills it).

    A case with "runs" ({run name: (objective, packs)}) instead runs one step per run on the one
    engine it builds (SGD at lr 0 leaves the weights as they were) and returns a result per
    "case/run" name: many objectives for the price of one engine; "scores" ({run name: rows})
    scores after those runs. With "per_rank", packs are listed per global rank instead of per DP
    rank (packs of `sp_degree` 1 differ between the ranks of an SP group); each pack's counts
    come from the rank its plan calls rank 0. A pack listed as (batch, 0.0) is a repeat at weight
    0, as the training loop runs one (vlmcp.data.pack.Slot.pack_of: a rank past a degree-1
    slot's last pack): it keeps the rank's collectives in step and counts, adds and trains
    nothing."""
    sp = SequenceParallel.initialize(sp_size)
    results = {}
    for name, case in cases.items():
        hf_config = AutoConfig.from_pretrained(case["checkpoint"])
        config = sp_exact_zero_settings(
            ds_config(case["stage"], case["grad_accum"], sp.dp_size, case.get("bf16", False)), sp.size, largest_tensor_numel(case["checkpoint"])
        )
        ep_size = case.get("ep", 1)
        if ep_size > 1:
            edits = DeepSpeedEdits()
            fill_expert_parallel(config, ep_size, hf_config.text_config.num_experts_per_tok, edits)
            fill_comms_logger(config, ep_size, edits, on_cuda=False)
            assert not edits.problems, edits.problems
        if case.get("partition_all"):
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if case.get("clip"):
            config["gradient_clipping"] = case["clip"]
        keep_alive = HfDeepSpeedConfig(config) if case["stage"] == 3 else None
        cls = Qwen3_5MoeForConditionalGeneration if hf_config.model_type == "qwen3_5_moe" else Qwen3_5ForConditionalGeneration
        dtype = torch.bfloat16 if case.get("bf16") else torch.float32
        model = cls.from_pretrained(case["checkpoint"], dtype=dtype, attn_implementation="sdpa")
        model.model.visual.requires_grad_(case.get("train_vision", False))
        if case.get("lora"):
            apply_lora(model, LoraSection(**case["lora"]), case["checkpoint"])
            seed_adapter_weights(model)
        module = PackedVLM(model, sp=sp, deltanet_cp=case["mode"], gradient_checkpointing=case.get("checkpointing", False),
                           vision_mode=case.get("vision", "split"), loss_chunk_mb=case["loss_chunk_mb"],
                           router_aux_loss=case.get("router_aux", False), objective=case.get("objective"),
                           tiled_mlp=case.get("tiled_mlp", False),
                           offload_activations=case.get("offload_activations", False))
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = moe_optimizer_factory(lambda groups: torch.optim.SGD(groups, lr=0.0)) \
            if ep_size > 1 else torch.optim.SGD(params, lr=0.0)
        engine = initialize_engine(module, config, sp.mpu, optimizer=optimizer)
        if ep_size > 1:
            module.adopt_expert_parallel()
        engine.train()
        runs = case.get("runs") or {None: (module.objective, case["packs"])}
        for run, (objective, packs) in runs.items():
            rows = case.get("score") if run is None else case.get("scores", {}).get(run)
            mine = packs[comm.rank() if case.get("per_rank") else sp.dp_rank]
            result = _one_step(engine, module, Loss.of(objective), mine, case, rows,
                               sp)
            results[name if run is None else f"{name}/{run}"] = result
        del engine, module, model
        if keep_alive is not None:
            unset_hf_deepspeed_config()
            del keep_alive
        gc.collect()
    return results


def _one_step(engine, module: PackedVLM, objective: Loss, micro_batches: list, case: dict,
              rows: list | None, sp: SequenceParallel) -> dict:
    """One optimizer step of `engine` on this rank's `micro_batches` with `objective`, then
    `score_samples` on `rows` (rows of Samples) when given."""
    calls = []
    mlp = module.language_model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = _counted(forward, calls)
    tower_calls = []
    hook = _record_tower_calls(module.vision, tower_calls)
    weighted = [entry if isinstance(entry, tuple) else (entry, 1.0) for entry in micro_batches]
    owned = [batch for batch, weight in weighted if weight and module.plan(batch).rank == 0]
    counts = step_counts(pack_counts(objective, owned), objective)
    loss_total, router_total = torch.zeros(()), torch.zeros(())
    stat_total = torch.zeros(len(objective.stat_specs()), dtype=torch.float64)
    offloaded = {"passed_hooks": 0}
    for batch, weight in weighted:
        with module.micro_batch(batch, weight):
            loss_sum, _, router_share, stats = engine(batch, stats=True, objective=objective,
                                                      denominators=counts.shard_denominators)
            loss_total += loss_sum.detach() * weight
            stat_total += stats * weight
            if router_share is not None:
                router_total += router_share.detach() * weight
            engine.backward(scale_for_deepspeed(loss_sum * weight, counts.denominator, sp.dp_size, case["grad_accum"])
                            + router_objective(router_share, module.router_aux_coef) * weight)
        if module.activation_offload is not None:
            offload_stats = module.activation_offload.stats
            # a marked input reaches the offload engine only through the pack hook; on CPU the
            # engine keeps it in place (skipped) or, on a GPU, moves it (offloaded)
            offloaded["passed_hooks"] += offload_stats.skipped_marked_tensors + offload_stats.offloaded_tensors
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
    def hf(name: str) -> str:
        return "model." + name if name.startswith(("language_model.", "visual.")) else name

    trained = [(hf(n), p) for n, p in engine.module.named_parameters() if p.requires_grad]
    grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in trained}
    grad_norm = (global_grad_norm(engine.module)
                 if case["stage"] == 0 and not case.get("bf16") else None)
    stepped: dict[str, torch.Tensor] = {}
    if case.get("clip"):  # the gradients the optimizer steps with, after DeepSpeed's clipping
        names = {id(p): n for n, p in trained}

        def record(optimizer, *_):
            stepped.update({names[id(p)]: p.grad.detach().clone() for group in optimizer.param_groups
                            for p in group["params"] if p.grad is not None})

        hook = engine.optimizer.register_step_pre_hook(record)
    engine.step()
    if case.get("clip"):
        hook.remove()
    scores = None
    if rows:
        scores = score_samples(engine, [sum(len(s) for s in row) for row in rows],
                               lambda pack: build_batch([s for i in pack for s in rows[i]]),
                               case["score_max_len"], sp, entropy=True,
                               chosen_lengths=[len(row[0]) if len(row) == 2 else 0 for row in rows],
                               dynamic=case.get("score_dynamic", False))
    mlp.forward = forward
    hook.remove()
    return {
        "loss": float(comm.all_reduce_sum(loss_total)) / counts.denominator,
        "stats": objective_metrics(comm.all_reduce_sum(stat_total), counts, objective),
        "scores": scores,
        "router_aux": float(comm.all_reduce_sum(router_total)) / (sp.dp_size * case["grad_accum"]),
        "grads": grads,
        "grad_norm": grad_norm,
        "stepped_grads": stepped,
        "layer0_mlp_calls": len(calls),
        "tiled_shards": module.tiled_mlps.shards if module.tiled_mlps is not None else None,
        "tiled_layers": None if module.tiled_mlps is None else sum(
            any(layer.mlp is tiled for tiled in module.tiled_mlps.modules) and "forward" in vars(layer.mlp)
            for layer in module.language_model.layers),
        "offloaded": offloaded,
        "tower_calls": tower_calls,
        "replay": module.replay_metrics(),
        "expert_load": module.expert_load_metrics(),
        "expert_a2a": expert_a2a_row() if case.get("ep", 1) > 1 else None,
    }
