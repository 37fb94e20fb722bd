"""MoE routing replay on one rank (SP = 1) and the routes in the data.

Data: both forms of `routed_experts` (nested lists with null and -1 rows; the compact base64 form,
also with start > 0 and one row short, as engines return it) give the same host routes; they are
compact (uint8) on the host, cut with their tokens, packed beside samples without routes and
sharded by the ShardPlan; every bad route is one error naming file:line in `vlmcp validate`
(wrong L_moe or K, an id >= num_experts, a duplicate, undecodable base64, a shape that disagrees
with the tokens, routes on a dense checkpoint, on a chat record, on a preference pair).

Model: a packed step with routes equals plain transformers with each sample forwarded alone and
its routers forced to the routes by the definition (tests/helpers/replay_reference.py), loss and
every gradient (router weights included) in fp32 held to float64 with fp32's own error; also
under gradient checkpointing with train.tiled_mlp (the tiles carry their rows), with the router
aux loss (counts of the replayed experts), and in the score pass. Replay is not a no-op: routes
equal to the native ones give the native step exactly and agreement 1.0; routes that differ in one
layer change the gradients as the reference does; random routes agree on about 1/C(E, K) of the
rows. R2 round trip: the routes `score` records, replayed, give the native step and agreement 1.0.
Errors: routes on a dense model, a wrong MoE layer count, training outside `micro_batch`, a router
hook that did not fire. (SP = 1, 2 and 4 with DeepSpeed: tests/test_router_replay_sp.py; the command
line: test_score_routes_then_train_replays_them_with_agreement_one below.)"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, write_job
from tests.helpers.parity import (assert_within_fp32_error, build_model, float64_reference,
                                  make_sample, pack, reference_loss_and_grads, rel_err)
from tests.helpers.replay_reference import (compact_form, force_routes, host_routes,
                                            native_routes, random_routes)
from vlmcp.cli import main
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.formats import parse_record
from vlmcp.data.pack import build_batch
from vlmcp.data.routes import (RouteSpec, encode_routes, no_route, pack_routes, parse_routes,
                               route_spec)
from vlmcp.model.packed import PackedVLM
from vlmcp.model.router_replay import ShardRoutes
from vlmcp.parallel.shard import ShardPlan

TOL = 1e-5
#: The tiny MoE model: 4 MoE layers, top-2 of 4 experts.
SPEC = RouteSpec(layers=4, top_k=2, num_experts=4)


# --------------------------------------------------------------------------- the data


def _record(n: int = 8, prompt: int = 3, **extra) -> dict:
    ids = list(range(10, 10 + n))
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:], **extra}


def _routes(n: int, seed: int = 0) -> torch.Tensor:
    return random_routes(torch.Generator().manual_seed(seed), n, SPEC)


def test_the_tiny_moe_checkpoint_has_the_route_layout_its_config_says(tiny_moe_checkpoint,
                                                                      tiny_checkpoint):
    config = json.loads((tiny_moe_checkpoint / "config.json").read_text())
    assert route_spec(config) == SPEC and SPEC.dtype == torch.uint8
    assert route_spec(json.loads((tiny_checkpoint / "config.json").read_text())) is None
    assert RouteSpec(40, 8, 256).dtype == torch.uint16 and no_route(torch.uint16) == 65535


def test_both_forms_give_the_same_compact_host_routes_with_no_route_rows():
    routes = _routes(8)
    expected = routes.clone()
    expected[:3] = -1          # prompt tokens without a route
    expected[5, 2] = -1        # one layer of one token without a route
    expected[7] = -1           # the last token: engines never route it
    nested = expected.tolist()
    nested[0] = None
    nested[5][2] = None
    forms = [nested, expected.tolist(), compact_form(expected, 0, "int16"),
             compact_form(expected[:7], 3, "int16"), compact_form(expected, 3, "int32")]
    host = [parse_routes(form, 8, SPEC, "d.jsonl:1") for form in forms]
    for got in host:
        assert got.dtype == torch.uint8 and got.shape == (8, 4, 2)
        assert torch.equal(got, host_routes(expected, SPEC))
    assert torch.equal(parse_routes(encode_routes(expected.numpy()), 8, SPEC, "s"), host[0])
    assert encode_routes(routes.numpy())["dtype"] == "uint8"
    assert encode_routes(expected.numpy())["dtype"] == "int16"


def test_routes_are_cut_with_their_tokens_and_kept_on_the_sample(tiny_moe_checkpoint, tmp_path):
    from vlmcp.data.processor import load_processor

    processor = load_processor(tiny_moe_checkpoint)
    routes = _routes(8)
    record = _record(routed_experts=routes.tolist())
    sample = parse_record(record, "d.jsonl:1", tmp_path, processor, 6, truncate=True)
    assert torch.equal(sample.routes, host_routes(routes[:6], SPEC))
    assert parse_record(_record(), "d.jsonl:2", tmp_path, processor, 8).routes is None


def test_a_pack_holds_samples_with_and_without_routes_and_each_rank_gets_its_rows(
        tiny_moe_checkpoint, tmp_path):
    from vlmcp.data.processor import load_processor

    processor = load_processor(tiny_moe_checkpoint)
    a, b = _routes(8, 1), _routes(9, 2)
    samples = [parse_record(_record(8, routed_experts=a.tolist()), "d:1", tmp_path, processor, 64),
               parse_record(_record(5), "d:2", tmp_path, processor, 64),
               parse_record(_record(9, routed_experts=compact_form(b, 0, "uint8")), "d:3",
                            tmp_path, processor, 64)]
    batch = build_batch(samples)
    none = torch.full((5, 4, 2), -1, dtype=torch.long)
    assert batch.routes.dtype == torch.uint8
    assert torch.equal(batch.routes, host_routes(torch.cat([a, none, b]), SPEC))
    whole = torch.cat([a, none, b, torch.full((2, 4, 2), -1)])       # 22 tokens -> 24 at P = 4
    for rank in range(4):
        plan = ShardPlan.build(batch.seq_lens, 4, rank)
        shard = ShardRoutes.of(batch, plan, torch.device("cpu"))
        mine = whole[rank * 6:(rank + 1) * 6]
        assert torch.equal(shard.routed, (mine >= 0).all(-1))
        assert torch.equal(shard.ids[shard.routed], mine[(mine >= 0).all(-1)])
    assert pack_routes([None, None], [3, 4]) is None


def _bad_lines() -> dict[str, object]:
    """Each bad `routed_experts` value -> the words its error must hold."""
    good = _routes(8)
    bad_id, duplicate, partly = good.clone(), good.clone(), good.clone()
    bad_id[4, 1, 0] = 4
    duplicate[2, 3] = torch.tensor([1, 1])
    partly[6, 0] = torch.tensor([2, -1])
    return {
        "MoE layers": compact_form(good[:, :3], 0, "uint8"),                  # L_moe 3, not 4
        "top-2": compact_form(torch.cat([good, good[..., :1]], -1), 0, "uint8"),  # K 3
        "outside [0, num_experts)": bad_id.tolist(),
        "duplicate expert id": compact_form(duplicate, 0, "int16"),
        "partly -1": partly.tolist(),
        "not valid base64": {"data": "@@not base64@@", "shape": [8, 4, 2], "dtype": "uint8"},
        "disagrees with the 8 input_ids": compact_form(good[:5], 0, "uint8"),
        "token entries for 8": good[:7].tolist(),
        "decodes to": {**compact_form(good, 0, "uint8"), "shape": [8, 4, 3]},
        "dtype must be": {**compact_form(good, 0, "uint8"), "dtype": "float32"},
    }


def _validate(checkpoint, data, tmp_path, capsys) -> list[str]:
    job = write_job(tmp_path / "job.json", tiny_job(checkpoint, data, tmp_path / "out",
                                                    data={"cache_dir": str(tmp_path / "cache")}))
    assert main(["validate", str(job)]) == 1
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_every_bad_route_is_one_error_naming_its_line_before_any_rank_starts(
        tiny_moe_checkpoint, make_jsonl, tmp_path, capsys):
    bad = _bad_lines()
    lines = [_record(routed_experts=_routes(8).tolist())]
    lines += [_record(routed_experts=value) for value in bad.values()]
    lines += [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                 "content": "yo"}],
               "routed_experts": [[None] * 4] * 3},
              {"prompt_input_ids": [10, 11], "chosen_input_ids": [12], "rejected_input_ids": [13],
               "routed_experts": []}]
    errors = _validate(tiny_moe_checkpoint, make_jsonl(lines), tmp_path, capsys)
    assert len(errors) == len(lines) - 1, errors
    for line, words in enumerate(bad, start=2):
        assert any(f"data.jsonl:{line}:" in e and words in e for e in errors), (words, errors)
    assert any("data.jsonl:12:" in e and "tokens format" in e for e in errors)
    assert any("data.jsonl:13:" in e and "routed_experts" in e for e in errors)


def test_routes_on_a_dense_checkpoint_are_an_error_naming_the_line(tiny_checkpoint, make_jsonl,
                                                                   tmp_path, capsys):
    data = make_jsonl([_record(), _record(routed_experts=_routes(8).tolist())])
    errors = _validate(tiny_checkpoint, data, tmp_path, capsys)
    assert len(errors) == 1 and "data.jsonl:2:" in errors[0] and "dense model" in errors[0]


# --------------------------------------------------------------------------- the model


def _samples(model, gen, lengths=(21, 30, 17)):
    grids = [[(1, 4, 4)], [], []]
    return [make_sample(gen, model.config, n, g) for n, g in zip(lengths, grids)]


def _given_routes(samples, gen) -> list[torch.Tensor | None]:
    """Routes of the first samples (-1 on the first one's prompt and on one layer of one of its
    tokens); the last sample has none."""
    routes = [random_routes(gen, len(s.input_ids), SPEC) for s in samples[:-1]] + [None]
    routes[0][:7] = -1
    routes[0][12, 2] = -1
    return routes


def _batch(model, samples, routes):
    batch = pack(samples, model)
    batch.routes = pack_routes([None if r is None else host_routes(r, SPEC) for r in routes],
                               batch.seq_lens)
    return batch


def _forced(model, samples, routes):
    forced = copy.deepcopy(model)
    force_routes(forced, {tuple(s.input_ids.tolist()): r for s, r in zip(samples, routes)
                          if r is not None})
    return forced


def _packed_step(model, batch, **options):
    trained = copy.deepcopy(model)
    trained.model.visual.requires_grad_(False)
    module = PackedVLM(trained, **options)
    module.train()
    with module.micro_batch(batch):
        loss, count, share = module(batch)
        (loss / count + (module.router_aux_coef * share if share is not None else 0)).backward()
    grads = {n: p.grad for n, p in trained.named_parameters() if p.grad is not None}
    return float(loss.detach()) / count, share, grads, module.replay_metrics()


def _assert_step(got_loss, grads, reference, truth, name=""):
    (ref_loss, ref_grads), (truth_loss, truth_grads) = reference, truth
    assert_within_fp32_error(got_loss, ref_loss, truth_loss, at_least=TOL, name=f"{name} loss")
    assert grads.keys() == {n for n in ref_grads if not n.startswith("model.visual")}
    assert any(".mlp.gate.weight" in n for n in grads)
    for n, grad in grads.items():
        assert_within_fp32_error(grad, ref_grads[n], truth_grads[n], at_least=TOL, name=n)


@pytest.mark.parametrize("options", [{}, {"gradient_checkpointing": True, "tiled_mlp": True}],
                         ids=["plain", "checkpointing_tiled_mlp"])
def test_packed_replay_step_equals_transformers_with_its_routers_forced(options):
    model = build_model(moe=True, **({"hidden_size": 16} if options else {}))
    gen = torch.Generator().manual_seed(5)
    samples = _samples(model, gen)
    routes = _given_routes(samples, gen)
    forced = _forced(model, samples, routes)
    loss, _, grads, metrics = _packed_step(model, _batch(model, samples, routes), **options)
    _assert_step(loss, grads, reference_loss_and_grads(forced, samples),
                 float64_reference(reference_loss_and_grads, forced, samples))
    assert metrics["router_replay_tokens"] == (21 - 7) * 4 - 1 + 30 * 4
    native = reference_loss_and_grads(model, samples)[1]
    gate = "model.language_model.layers.1.mlp.gate.weight"
    assert rel_err(grads[gate], native[gate]) > 1000 * TOL, "replay changed nothing"


def test_routes_equal_to_the_native_ones_give_the_native_step_and_agreement_one():
    model = build_model(moe=True)
    samples = _samples(model, torch.Generator().manual_seed(6))
    routes = [native_routes(model, s) for s in samples]
    loss, _, grads, metrics = _packed_step(model, _batch(model, samples, routes))
    native_loss, _, native_grads, native_metrics = _packed_step(model, _batch(model, samples,
                                                                              [None] * 3))
    assert loss == native_loss
    for n, grad in grads.items():
        assert torch.equal(grad, native_grads[n]), n
    assert metrics == {"router_replay_tokens": 68 * 4, "router_replay_agreement": 1.0}
    assert native_metrics == {"router_replay_tokens": 0, "router_replay_agreement": None}


def test_routes_that_differ_in_one_layer_change_the_step_as_the_reference_does():
    model = build_model(moe=True)
    gen = torch.Generator().manual_seed(8)
    samples = _samples(model, gen)
    routes = [native_routes(model, s) for s in samples]
    for r in routes:
        r[:, 2] = random_routes(gen, len(r), SPEC)[:, 2]
    forced = _forced(model, samples, routes)
    loss, _, grads, metrics = _packed_step(model, _batch(model, samples, routes))
    _assert_step(loss, grads, reference_loss_and_grads(forced, samples),
                 float64_reference(reference_loss_and_grads, forced, samples))
    native = reference_loss_and_grads(model, samples)[1]
    for layer in (2, 3):
        gate = f"model.language_model.layers.{layer}.mlp.gate.weight"
        assert rel_err(grads[gate], native[gate]) > 1000 * TOL
    # layers 0, 1 and 3 replay their own routes; only layer 2's differ
    assert 0.75 < metrics["router_replay_agreement"] < 1.0


def test_random_routes_agree_by_chance_on_about_one_in_c_e_k_rows():
    model = build_model(moe=True)
    gen = torch.Generator().manual_seed(9)
    samples = [make_sample(gen, model.config, 96) for _ in range(4)]
    batch = _batch(model, samples, [random_routes(gen, 96, SPEC) for _ in samples])
    module = PackedVLM(copy.deepcopy(model))
    with module.micro_batch(batch), torch.no_grad():
        module(batch)
    metrics = module.replay_metrics()
    chance = 1 / math.comb(SPEC.num_experts, SPEC.top_k)
    assert metrics["router_replay_tokens"] == 4 * 96 * 4
    # 1536 rows: the binomial standard deviation around 1/6 is 0.0095
    assert abs(metrics["router_replay_agreement"] - chance) < 0.04, metrics


def _aux_reference(model, samples):
    """CE / N + coef x aux of the definition (model.router_loss) with the routers' selections
    (forced routes) as counts, each sample forwarded alone; (loss, aux, grads)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    calls = []
    for router in [m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeTopKRouter"]:
        router.register_forward_hook(lambda m, a, out: calls.append((out[0], out[2])))
    text = model.config.text_config
    n_total = sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in samples)
    counts = torch.zeros(text.num_experts, dtype=torch.float64)
    probs, ce = 0, 0
    for s in samples:
        calls.clear()
        out = model(input_ids=s.input_ids[None], labels=s.labels[None], use_cache=False,
                    **({"pixel_values": s.pixel_values, "image_grid_thw": s.image_grid_thw,
                        "mm_token_type_ids": (s.input_ids == model.config.image_token_id)[None].int()}
                       if s.pixel_values is not None else {}))
        ce = ce + out.loss * int((s.labels[1:] != IGNORE_INDEX).sum()) / n_total
        for logits, chosen in calls:
            probs = probs + torch.softmax(logits, dim=-1).sum(0)
            counts += torch.bincount(chosen.reshape(-1), minlength=text.num_experts).double()
    rows = sum(len(s.input_ids) for s in samples) * text.num_hidden_layers
    aux = text.num_experts * ((counts / rows).to(probs.dtype) * (probs / rows)).sum()
    (ce + text.router_aux_loss_coef * aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (float(ce), float(aux)), grads


def test_the_router_aux_loss_under_replay_counts_the_replayed_experts_with_the_routers_probs():
    model = build_model(moe=True, router_aux_loss_coef=0.5)
    with torch.no_grad():     # peaked router probabilities, so that which experts count matters
        for layer in model.model.language_model.layers:
            layer.mlp.gate.weight.mul_(30)
    gen = torch.Generator().manual_seed(10)
    samples = _samples(model, gen)
    routes = _given_routes(samples, gen)
    forced = _forced(model, samples, routes)
    loss, share, grads, _ = _packed_step(model, _batch(model, samples, routes),
                                         router_aux_loss=True)
    (ref_ce, ref_aux), ref_grads = _aux_reference(forced, samples)
    (truth_ce, truth_aux), truth_grads = float64_reference(_aux_reference, forced, samples)
    assert_within_fp32_error(float(share.detach()), ref_aux, truth_aux, at_least=TOL, name="aux")
    native_aux = _aux_reference(model, samples)[0][1]
    assert abs(ref_aux - native_aux) > 100 * TOL * native_aux, "the replayed counts matter"
    _assert_step(loss, grads, (ref_ce, ref_grads), (truth_ce, truth_grads))


def test_the_routes_score_records_replay_to_the_native_step_r2():
    model = build_model(moe=True)
    samples = _samples(model, torch.Generator().manual_seed(12))
    module = PackedVLM(copy.deepcopy(model))
    batch = _batch(model, samples, [None] * 3)
    logprobs, _, recorded = module(batch, scores=True, routes=True)
    offsets = [0, 21, 51, 68]
    scored = [parse_routes(encode_routes(recorded[a:b].numpy()), b - a, SPEC, "scores.jsonl:1")
              for a, b in zip(offsets, offsets[1:])]
    assert all(torch.equal(s, host_routes(native_routes(model, raw), SPEC))
               for s, raw in zip(scored, samples))
    replayed = _batch(model, samples, [None] * 3)
    replayed.routes = pack_routes(scored, replayed.seq_lens)
    loss, _, grads, metrics = _packed_step(model, replayed)
    native_loss, _, native_grads, _ = _packed_step(model, batch)
    assert loss == native_loss and metrics["router_replay_agreement"] == 1.0
    assert all(torch.equal(grads[n], native_grads[n]) for n in grads)
    replayed_scores = module(replayed, scores=True)[0]
    assert torch.equal(replayed_scores.isnan(), logprobs.isnan())
    assert torch.equal(replayed_scores[~logprobs.isnan()], logprobs[~logprobs.isnan()])


def test_bad_routes_in_the_model_are_errors_and_a_silent_hook_is_caught():
    gen = torch.Generator().manual_seed(13)
    dense = build_model()
    samples = _samples(dense, gen)
    with pytest.raises(ValueError, match="dense model"):
        PackedVLM(dense)(_batch(dense, samples, [_routes(len(s.input_ids)) for s in samples]))
    model = build_model(moe=True)
    batch = _batch(model, samples, [_routes(len(s.input_ids)) for s in samples])
    module = PackedVLM(copy.deepcopy(model))
    module.train()
    with pytest.raises(RuntimeError, match="micro_batch"):
        module(batch)
    wrong = copy.copy(batch)
    wrong.routes = torch.cat([batch.routes, batch.routes], dim=1)   # 8 "layers" for 4 routers
    with pytest.raises(ValueError, match="routes of 8 MoE layers for a model with 4"):
        with module.micro_batch(wrong):
            pass
    module.router_replay.routers[2].__dict__.pop("forward")       # a hook that never fires
    with pytest.raises(RuntimeError, match="MoE layer 2 routed 0 rows"):
        with module.micro_batch(batch), torch.no_grad():
            module(batch)


@pytest.mark.e2e
def test_score_routes_then_train_replays_them_with_agreement_one(tiny_moe_checkpoint, tmp_path):
    """`vlmcp score --routes` on the initial policy, its routes written into the data, then one
    step of `vlmcp train`: every (token, layer) replayed, agreement 1.0, and the step's loss is
    the scored policy's (-mean of the score file's target logprobs)."""
    gen = torch.Generator().manual_seed(14)
    records = []
    for n in (19, 26, 11):
        ids = torch.randint(10, 400, (n,), generator=gen).tolist()
        records.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 4 + ids[4:]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = tiny_job(tiny_moe_checkpoint, data, tmp_path / "score", train={"max_steps": 1},
                   data={"cache_dir": str(tmp_path / "cache"), "max_seq_len": 96})
    assert_ok(run_vlmcp(["score", str(write_job(tmp_path / "score.json", job)), "--routes",
                         "--out", str(tmp_path / "scores.jsonl")]))
    scores = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    for record, scored in zip(records, scores):
        record["routed_experts"] = scored["routed_experts"]
        assert scored["routed_experts"]["shape"] == [len(record["input_ids"]), 4, 2]
    routed = tmp_path / "routed.jsonl"
    routed.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = {**job, "data": {**job["data"], "train": str(routed)}, "output_dir": str(tmp_path / "out")}
    assert_ok(run_vlmcp(["train", str(write_job(tmp_path / "train.json", job))]))
    rows = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "loss" in r)
    assert row["router_replay_tokens"] == (19 + 26 + 11) * 4
    assert row["router_replay_agreement"] == 1.0
    logprobs = [x for s in scores for x in s["logprobs"]]
    assert abs(row["loss"] + sum(logprobs) / len(logprobs)) <= TOL * row["loss"]
