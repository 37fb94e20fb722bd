"""Expert parallelism (`parallel.ep_size`, DeepSpeed's AutoEP) equals its definition: with the real
DeepSpeed engine over gloo, one SGD step's loss and every gradient (the routers', the shared
experts' and each rank's routed experts', mapped back to transformers' fused layout) equal plain
transformers' `Qwen3_5MoeForConditionalGeneration` forwarding each sample alone (its routers forced
to the sample's routes where it has some: tests/helpers/replay_reference.py), fp32 held to float64
with fp32's own error (`assert_within_fp32_error`).

Layouts (SP, EP) over world W: (1, 2) the EP group within DP, with another pack on each DP rank;
(2, 2) the EP group on the SP group, also at DP 2 (each expert's expert-data-parallel group of two
ranks); (2, 4) with DP 2, the EP group spanning both SP groups; (4, 2) two EP groups inside one SP
group. ZeRO 2 and ZeRO 3 at every layout, ZeRO 0 and 1 at (2, 2) (ZeRO 0: the engine's own
reduction and clipping, checked by the clipped gradients the optimizer steps with and the reported
norm) (under SP, ZeRO 3 runs
through training/ds/initialize.py, which lifts DeepSpeed's refusal of AutoEP there); native routing and
replayed routes, `ppo_clip`, routes that send every token to one EP rank's experts (the other
receives none), a pack whose shard on one rank has no route at all, and DeltaNet's heads mode
with gradient checkpointing (AutoEP's all-to-all runs again in the recompute) and DeepSpeed's
activation offload; the router load-balancing loss beside the CE (its reference: the samples of
each micro-batch batched, right-padded, transformers' own `aux_loss`). Each world size runs its cases in one set of processes.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.helpers.distributed import run_ranks
from tests.helpers.objective_reference import reference_step, target_logprobs
from tests.helpers.parity import (assert_within_fp32_error, build_model, float64_reference,
                                  make_sample, pack, reference_loss_and_grads, seed_adapter_weights)
from tests.helpers.replay_reference import force_routes, random_routes
from tests.helpers.router_reference import add_grads, reference_router_aux_and_grads
from tests.helpers.sp_cases import engine_step
from vlmcp.config import LossTerm
from vlmcp.data.pack import shifted_array
from vlmcp.data.routes import RouteSpec, pack_routes, parse_routes
from vlmcp.model.loss import DEFAULT_LOSS_CHUNK_MB
from vlmcp.training.ds.expert_parallel import expert_weight, hf_expert_tensors, hf_name

pytestmark = pytest.mark.e2e

TOL = 1e-5
SPEC = RouteSpec(layers=4, top_k=2, num_experts=4)
LORA_R, LORA_ALPHA = 4, 8.0
#: The routed experts' fused weights (lora.target_parameters).
ROUTED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PPO = LossTerm("ppo_clip", clip_low=0.2, clip_high=0.25)

# A sample is (length, image grids, routes): "none" (native routing), "nested" (a route for every
# token), "holes" (nested, with -1 rows on one layer of every third token), "ep_rank0" (every
# token of every layer to experts 0 and 1: EP rank 0's at EP 2). `packs` lists one pack per DP rank.
CASES = {
    # the EP group is the DP group: each rank's pack differs, tokens cross to the other rank
    "sp1_ep2_zero2_native_routing_other_pack_per_rank": dict(
        world=2, sp=1, ep=2, stage=2, model={"moe_intermediate_size": 48},
        packs=[[(20, [], "none"), (15, [(1, 4, 4)], "none")], [(26, [], "none"), (9, [], "none")]]),
    # every token goes to EP rank 0's experts: rank 1 receives no token, its experts no gradient
    "sp1_ep2_zero3_every_token_to_one_ranks_experts": dict(
        world=2, sp=1, ep=2, stage=3, model={},
        packs=[[(17, [], "ep_rank0"), (12, [], "ep_rank0")], [(21, [(1, 4, 4)], "ep_rank0")]]),
    # the EP group is the SP group; routes replayed across the shard edge, ppo_clip; ZeRO-3
    # (DeepSpeed refuses AutoEP with ZeRO-3 under SP: vlmcp lifts that, training/ds/initialize.py)
    "sp2_ep2_zero3_replayed_routes_ppo_clip": dict(
        world=2, sp=2, ep=2, stage=3, model={}, objective=PPO,
        packs=[[(19, [], "nested"), (28, [(1, 4, 4)], "holes"), (9, [], "none")]]),
    # [24] rank 0's shard replays routes, rank 1's holds none (native routing there)
    "sp2_ep2_zero2_one_shard_without_routes": dict(
        world=2, sp=2, ep=2, stage=2, model={},
        packs=[[(24, [], "nested"), (24, [], "none")]]),
    # DeltaNet in heads mode, gradient checkpointing (AutoEP's all-to-all runs again in the
    # recompute) and DeepSpeed's activation offload, routes replayed
    "sp2_ep2_zero2_heads_mode_checkpointing_activation_offload": dict(
        world=2, sp=2, ep=2, stage=2, model={}, mode="heads", checkpointing=True, offload=True,
        packs=[[(21, [(1, 4, 4)], "holes"), (16, [], "nested")]]),
    # DeepSpeed's TiledMLP over AutoEP's blocks (hidden 16: at least two tiles a shard, each tile
    # and its recompute running the all-to-all), routes replayed through the tiles, ZeRO-3
    "sp2_ep2_zero3_tiled_mlp_replayed_routes": dict(
        world=2, sp=2, ep=2, stage=3, model={"hidden_size": 16}, tiled_mlp=True,
        packs=[[(30, [], "nested"), (27, [(1, 4, 4)], "holes"), (11, [], "none")]]),
    # the router load-balancing loss (its coefficient raised so that it matters) beside the CE:
    # AutoEP's router captured, its logits from its gate (native routing: the batched reference
    # of the aux loss forwards the pack's samples together)
    "sp2_ep2_zero2_router_aux_loss": dict(
        world=2, sp=2, ep=2, stage=2, model={"router_aux_loss_coef": 0.5}, router_aux=True,
        packs=[[(23, [(1, 4, 4)], "none"), (14, [], "none")]]),
    # ZeRO 0: the engine reduces the expert gradients (DeepSpeed divides them by the world, not
    # DP, under SP: training/ds/expert_grads.py) and clips; a clip far below the norm: the
    # optimizer steps with the gradient times clip / (the whole model's norm), on every rank
    "sp2_ep2_zero0_replayed_routes_clipped_update": dict(
        world=2, sp=2, ep=2, stage=0, model={}, clip=1e-3,
        packs=[[(19, [], "nested"), (22, [(1, 4, 4)], "none")]]),
    "sp2_ep2_zero1_native_routing": dict(
        world=2, sp=2, ep=2, stage=1, model={},
        packs=[[(23, [(1, 4, 4)], "none"), (14, [], "none")]]),
    # the EP group on the SP group at DP 2: each expert's expert-data-parallel group has two
    # ranks (E = P with EDP > 1), ZeRO 0 clipped and ZeRO 1
    "sp2_ep2_dp2_zero0_clipped_update": dict(
        world=4, sp=2, ep=2, stage=0, model={"num_key_value_heads": 2}, clip=1e-3,
        packs=[[(16, [(1, 4, 4)], "holes"), (11, [], "none")], [(20, [], "nested")]]),
    "sp2_ep2_dp2_zero1_replayed_routes": dict(
        world=4, sp=2, ep=2, stage=1, model={"num_key_value_heads": 2},
        packs=[[(13, [], "none"), (18, [], "nested")], [(24, [(1, 4, 4)], "holes")]]),
    # EP 4 spans both SP groups of DP 2 (another pack on each), routes replayed
    "sp2_ep4_dp2_zero2_replayed_routes": dict(
        world=4, sp=2, ep=4, stage=2, model={"num_key_value_heads": 2},
        packs=[[(22, [(1, 4, 4)], "holes"), (13, [], "none")], [(18, [], "nested"), (15, [], "none")]]),
    # the same layout at ZeRO-3, native routing
    "sp2_ep4_dp2_zero3_native_routing": dict(
        world=4, sp=2, ep=4, stage=3, model={"num_key_value_heads": 2},
        packs=[[(14, [], "none"), (21, [(1, 4, 4)], "none")], [(26, [], "none"), (11, [], "none")]]),
    # LoRA (PEFT's, on plain transformers, is the reference): the routed experts' fused weights
    # (lora.target_parameters: each rank trains its experts' adapter pairs) and the shared
    # expert's and attention's Linear layers; the experts' base weights frozen; routes replayed
    "sp2_ep2_zero2_lora_on_routed_experts_replayed_routes": dict(
        world=2, sp=2, ep=2, stage=2, model={},
        lora=dict(target_modules=["q_proj", "down_proj"], target_parameters=ROUTED_EXPERTS),
        packs=[[(21, [(1, 4, 4)], "holes"), (16, [], "nested")]]),
    # the same under ZeRO-3 (the adapters partitioned over their expert-data-parallel group),
    # every expert's adapters trained, native routing, DP 2: the EP group spans the DP ranks
    "sp1_ep2_zero3_lora_on_routed_experts_other_pack_per_rank": dict(
        world=2, sp=1, ep=2, stage=3, model={},
        lora=dict(target_modules=[], target_parameters=ROUTED_EXPERTS),
        packs=[[(18, [], "none"), (13, [(1, 4, 4)], "none")], [(25, [], "none")]]),
    # two EP groups inside one SP group of 4
    "sp4_ep2_zero2_native_routing": dict(
        world=4, sp=4, ep=2, stage=2, model={"num_key_value_heads": 2},
        packs=[[(9, [], "none"), (44, [(1, 8, 8)], "none"), (13, [], "none")]]),
    # the same at ZeRO-3 (each expert partitioned over its 2-rank expert-data-parallel group),
    # routes replayed
    "sp4_ep2_zero3_replayed_routes": dict(
        world=4, sp=4, ep=2, stage=3, model={"num_key_value_heads": 2},
        packs=[[(30, [(1, 4, 4)], "nested"), (17, [], "holes")]]),
}


def _routes(gen: torch.Generator, length: int, kind: str) -> torch.Tensor | None:
    """A sample's routes [T, L, K] long (-1 rows where none) of `kind`, None for "none"."""
    if kind == "none":
        return None
    if kind == "ep_rank0":
        order = torch.rand(length, SPEC.layers, generator=gen) < 0.5
        first = order.long()
        return torch.stack([first, 1 - first], dim=-1)
    routes = random_routes(gen, length, SPEC)
    if kind == "holes":
        routes[::3, 1] = -1
    return routes


def _arrays(model, sample, gen) -> dict[str, torch.Tensor]:
    """ppo_clip's advantages and old logprobs (the model's own, moved so some ratios clip)."""
    logp, _, positions = target_logprobs(model, sample)
    old = torch.zeros(len(sample.labels))
    old[positions] = logp.detach() - (torch.rand(len(positions), generator=gen) - 0.5) * 0.8
    return {"advantages": torch.randn(len(sample.labels), generator=gen), "old_logprobs": old}


def _materialise(name: str, tmp_root):
    """(the engine case, the fp32 reference (loss, grads), its float64 twin)."""
    spec = CASES[name]
    model = build_model(moe=True, **spec["model"])
    checkpoint = tmp_root / name
    model.save_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(len(name))
    per_rank = [[make_sample(gen, model.config, n, grids) for n, grids, _ in layout]
                for layout in spec["packs"]]
    routes = [[_routes(gen, len(s.input_ids), kind) for s, (_, _, kind) in zip(samples, layout)]
              for samples, layout in zip(per_rank, spec["packs"])]
    samples = [s for rank in per_rank for s in rank]
    reference_model = copy.deepcopy(model)
    force_routes(reference_model, {tuple(s.input_ids.tolist()): r for s, r in
                                   zip(samples, (r for rank in routes for r in rank)) if r is not None})
    lora = spec.get("lora") and dict(r=LORA_R, alpha=LORA_ALPHA, **spec["lora"])
    if lora:
        reference_model = get_peft_model(reference_model, LoraConfig(
            r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=lora["target_modules"] or None,
            target_parameters=lora["target_parameters"]))
        seed_adapter_weights(reference_model)
    objective = spec.get("objective")
    arrays = None
    if objective is not None:
        with torch.no_grad():
            arrays = [_arrays(reference_model, s, gen) for s in samples]

    def batch_of(rank: int):
        batch = pack(per_rank[rank], model)
        batch.routes = pack_routes([None if r is None else
                                    parse_routes(r.tolist(), len(s.input_ids), SPEC, f"{name}.jsonl:{i}")
                                    for i, (s, r) in enumerate(zip(per_rank[rank], routes[rank]))],
                                   batch.seq_lens)
        if arrays is not None:
            first = sum(len(p) for p in per_rank[:rank])
            batch.token_arrays = {key: torch.cat([shifted_array(arrays[first + i][key])
                                                  for i in range(len(per_rank[rank]))])
                                  for key in arrays[0]}
        return batch

    def reference(exact: bool):
        run = (lambda f, *args: float64_reference(f, reference_model, *args)) if exact else \
            (lambda f, *args: f(reference_model, *args))
        if objective is not None:
            result = run(reference_step, samples, arrays, [objective])
            return result.loss, result.grads, None
        loss, grads = run(reference_loss_and_grads, samples)
        if lora:
            grads = per_expert_adapter_grads(reference_model, grads)
        if not spec.get("router_aux"):
            return loss, grads, None
        aux, aux_grads = run(reference_router_aux_and_grads, per_rank)
        return loss, add_grads(grads, aux_grads), aux

    case = dict(checkpoint=str(checkpoint), stage=spec["stage"], mode=spec.get("mode", "state"),
                checkpointing=spec.get("checkpointing", False),
                offload_activations=spec.get("offload", False), grad_accum=1,
                loss_chunk_mb=DEFAULT_LOSS_CHUNK_MB, objective=objective, ep=spec["ep"],
                router_aux=spec.get("router_aux", False), tiled_mlp=spec.get("tiled_mlp", False),
                lora=lora, clip=spec.get("clip"),
                packs=[[batch_of(rank)] for rank in range(len(per_rank))])
    return case, reference(exact=False), reference(exact=True)


def per_expert_adapter_grads(peft_model, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's gradients under the plain model's names, its routed-expert adapters' in the per-expert
    form an EP rank holds: `<experts>.lora_A_<weight>` [E, r, in] from `lora_A.default.weight`
    [r*E, in] (expert e's rows e*r..), `<experts>.lora_B_<weight>` [E, out, r] from
    `lora_B.default.weight` [out, r*E] (expert e's columns e, E+e, ...)."""
    grads = {name.removeprefix("base_model.model."): grad for name, grad in grads.items()}
    for name, module in peft_model.base_model.model.named_modules():
        if not hasattr(module, "parameter_name"):
            continue
        experts, weight = name.split(".base_layer")[0], module.parameter_name
        count = SPEC.num_experts
        grad_a = grads.pop(f"{name}.lora_A.default.weight")
        grad_b = grads.pop(f"{name}.lora_B.default.weight")
        grads[f"{experts}.lora_A_{weight}"] = grad_a.reshape(count, LORA_R, -1)
        grads[f"{experts}.lora_B_{weight}"] = grad_b.reshape(-1, LORA_R, count).permute(2, 0, 1)
    return grads


@functools.cache
def _results(world: int, tmp_root) -> dict:
    cases, expected = {}, {}
    for name, spec in CASES.items():
        if spec["world"] == world:
            cases[name], *expected[name] = _materialise(name, tmp_root)
    by_sp = {}
    for name in cases:
        by_sp.setdefault(CASES[name]["sp"], {})[name] = cases[name]
    results = {}
    for sp, sp_cases in by_sp.items():
        per_rank = run_ranks(engine_step, world, sp, sp_cases)
        results.update({name: (*expected[name], [r[name] for r in per_rank]) for name in sp_cases})
    return results


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("expert_parallel")


def hf_named_grads(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's gradients under AutoEP's names as transformers names them: the routed experts'
    fused `gate_up_proj` and `down_proj` of this rank's experts only."""
    named, experts = {}, {}
    for name, grad in grads.items():
        found = expert_weight(name)
        if found is None:
            named[hf_name(name)] = grad
        else:
            experts.setdefault(found[0], {})[found[1]] = grad
    for module, weights in experts.items():
        named.update(hf_expert_tensors(module, weights["w1"], weights["w2"], weights["w3"]))
    return named


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_step_equals_transformers_per_sample_with_every_expert_on_its_rank(name, tmp_root):
    """Every rank's loss, and every gradient it holds (dense ones whole, its EP rank's slice of
    each routed-experts tensor), within fp32's error of the float64 reference (at least 1e-5); the
    world's ranks hold every expert of every layer, each once per EP group."""
    spec = CASES[name]
    (ref_loss, ref_grads, ref_aux), (truth_loss, truth_grads, truth_aux), per_rank = \
        _results(spec["world"], tmp_root)[name]
    local = SPEC.num_experts // spec["ep"]
    for rank, result in enumerate(per_rank):
        assert_within_fp32_error(result["loss"], ref_loss, truth_loss, at_least=TOL, name="loss")
        if ref_aux is not None:
            assert_within_fp32_error(result["router_aux"], ref_aux, truth_aux, at_least=TOL,
                                     name="router aux loss")
        grads = hf_named_grads(result["grads"])
        assert grads.keys() == {n for n in ref_grads if not n.startswith("model.visual")}
        if spec.get("tiled_mlp"):  # every layer's live (AutoEP) block tiled, in two tiles or more
            assert result["tiled_shards"] >= 2 and result["tiled_layers"] == SPEC.layers
        held = slice((rank % spec["ep"]) * local, (rank % spec["ep"] + 1) * local)
        for pname, grad in grads.items():
            ref, truth = ref_grads[pname], truth_grads[pname]
            if ".mlp.experts." in pname:
                assert grad.shape[0] == local, pname
                ref, truth = ref[held], truth[held]
            assert_within_fp32_error(grad, ref, truth, at_least=TOL, name=f"rank {rank} {pname}")


def _norm(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of a reference's whole trained gradient (the frozen vision tower left out)."""
    return torch.stack([g.double().pow(2).sum() for n, g in grads.items()
                        if not n.startswith("model.visual")]).sum().sqrt()


@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if spec.get("clip")])
def test_at_zero0_each_rank_reports_and_clips_by_the_whole_models_norm_as_transformers_would(
        name, tmp_root):
    """ZeRO 0 under EP: the norm `vlmcp train` reports and clips by is the whole model's
    gradient norm of the reference (every expert once), on every rank, and the optimizer of each
    rank steps with the reference gradient times clip / (norm + 1e-6): the same factor on every
    rank, for the dense weights and each rank's experts alike."""
    spec = CASES[name]
    (_, ref_grads, _), (_, truth_grads, _), per_rank = _results(spec["world"], tmp_root)[name]
    ref_norm, truth_norm = _norm(ref_grads), _norm(truth_grads)
    assert truth_norm > 10 * spec["clip"]  # the clip applies
    local = SPEC.num_experts // spec["ep"]
    for rank, result in enumerate(per_rank):
        assert_within_fp32_error(result["grad_norm"], ref_norm, truth_norm, at_least=TOL,
                                 name=f"rank {rank} grad norm")
        held = slice((rank % spec["ep"]) * local, (rank % spec["ep"] + 1) * local)
        scale32, scale64 = (spec["clip"] / (norm + 1e-6) for norm in (ref_norm, truth_norm))
        stepped = hf_named_grads(result["stepped_grads"])
        assert stepped.keys() == {n for n in ref_grads if not n.startswith("model.visual")}
        for pname, grad in stepped.items():
            ref, truth = ref_grads[pname], truth_grads[pname]
            if ".mlp.experts." in pname:
                ref, truth = ref[held], truth[held]
            assert_within_fp32_error(grad, ref * scale32, truth * scale64, at_least=TOL,
                                     name=f"rank {rank} {pname} clipped")
