"""Routing replay under sequence parallelism equals its definition: for SP = 1, 2 and 4 with the
real DeepSpeed engine (ZeRO 2 and 3) over gloo, one SGD step's loss and every gradient (the routers'
included) equal plain transformers' `Qwen3_5MoeForConditionalGeneration` forwarding each sample
alone with its routers forced to the sample's routes (tests/helpers/replay_reference.py), fp32 held
to float64 with fp32's own error (`assert_within_fp32_error`).

The packs mix a sample without routes with samples whose routes come through the data's two forms:
the compact form with start > 0 and one row short (an engine's completion routes: its prompt
routes natively) and nested lists with single-layer -1 rows among routed layers; their routes span
the shard edges (at SP 4 one sample covers all four ranks). Further cases: LoRA on the routed
experts with train.tiled_mlp and gradient checkpointing (ZeRO-2), `ppo_clip` with old_logprobs in
DeltaNet heads mode (ZeRO-2), and the degree per micro-batch (parallel.sp_dynamic, SP 2, ZeRO-3):
routes replayed on a pack spread over both ranks and on whole packs, one per rank; the same
samples with every micro-batch spread (the feature off) equal the reference too and agree with
the first run to fp32 rounding. Every case's `router_replay_tokens` is the data's routed (token,
layer) count. Each world size runs its cases in one set of processes."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.helpers.distributed import run_ranks
from tests.helpers.objective_reference import reference_step, target_logprobs
from tests.helpers.parity import (assert_steps_agree_to_fp32_rounding, assert_within_fp32_error, build_model,
                                  float64_reference, make_sample, pack, reference_loss_and_grads,
                                  seed_adapter_weights)
from tests.helpers.replay_reference import compact_form, force_routes, random_routes
from tests.helpers.sp_cases import FEATURE_OFF, engine_step, layout_degree
from vlmcp.config import LossTerm
from vlmcp.data.pack import shifted_array
from vlmcp.data.routes import RouteSpec, pack_routes, parse_routes
from vlmcp.model.loss import DEFAULT_LOSS_CHUNK_MB

pytestmark = pytest.mark.e2e

TOL = 1e-5
SPEC = RouteSpec(layers=4, top_k=2, num_experts=4)
ROUTED_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PPO = LossTerm("ppo_clip", clip_low=0.2, clip_high=0.25)

# A sample is (length, image grids, routes): "none"; "compact" (the compact form from its first
# target on, one row short); "nested" (every token); "holes" (nested, with -1 rows on one layer
# of every third token). Shard lengths in brackets. A case's `samples` are one pack, the same on
# every DP rank; a case with `per_rank` instead lists `packs` per GLOBAL rank per micro-batch,
# with a `degrees` entry per micro-batch (`parallel.sp_dynamic`): None, one pack spread over the
# SP group (the same samples in every rank's list, made once), or 1, a whole pack on each rank
# (each rank's own samples, `batch.sp_degree = 1`). With `feature_off` the same engine also runs
# the step with every micro-batch spread (the degree-1 packs joined, in rank order, into one).
CASES = {
    "sp1_zero3_mixed_pack": dict(
        world=1, sp=1, model={}, stage=3, mode="state",
        samples=[(13, [], "compact"), (24, [(1, 4, 4)], "holes"), (8, [], "none")]),
    # [33] the image sample's routes (tokens 11..47) straddle the edge
    "p2_zero3_mixed_pack_routes_span_the_edge": dict(
        world=2, sp=2, model={}, stage=3, mode="state",
        samples=[(11, [], "none"), (37, [(1, 8, 8)], "compact"), (17, [], "holes")]),
    # [24] tiles of the shard carry their rows through TiledMLP (hidden 16: at least two tiles)
    "p2_zero2_lora_routed_experts_tiled_mlp_checkpointing": dict(
        world=2, sp=2, model={"hidden_size": 16}, stage=2, mode="state", tiled_mlp=True,
        checkpointing=True, lora=dict(r=4, alpha=8.0, target_modules=[],
                                      target_parameters=ROUTED_EXPERTS),
        samples=[(21, [(1, 4, 4)], "holes"), (26, [], "nested")]),
    "p2_zero2_ppo_clip_old_logprobs_heads_mode": dict(
        world=2, sp=2, model={}, stage=2, mode="heads", objective=PPO,
        samples=[(19, [], "compact"), (28, [(1, 4, 4)], "nested"), (9, [], "none")]),
    # parallel.sp_dynamic: a degree-2 micro-batch [20] (the image sample's compact routes, tokens
    # 9..27, straddle the edge), then a degree-1 one whose whole packs replay routes on one rank
    # each: rank 0 compact and unrouted samples, rank 1 an image sample with holes and a nested one
    "p2_zero3_sp_dynamic_routes_replayed_on_degree_one_packs": dict(
        world=2, sp=2, model={}, stage=3, mode="state", per_rank=True, degrees=[None, 1],
        feature_off=True,
        packs=[[[(29, [(1, 4, 4)], "compact"), (11, [], "nested")], whole] for whole in (
            [(15, [], "compact"), (10, [], "none")],
            [(19, [(1, 2, 2)], "holes"), (12, [], "nested")],
        )]),
    # [17] the image sample (tokens 9..52) covers all four ranks
    "p4_zero3_sample_over_four_ranks": dict(
        world=4, sp=4, model={"num_key_value_heads": 2}, stage=3, mode="state",
        samples=[(9, [], "holes"), (44, [(1, 8, 8)], "compact"), (13, [], "none")]),
}


def _routes(gen, sample, kind: str) -> tuple[torch.Tensor | None, object]:
    """(the sample's routes [T, L, K] long, -1 rows where none; its data form) of `kind`."""
    n = len(sample.input_ids)
    if kind == "none":
        return None, None
    routes = random_routes(gen, n, SPEC)
    if kind == "compact":
        start = int((sample.labels != -100).nonzero()[0])
        routes[:start] = -1
        routes[-1] = -1
        return routes, compact_form(routes[:-1], start, "uint8")
    if kind == "holes":
        routes[::3, 1] = -1
    return routes, routes.tolist()


def _arrays(model, sample, gen) -> dict[str, torch.Tensor]:
    """ppo_clip's advantages and old logprobs (the model's own, moved so some ratios clip)."""
    logp, _, positions = target_logprobs(model, sample)
    old = torch.zeros(len(sample.labels))
    old[positions] = logp.detach() - (torch.rand(len(positions), generator=gen) - 0.5) * 0.8
    return {"advantages": torch.randn(len(sample.labels), generator=gen), "old_logprobs": old}


def _peft(model, lora: dict):
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["target_modules"] or None,
        target_parameters=lora["target_parameters"]))
    seed_adapter_weights(peft_model)
    return peft_model


def _reference(model, spec, samples, arrays, exact: bool):
    """(loss, grads under the plain model's names) of the forced-route reference."""
    run = (lambda f, *args: float64_reference(f, model, *args)) if exact else \
        (lambda f, *args: f(model, *args))
    if spec.get("objective") is not None:
        result = run(reference_step, samples, arrays, [spec["objective"]])
        loss, grads = result.loss, result.grads
    else:
        loss, grads = run(reference_loss_and_grads, samples)
    return loss, {n.removeprefix("base_model.model."): g for n, g in grads.items()}



def _materialise(name: str, tmp_root):
    """(the engine case, the (fp32, float64) references, the routed (token, layer) rows of the
    step's data over the world)."""
    spec = CASES[name]
    model = build_model(moe=True, **spec["model"])
    checkpoint = tmp_root / name
    model.save_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(len(name))
    layouts = spec["packs"] if spec.get("per_rank") else [[spec["samples"]]]
    # the distinct micro-batches (a spread one by its index, a degree-1 one by (rank, index)):
    # their samples, routes and the routes' data forms
    made = {}
    for rank, rank_layout in enumerate(layouts):
        for i, layout in enumerate(rank_layout):
            key = i if layout_degree(spec, i) is None else (rank, i)
            if key not in made:
                samples = [make_sample(gen, model.config, n, grids) for n, grids, _ in layout]
                routes, forms = zip(*(_routes(gen, s, kind) for s, (_, _, kind) in zip(samples, layout)))
                made[key] = (samples, routes, forms)
    samples = [s for micro, _, _ in made.values() for s in micro]
    routes = [r for _, micro, _ in made.values() for r in micro]
    reference_model = _peft(model, spec["lora"]) if spec.get("lora") else copy.deepcopy(model)
    force_routes(reference_model, {tuple(s.input_ids.tolist()): r for s, r in zip(samples, routes)
                                   if r is not None})
    arrays = None
    if spec.get("objective") is not None:
        with torch.no_grad():
            arrays = [_arrays(reference_model, s, gen) for s in samples]
    by_sample = {id(s): i for i, s in enumerate(samples)}

    def batch_of(micro_samples, micro_forms, degree=None):
        batch = pack(micro_samples, model)
        batch.routes = pack_routes([None if form is None else
                                    parse_routes(form, len(s.input_ids), SPEC, f"{name}.jsonl:{by_sample[id(s)]}")
                                    for s, form in zip(micro_samples, micro_forms)], batch.seq_lens)
        if arrays is not None:
            batch.token_arrays = {key: torch.cat([shifted_array(arrays[by_sample[id(s)]][key])
                                                  for s in micro_samples]) for key in arrays[0]}
        batch.sp_degree = degree
        return batch

    routed = sum(int((r >= 0).all(-1).sum()) for r in routes if r is not None)
    references = (_reference(reference_model, spec, samples, arrays, exact=False),
                  _reference(reference_model, spec, samples, arrays, exact=True))
    case = dict(checkpoint=str(checkpoint), stage=spec["stage"], mode=spec["mode"], grad_accum=1,
                checkpointing=spec.get("checkpointing", False), loss_chunk_mb=DEFAULT_LOSS_CHUNK_MB,
                lora=spec.get("lora"), objective=spec.get("objective"),
                tiled_mlp=spec.get("tiled_mlp", False))
    if not spec.get("per_rank"):
        ((micro, _, forms),) = made.values()
        case["packs"] = [[batch_of(micro, forms)]] * (spec["world"] // spec["sp"])
        return case, references, routed * (spec["world"] // spec["sp"])
    batches = {key: batch_of(micro, forms, None if isinstance(key, int) else 1)
               for key, (micro, _, forms) in made.items()}
    case.update(grad_accum=len(spec["degrees"]), per_rank=True,
                packs=[[batches[i if layout_degree(spec, i) is None else (rank, i)] for i in range(len(rank_layout))]
                       for rank, rank_layout in enumerate(layouts)])
    if spec.get("feature_off"):
        joined = [[made[key] for key in made if (key if isinstance(key, int) else key[1]) == i]
                  for i in range(len(spec["degrees"]))]
        every_spread = [batch_of([s for micro, _, _ in parts for s in micro],
                                 [f for _, _, forms in parts for f in forms]) for parts in joined]
        # the step as given (the run None: results under the case's name), then with every
        # micro-batch spread (results under "name/FEATURE_OFF"), on the one engine (lr 0)
        case["runs"] = {None: (spec.get("objective"), case["packs"]),
                        FEATURE_OFF: (spec.get("objective"), [every_spread] * spec["world"])}
    return case, references, routed


@functools.cache
def _results(world: int, sp: int, tmp_root) -> dict:
    cases, expected = {}, {}
    for name, spec in CASES.items():
        if (spec["world"], spec["sp"]) == (world, sp):
            cases[name], *expected[name] = _materialise(name, tmp_root)
    per_rank = run_ranks(engine_step, world, sp, cases)
    results = {name: (*expected[name], [r[name] for r in per_rank]) for name in cases}
    results.update({f"{name}/{FEATURE_OFF}": (*expected[name], [r[f"{name}/{FEATURE_OFF}"] for r in per_rank])
                    for name in cases if CASES[name].get("feature_off")})
    return results


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("replay_sp")


DYNAMIC_CASES = [name for name, spec in CASES.items() if spec.get("per_rank")]


@pytest.mark.parametrize("name", [name for name in CASES if name not in DYNAMIC_CASES])
def test_sp_replay_step_equals_transformers_with_forced_routes_per_sample(name, tmp_root):
    _assert_replay_step_equals_forced_routes_per_sample(name, name, tmp_root)


@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_sp_dynamic_routes_replayed_on_degree_one_and_degree_two_packs_equal_transformers_with_forced_routes_per_sample(
        name, tmp_root):
    """parallel.sp_dynamic on the MoE model: routes replayed on a pack spread over the SP group
    and on whole packs, one per rank (compact, nested and holed routes), give the loss and every
    gradient (the routers' included) of transformers with each sample's routes forced, within
    fp32's error of float64; every routed row of the step is replayed once."""
    _assert_replay_step_equals_forced_routes_per_sample(name, name, tmp_root)


@pytest.mark.parametrize("name", [name for name in DYNAMIC_CASES if CASES[name].get("feature_off")])
def test_sp_dynamic_off_every_pack_spread_replays_the_same_step_to_fp32_rounding(name, tmp_root):
    """The same routed samples with the feature off (every micro-batch spread) equal the forced-route
    float64 truth as well, and the two runs' loss and gradients agree with each other to fp32
    rounding (`assert_agree_to_fp32_rounding`, without the 1e-5 floor)."""
    spec = CASES[name]
    off = f"{name}/{FEATURE_OFF}"
    _assert_replay_step_equals_forced_routes_per_sample(name, off, tmp_root)
    results = _results(spec["world"], spec["sp"], tmp_root)
    ((ref_loss, ref_grads), (truth_loss, truth_grads)), _, dynamic = results[name]
    *_, spread = results[off]
    assert_steps_agree_to_fp32_rounding(dynamic, spread, (ref_loss, ref_grads), (truth_loss, truth_grads))


def _assert_replay_step_equals_forced_routes_per_sample(name: str, key: str, tmp_root) -> None:
    """Case `name`'s run `key` (its name, or "name/FEATURE_OFF"): on every rank the loss and every
    gradient within fp32's error of the float64 forced-route reference (at least TOL), and the
    data's routed rows replayed, each once per DP rank that runs it."""
    spec = CASES[name]
    ((ref_loss, ref_grads), (truth_loss, truth_grads)), routed, per_rank = \
        _results(spec["world"], spec["sp"], tmp_root)[key]
    for result in per_rank:
        assert_within_fp32_error(result["loss"], ref_loss, truth_loss, at_least=TOL, name="loss")
        assert result["replay"]["router_replay_tokens"] == routed
        expected = {n for n in ref_grads if not n.startswith("model.visual")}
        assert result["grads"].keys() == expected
        if spec.get("lora"):
            assert all(".lora_" in n for n in expected)
        else:
            assert sum(".mlp.gate.weight" in n for n in expected) == SPEC.layers
        for pname, grad in result["grads"].items():
            assert_within_fp32_error(grad, ref_grads[pname], truth_grads[pname], at_least=TOL,
                                     name=pname)
