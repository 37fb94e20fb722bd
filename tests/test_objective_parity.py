"""Token-level objectives and scoring under SP = 1 (DP 2), 2 (grad accumulation 2) and 4 equal
plain transformers with each sample forwarded alone (fp32, rel <= 1e-5): the step loss and every
gradient of weighted_ce, policy_gradient (token and sequence normalisation) and ppo_clip with a
k3 KL penalty (tokens clipped on both sides), the objective's metrics, and `score_samples`'
per-sample target logprobs and entropies. The reference computes each objective from its
definition on plain transformers' log-softmax; it never calls vlmcp's objective code.

One more case per SP size gives B and C (not A) per-token `temperatures` that vary inside each
sample and `inference_logprobs`: its loss, gradients, entropy, train-inference mismatch metrics
and scores equal the same computed on plain transformers' log_softmax(logits / tau) (A, without
the arrays, at tau 1 and outside the mismatch metrics; at SP 4 it shares a pack with B and C).

The hybrid model's pack puts an image's placeholders across a shard edge at SP 2 and 4. Each SP
size runs all its cases in one set of processes (tests/sp_cases.engine_step)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.parity import build_model, make_sample, mm_token_type_ids, pack, rel_err
from tests.helpers.sp_cases import engine_step
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.formats import Sample
from vlmcp.data.pack import build_batch
from vlmcp.model.loss import CHECKPOINTED_CE_BYTES_PER_LOGIT, DEFAULT_LOSS_CHUNK_MB
from vlmcp.model.objectives import Objective

pytestmark = pytest.mark.e2e

TOL = 1e-5
CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.25, 0.1

#: The samples (length, image grids). In the order C, B, A, B's 16 placeholders lie at 21..36:
#: across the shard edge at 27 (SP 2, packs [C, B] and [A]) and at 34 (SP 4, one pack [C, B, A]).
SAMPLES = {"A": (11, []), "B": (37, [(1, 8, 8)]), "C": (17, [(1, 2, 2), (1, 2, 2)])}
#: world, SP size, grad accumulation, per DP rank, per micro-batch, the sample names.
LAYOUTS = {1: (2, 1, 1, [[["C", "B"]], [["A"]]]),
           2: (2, 2, 2, [[["C", "B"], ["A"]]]),
           4: (4, 4, 1, [[["C", "B", "A"]]])}
#: ZeRO stage per SP size; at SP 4 the partitioned lm_head runs 4-row loss chunks (the ranks hold
#: different target counts and must still make the same module calls).
STAGES = {1: 0, 2: 2, 4: 3}
CHUNK_MB = {1: DEFAULT_LOSS_CHUNK_MB, 2: DEFAULT_LOSS_CHUNK_MB,
            4: 4 * 512 * CHECKPOINTED_CE_BYTES_PER_LOGIT / 2**20}
OBJECTIVES = {
    "weighted_ce": Objective("weighted_ce"),
    "policy_gradient_token": Objective("policy_gradient"),
    "policy_gradient_sequence": Objective("policy_gradient", normalize="sequence"),
    "ppo_clip_kl_sequence": Objective("ppo_clip", normalize="sequence", clip_low=CLIP_LOW,
                                      clip_high=CLIP_HIGH, kl_coef=KL_COEF),
    "policy_gradient_tempered": Objective("policy_gradient"),
}
#: The case whose samples B and C carry `temperatures` and `inference_logprobs`.
TEMPERED = "policy_gradient_tempered"
#: The samples that carry them.
TEMPERED_SAMPLES = ("B", "C")


def _forward_alone(model, sample):
    kwargs = {}
    if sample.pixel_values is not None:
        kwargs = dict(pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw,
                      mm_token_type_ids=mm_token_type_ids(sample, model.config)[None])
    return model(input_ids=sample.input_ids[None], use_cache=False, **kwargs).logits[0]


def _target_logprobs(model, sample, temperatures=None):
    """(logp [n], entropy [n], target positions t: labels[t] != -100, t >= 1), plain transformers;
    with `temperatures` (aligned with labels) of log_softmax(logits / tau)."""
    logits = _forward_alone(model, sample)
    positions = [t for t in range(1, len(sample.labels)) if sample.labels[t] != IGNORE_INDEX]
    logits = logits[[t - 1 for t in positions]].float()
    if temperatures is not None:
        logits = logits / temperatures[positions][:, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, sample.labels[positions][:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(1)
    return logp, entropy, positions


def _reference(model, samples, arrays, objective):
    """The step loss, gradients and metrics of `objective`, from its definition."""
    model = copy.deepcopy(model)
    n_tokens = sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in samples)
    denominator = n_tokens if objective.normalize == "token" else len(samples)
    total, entropy_sum, clipped, ratio_sum, approx_kl, ref_kl = 0.0, 0.0, 0, 0.0, 0.0, 0.0
    mismatch = {"diff": 0.0, "kl": 0.0, "targets": 0, "abs": 0.0}
    sides = {"low": 0, "high": 0}
    for sample, sample_arrays in zip(samples, arrays):
        logp, entropy, positions = _target_logprobs(model, sample,
                                                    sample_arrays.get("temperatures"))
        a = {k: v[positions] for k, v in sample_arrays.items()}
        if "inference_logprobs" in a:
            d = (logp.detach().double() - a["inference_logprobs"].double())
            mismatch["diff"] += float(-d.sum())
            mismatch["kl"] += float((torch.exp(d) - 1 - d).sum())
            mismatch["targets"] += len(positions)
            mismatch["abs"] += float(a["inference_logprobs"].abs().sum())
        if objective.type == "weighted_ce":
            losses = -a["loss_weights"] * logp
        elif objective.type == "policy_gradient":
            losses = -a["advantages"] * logp
        else:
            ratio = torch.exp(logp - a["old_logprobs"])
            adv = a["advantages"]
            bounded = torch.where(adv > 0, torch.clamp(ratio, max=1 + CLIP_HIGH),
                                  torch.clamp(ratio, min=1 - CLIP_LOW))
            losses = -torch.minimum(ratio * adv, bounded * adv)
            d = a["ref_logprobs"] - logp
            losses = losses + KL_COEF * (torch.exp(d) - d - 1)
            is_clipped = bounded * adv < ratio * adv
            clipped += int(is_clipped.sum())
            sides["high"] += int((is_clipped & (adv > 0)).sum())
            sides["low"] += int((is_clipped & (adv < 0)).sum())
            ratio_sum += float(ratio.detach().sum())
            approx_kl += float(((ratio - 1) - torch.log(ratio)).detach().sum())
            ref_kl += float((torch.exp(d) - d - 1).detach().sum())
        per_sample = losses.sum() / (len(positions) if objective.normalize == "sequence" else 1)
        (per_sample / denominator).backward()
        total += float(per_sample.detach()) / denominator
        entropy_sum += float(entropy.detach().sum())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = {"entropy": entropy_sum / n_tokens, "clip_fraction": clipped / n_tokens,
             "ratio": ratio_sum / n_tokens, "approx_kl": approx_kl / n_tokens,
             "ref_kl": ref_kl / n_tokens}
    if mismatch["targets"]:
        stats.update({"mismatch_logprob_diff": mismatch["diff"] / mismatch["targets"],
                      "mismatch_kl": mismatch["kl"] / mismatch["targets"],
                      "mismatch_targets": mismatch["targets"],
                      "mismatch_scale": mismatch["abs"] / mismatch["targets"]})
    return total, grads, stats, sides


def _arrays(gen, model, sample):
    """Per-token arrays aligned with labels: weights, advantages, and old / ref logprobs a random
    log-ratio away from the model's own (so some ppo ratios leave the clip range on each side)."""
    length = len(sample.labels)
    logp, _, positions = _target_logprobs(model, sample)
    own = torch.zeros(length)
    own[positions] = logp.detach()
    return {"loss_weights": torch.rand(length, generator=gen) * 2,
            "advantages": torch.randn(length, generator=gen),
            "old_logprobs": own - (torch.rand(length, generator=gen) - 0.5) * 1.2,
            "ref_logprobs": own - (torch.rand(length, generator=gen) - 0.5) * 0.6}


def _as_sample(raw, model, arrays, name) -> Sample:
    positions, _ = model.model.get_rope_index(raw.input_ids[None], mm_token_type_ids(raw, model.config)[None],
                                              image_grid_thw=raw.image_grid_thw)
    return Sample(input_ids=raw.input_ids.tolist(), labels=raw.labels.tolist(), image_paths=[],
                  pixel_values=raw.pixel_values, image_grid_thw=raw.image_grid_thw,
                  mm_token_type_ids=mm_token_type_ids(raw, model.config).long(),
                  position_ids=positions[:, 0], source=f"{name}.jsonl:1", token_arrays=arrays)


def _tempered_arrays(gen, model, sample):
    """Advantages, per-token temperatures in [0.5, 1.5] and inference logprobs a small random
    distance from the model's own tempered ones, aligned with labels."""
    length = len(sample.labels)
    temperatures = 0.5 + torch.rand(length, generator=gen)
    logp, _, positions = _target_logprobs(model, sample, temperatures)
    inference = torch.zeros(length)
    inference[positions] = logp.detach() + 0.05 * torch.randn(len(positions), generator=gen)
    return {"advantages": torch.randn(length, generator=gen), "temperatures": temperatures,
            "inference_logprobs": inference}


@functools.cache
def _setup(tmp_root):
    model = build_model(num_key_value_heads=2).eval()
    checkpoint = tmp_root / "objectives"
    model.save_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(7)
    raw = {name: make_sample(gen, model.config, length, grids) for name, (length, grids) in SAMPLES.items()}
    with torch.no_grad():
        arrays = {name: _arrays(gen, model, s) for name, s in raw.items()}
        tempered = {name: (_tempered_arrays(gen, model, s) if name in TEMPERED_SAMPLES
                           else {"advantages": arrays[name]["advantages"]})
                    for name, s in raw.items()}
    return model, checkpoint, raw, arrays, tempered


def _case_arrays(name, arrays, tempered):
    return tempered if name == TEMPERED else arrays


def _packs(names_per_rank, model, raw, arrays):
    """The packs of `names_per_rank`, each sample's arrays shifted in (via `build_batch`'s rules:
    an array of `ARRAY_FILL` that only some samples carry is filled in for the others)."""
    packs = []
    for rank_micro in names_per_rank:
        rank_packs = []
        for names in rank_micro:
            batch = pack([raw[n] for n in names], model)
            batch.token_arrays = build_batch([_as_sample(raw[n], model, arrays[n], n)
                                              for n in names]).token_arrays
            rank_packs.append(batch)
        packs.append(rank_packs)
    return packs


@functools.cache
def _results(sp: int, tmp_root):
    model, checkpoint, raw, arrays, tempered = _setup(tmp_root)
    world, _, accum, layout = LAYOUTS[sp]
    order = [n for rank_micro in layout for names in rank_micro for n in names]
    cases = {}
    for i, (name, objective) in enumerate(OBJECTIVES.items()):
        case_arrays = _case_arrays(name, arrays, tempered)
        score = [_as_sample(raw[n], model, case_arrays[n], n) for n in order]
        cases[name] = dict(checkpoint=str(checkpoint), stage=STAGES[sp], mode="state", grad_accum=accum,
                           packs=_packs(layout, model, raw, case_arrays),
                           loss_chunk_mb=CHUNK_MB[sp], objective=objective,
                           score=score if i == 0 or name == TEMPERED else None, score_max_len=54)
    return order, run_ranks(engine_step, world, sp, cases)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("objective_parity")


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_objective_step_equals_plain_transformers_per_sample(sp, name, tmp_root):
    model, _, raw, arrays, tempered = _setup(tmp_root)
    order, per_rank = _results(sp, tmp_root)
    objective = OBJECTIVES[name]
    case_arrays = _case_arrays(name, arrays, tempered)
    ref_loss, ref_grads, ref_stats, sides = _reference(model, [raw[n] for n in order],
                                                       [case_arrays[n] for n in order], objective)
    if objective.type == "ppo_clip":
        assert sides["low"] > 0 and sides["high"] > 0, sides
    for result in per_rank:
        assert abs(result[name]["loss"] - ref_loss) <= TOL * abs(ref_loss)
        stats = result[name]["stats"]
        for key in objective.metric_keys():
            assert abs(stats[key] - ref_stats[key]) <= TOL * abs(ref_stats[key]), key
        if name == TEMPERED:
            # engine_step divides every sum by the targets; the mismatch means divide by their own
            # count, the targets of B and C.
            targets = sum(int((raw[n].labels[1:] != IGNORE_INDEX).sum()) for n in order)
            assert round(stats["mismatch_targets"] * targets) == ref_stats["mismatch_targets"]
            # The mean difference cancels: its fp32 error is relative to the logprobs' size.
            scales = {"mismatch_logprob_diff": ref_stats["mismatch_scale"],
                      "mismatch_kl": ref_stats["mismatch_kl"]}
            for key, scale in scales.items():
                got = stats[key] / stats["mismatch_targets"]
                assert abs(got - ref_stats[key]) <= TOL * scale, key
        else:
            assert stats["mismatch_targets"] == 0
        grads = result[name]["grads"]
        assert grads.keys() == {n for n in ref_grads if not n.startswith("model.visual")}
        for pname, grad in grads.items():
            assert rel_err(grad, ref_grads[pname]) <= TOL, pname


@pytest.mark.parametrize("case", ["weighted_ce", TEMPERED], ids=["tau_1", "tau_per_token"])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_score_logprobs_equal_plain_transformers_per_sample(sp, case, tmp_root):
    model, _, raw, arrays, tempered = _setup(tmp_root)
    order, per_rank = _results(sp, tmp_root)
    records = per_rank[0][case]["scores"]
    assert [r["index"] for r in records] == list(range(len(order)))
    assert all(not r[case]["scores"] for r in per_rank[1:])
    case_arrays = _case_arrays(case, arrays, tempered)
    with torch.no_grad():
        for record, name in zip(records, order):
            logp, entropy, _ = _target_logprobs(model, raw[name],
                                                case_arrays[name].get("temperatures"))
            got_logp = torch.tensor(record["logprobs"], dtype=torch.float64)
            got_entropy = torch.tensor(record["entropy"], dtype=torch.float64)
            assert rel_err(got_logp, logp.double()) <= TOL
            assert rel_err(got_entropy, entropy.double()) <= TOL
