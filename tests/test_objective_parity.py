"""Every objective under SP = 1 (DP 2 x grad accumulation 2, ZeRO-0), 2 (grad accumulation 2,
ZeRO-2) and 4 (ZeRO-3, 4-row loss chunks through the partitioned head) equals plain transformers
with each sample forwarded alone: the step loss, every gradient and the
metrics of weighted_ce, policy_gradient (token, sequence and constant normalisation), ppo_clip
(k3 penalty; dual clip), the mismatch corrections tis and mis at token and sequence level, dppo,
gspo, cispo, opd (both forms), a three-term loss, and dpo, ipo and simpo on preference pairs
(one LoRA dpo case at SP 2), and again with a degree per micro-batch (`parallel.sp_dynamic`) at
SP 2 (ZeRO-2) and at SP 4 (world 4, ZeRO-3, the 4-row loss chunks): one micro-batch spread over
the SP group, one whole on each rank (at SP 4 the pairs run their whole packs first, and a rank
past the three pairs repeats one at weight 0, as the training loop does); the train-inference
mismatch metrics of every token case (its data carries inference_logprobs); one more case whose
samples B and C (not the others) carry per-token `temperatures` that vary inside each sample
and `inference_logprobs`: its loss, gradients, entropy and mismatch metrics (over B and C only)
are those of plain transformers' log_softmax(logits / tau), with the other samples at tau 1 (at
SP 4 they share a pack with B and C, which fills their arrays in); and `score_samples`'
per-sample logprobs (also at per-token temperatures), entropies and pair sums, on training's
degree plan too in the dynamic layouts (short rows whole on one rank beside a spread one). The reference
(tests/helpers/objective_reference.py) builds each objective from its definition on plain
transformers' log-softmax; it never calls vlmcp's objective code. Bounds are fair: a value that
is not within rel 1e-5 of plain transformers in fp32 (two fp32 kernels round differently: the
DeltaNet gate gradients) is held to the float64 reference (float64_truth) within rel 1e-5 plus
the distance of plain transformers in fp32 from it. Each case with sides asserts that tokens are
really clipped, dropped, clamped or masked on each of them.

The hybrid model's token packs put an image's placeholders across a shard edge at SP 2 and 4,
and at SP 4 sample B spans three ranks; sample C holds an image and a two-group video (so every
objective trains on video too). Pair P's halves lie on different SP ranks at SP 2 (its prompt
image is encoded once, by rank 0, and serves both). Each SP size (and each dynamic layout) runs
all its objectives in one set of processes, on one engine (tests/helpers/sp_cases.engine_step
"runs")."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.objective_reference import (Reference, float64_truth, reference_pairs,
                                               reference_step, target_logprobs)
from tests.helpers.parity import (RawSample, build_model, make_sample, mm_token_type_ids, rel_err,
                                  seed_adapter_weights)
from tests.helpers.sp_cases import engine_step
from vlmcp.config import LossTerm
from vlmcp.data.batch import IGNORE_INDEX, REF_LOGP
from vlmcp.data.formats import Sample
from vlmcp.data.pack import build_batch, dynamic_slots
from vlmcp.model.loss import CHECKPOINTED_CE_BYTES_PER_LOGIT, DEFAULT_LOSS_CHUNK_MB
from vlmcp.model.loss_terms import Loss

pytestmark = pytest.mark.e2e

TOL = 1e-5
CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.25, 0.1

#: The samples (length, image grids, video grids). In the order C, B, A, D, E, B's 16
#: placeholders lie at 21..36: across the shard edge at 27 (SP 2, packs [C, B] and [A, D, E]) and
#: at 22 (SP 4, one pack of 87 tokens, where B covers ranks 0, 1 and 2). C holds an image and a
#: video of two temporal groups.
SAMPLES = {"A": (11, [], []), "B": (37, [(1, 8, 8)], []), "C": (17, [(1, 2, 2)], [(2, 2, 2)]),
           "D": (9, [], []), "E": (13, [], [])}
#: Per sample: the bias b of logp - old_logprobs (gspo's sequence ratio below, inside and above
#: its range) and c of log w = old_logprobs - inference_logprobs (the mismatch weight masked or
#: clamped above, kept, masked below).
OLD_BIAS = {"A": -0.2, "B": 0.2, "C": 0.0, "D": 0.0, "E": 0.0}
MISMATCH_BIAS = {"A": 0.0, "B": 1.0, "C": -1.0, "D": 0.2, "E": -0.2}
#: Preference pairs: prompt length, prompt image grids, chosen and rejected completion lengths.
PAIRS = {"P": (9, [(1, 4, 4)], 6, 6), "Q": (5, [], 5, 7), "R": (8, [(1, 2, 4)], 4, 5),
         "S": (6, [], 3, 6)}
#: world, SP size, grad accumulation, per DP rank, per micro-batch, the sample names; then the
#: same for the pairs. At SP 2, P's chosen half is rank 0's shard and its rejected half rank 1's.
LAYOUTS = {1: (2, 1, 2, [[["C", "B"], ["A"]], [["D"], ["E"]]], [[["P"], ["Q"]], [["R"], ["S"]]]),
           2: (2, 2, 2, [[["C", "B"], ["A", "D", "E"]]], [[["P"], ["Q", "R", "S"]]]),
           4: (4, 4, 1, [[["C", "B", "A", "D", "E"]]], [[["P", "Q", "R", "S"]]])}
#: A degree per micro-batch (parallel.sp_dynamic): the layouts are per global rank (one SP group),
#: a spread micro-batch listed alike on every rank, a degree-1 one a different whole pack per rank.
#: SP 2: the first micro-batch spread over both ranks ([C, B]; pair P, its halves on different
#: ranks), the second whole on each rank (degree 1: [A, D] and [E]; [Q, R] and [S]).
DYNAMIC = "2-dynamic"
LAYOUTS[DYNAMIC] = (2, 2, 2, [[["C", "B"], ["A", "D"]], [["C", "B"], ["E"]]],
                    [[["P"], ["Q", "R"]], [["P"], ["S"]]])
#: SP 4 (world 4, ZeRO-3): the tokens' first micro-batch is B spread over the four ranks (shards
#: of 10; its image's placeholders 4..19 across the shard edge at 10), the second [C] (image and
#: video), [A], [D] and [E] whole, one per rank; the pairs run whole first ([Q], [R] with its
#: image, [S], and rank 3 repeating [Q] at weight 0: four pairs leave no fourth one beside the
#: spread pair), then P spread over the four ranks (shards of 8: its chosen half on ranks 0-1,
#: its rejected half on ranks 1-3; rank 0's shard is prompt only, without a target, and must
#: still join the pair sums' backward: vlmcp.model.sample_sums).
DYNAMIC_4 = "4-dynamic"
LAYOUTS[DYNAMIC_4] = (4, 4, 2, [[["B"], [name]] for name in ("C", "A", "D", "E")],
                      [[[name], ["P"]] for name in ("Q", "R", "S", "Q")])
#: Per dynamic layout: the degree of each micro-batch of the token packs and of the pair packs
#: (None: spread over the SP group; 1: whole on one rank).
DYNAMIC_DEGREES = {DYNAMIC: ([None, 1], [None, 1]), DYNAMIC_4: ([None, 1], [1, None])}
#: Per dynamic layout: the (global rank, micro-batch) of the pair packs that repeat another rank's
#: degree-1 pack at weight 0 (vlmcp.data.pack.Slot.pack_of).
PAIR_REPEATS = {DYNAMIC: (), DYNAMIC_4: ((3, 0),)}
#: ZeRO stage per SP size; at SP 4 the partitioned lm_head runs 4-row loss chunks (the ranks hold
#: different target counts and must still make the same module calls).
STAGES = {1: 0, 2: 2, 4: 3, DYNAMIC: 2, DYNAMIC_4: 3}
CHUNK_MB = {1: DEFAULT_LOSS_CHUNK_MB, 2: DEFAULT_LOSS_CHUNK_MB, DYNAMIC: DEFAULT_LOSS_CHUNK_MB,
            4: 4 * 512 * CHECKPOINTED_CE_BYTES_PER_LOGIT / 2**20}
CHUNK_MB[DYNAMIC_4] = CHUNK_MB[4]
#: The pack length `score_samples` packs the scored rows into after the step.
SCORE_MAX_LEN = 54
LORA = dict(r=4, alpha=8.0, target_modules=["in_proj_qkv", "out_proj", "q_proj", "o_proj",
                                             "gate_proj", "down_proj"])


#: The case whose samples `TEMPERED_SAMPLES` carry per-token `temperatures` and
#: `inference_logprobs` (`_tempered_arrays`; every sample carries advantages).
TEMPERED = "policy_gradient_tempered"
TEMPERED_SAMPLES = ("B", "C")


def _objectives(dppo_delta: float) -> dict[str, list[LossTerm]]:
    """Every token-level case: name -> its terms (one, or several)."""
    ppo = dict(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    return {
        "weighted_ce": [LossTerm("weighted_ce")],
        "policy_gradient_token": [LossTerm("policy_gradient")],
        "policy_gradient_sequence": [LossTerm("policy_gradient", normalize="sequence")],
        "policy_gradient_constant": [LossTerm("policy_gradient", normalize="constant",
                                              normalize_constant=5 * 40.0)],
        "ppo_clip_kl_sequence": [LossTerm("ppo_clip", normalize="sequence", kl_coef=KL_COEF,
                                          **ppo)],
        "ppo_clip_dual_clip": [LossTerm("ppo_clip", clip_ratio_c=1.4, **ppo)],
        "policy_gradient_tis_token": [LossTerm("policy_gradient", mismatch="tis",
                                               mismatch_cap=1.5)],
        "policy_gradient_tis_sequence_sum": [LossTerm("policy_gradient", mismatch="tis",
                                                      mismatch_level="sequence",
                                                      mismatch_reduce="sum", mismatch_cap=2.0)],
        "ppo_clip_mis_token": [LossTerm("ppo_clip", mismatch="mis", mismatch_low=0.6,
                                        mismatch_high=1.6, **ppo)],
        "policy_gradient_mis_sequence_mean": [LossTerm(
            "policy_gradient", normalize="sequence", mismatch="mis", mismatch_level="sequence",
            mismatch_reduce="mean", mismatch_low=0.5, mismatch_high=2.0)],
        "dppo": [LossTerm("dppo", delta_low=dppo_delta, delta_high=dppo_delta, kl_tau=0.05)],
        "gspo": [LossTerm("gspo", normalize="sequence", clip_low=0.08, clip_high=0.08)],
        "cispo": [LossTerm("cispo", **ppo)],
        "opd": [LossTerm("opd")],
        "opd_importance": [LossTerm("opd", opd_form="importance")],
        "three_terms": [LossTerm("ppo_clip", **ppo),
                        LossTerm("ce", weights="sft_weights", coef=0.5),
                        LossTerm("opd", weights="distill_weights", normalize="sequence",
                                 coef=0.3)],
        TEMPERED: [LossTerm("policy_gradient")],
    }


PAIR_OBJECTIVES = {"dpo": LossTerm("dpo", beta=0.1), "ipo": LossTerm("ipo", beta=0.1),
                   "simpo": LossTerm("simpo", beta=2.0, gamma=0.5)}
#: What each case must cover (coverage counts of the reference that must be > 0).
COVERAGE = {
    "ppo_clip_kl_sequence": ("clip_low", "clip_high"),
    "ppo_clip_dual_clip": ("clip_low", "clip_high", "dual_clip"),
    "policy_gradient_tis_token": ("is_clamped", "is_unclamped"),
    "policy_gradient_tis_sequence_sum": ("is_clamped", "is_unclamped"),
    "ppo_clip_mis_token": ("is_masked_low", "is_masked_high", "is_kept", "clip_low",
                           "clip_high"),
    "policy_gradient_mis_sequence_mean": ("is_masked_low", "is_masked_high", "is_kept"),
    "dppo": ("dropped_low", "dropped_high", "kept"),
    "gspo": ("clip_low", "clip_high"),
    "cispo": ("clip_low", "clip_high"),
    "three_terms": ("clip_low", "clip_high"),
}


def _arrays(gen, model, sample, name):
    """Per-token arrays aligned with labels: weights, advantages, and old, inference, reference
    and teacher logprobs some way from the model's own (see OLD_BIAS and MISMATCH_BIAS)."""
    length = len(sample.labels)
    logp, _, positions = target_logprobs(model, sample)
    own = torch.zeros(length)
    own[positions] = logp.detach()
    old = own - (torch.rand(length, generator=gen) - 0.5) * 0.6 - OLD_BIAS[name]
    return {"loss_weights": torch.rand(length, generator=gen) * 2,
            "advantages": torch.randn(length, generator=gen),
            "old_logprobs": old,
            "inference_logprobs": old - (torch.rand(length, generator=gen) - 0.5) * 0.6
            - MISMATCH_BIAS[name],
            "ref_logprobs": own - (torch.rand(length, generator=gen) - 0.5) * 0.6,
            "teacher_logprobs": own + torch.randn(length, generator=gen) * 0.5,
            "sft_weights": (torch.rand(length, generator=gen) < 0.5).float(),
            "distill_weights": (torch.rand(length, generator=gen) < 0.6).float()
            * (0.5 + torch.rand(length, generator=gen))}


def _make_pair(gen, config, prompt_len, grids, chosen_len, rejected_len):
    """(chosen, rejected) RawSamples sharing one random prompt (with its images) and its pixels;
    every completion token is a target."""
    prompt = make_sample(gen, config, prompt_len, grids)
    halves = []
    for length in (chosen_len, rejected_len):
        completion = torch.randint(8, config.text_config.vocab_size, (length,), generator=gen)
        ids = torch.cat([prompt.input_ids, completion])
        labels = torch.cat([torch.full((prompt_len,), IGNORE_INDEX), completion])
        halves.append(RawSample(ids, labels, prompt.pixel_values, prompt.image_grid_thw))
    return tuple(halves)


def _as_sample(raw, model, arrays, source, pair=None, values=None) -> Sample:
    mm = mm_token_type_ids(raw, model.config)
    positions, _ = model.model.get_rope_index(raw.input_ids[None], mm[None],
                                              image_grid_thw=raw.image_grid_thw,
                                              video_grid_thw=raw.video_grid_thw)
    return Sample(input_ids=raw.input_ids.tolist(), labels=raw.labels.tolist(), image_paths=[],
                  pixel_values=raw.pixel_values, image_grid_thw=raw.image_grid_thw,
                  mm_token_type_ids=mm.long(), position_ids=positions[:, 0], source=source,
                  token_arrays=arrays, pair=pair, values=values or {},
                  pixel_values_videos=raw.pixel_values_videos, video_grid_thw=raw.video_grid_thw)


@functools.cache
def _setup(tmp_root):
    model = build_model(num_key_value_heads=2).eval()
    checkpoint = tmp_root / "objectives"
    model.save_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(7)
    raw = {name: make_sample(gen, model.config, length, grids, videos=videos)
           for name, (length, grids, videos) in SAMPLES.items()}
    pairs = {name: _make_pair(gen, model.config, *spec) for name, spec in PAIRS.items()}
    with torch.no_grad():
        arrays = {name: _arrays(gen, model, s, name) for name, s in raw.items()}
        reference = {}
        for name, halves in pairs.items():
            sums = [float(target_logprobs(model, half)[0].double().sum()) for half in halves]
            reference[name] = tuple(s + float(torch.randn((), generator=gen)) for s in sums)
        gaps = []
        for name, s in raw.items():
            logp, _, positions = target_logprobs(model, s)
            gaps.append((logp.exp() - arrays[name]["inference_logprobs"][positions].exp()).abs())
    objectives = _objectives(dppo_delta=float(torch.cat(gaps).median()))
    return model, checkpoint, raw, arrays, pairs, reference, objectives


@functools.cache
def _tempered_arrays(tmp_root):
    """Per sample: its advantages, and for `TEMPERED_SAMPLES` per-token temperatures in
    [0.5, 1.5] and inference logprobs a small random distance from the model's own at those
    temperatures, aligned with labels."""
    model, _, raw, arrays, *_ = _setup(tmp_root)
    gen = torch.Generator().manual_seed(11)
    tempered = {}
    with torch.no_grad():
        for name, sample in raw.items():
            tempered[name] = {"advantages": arrays[name]["advantages"]}
            if name in TEMPERED_SAMPLES:
                length = len(sample.labels)
                temperatures = 0.5 + torch.rand(length, generator=gen)
                logp, _, positions = target_logprobs(model, sample, temperatures)
                inference = torch.zeros(length)
                inference[positions] = logp + 0.05 * torch.randn(len(positions), generator=gen)
                tempered[name].update(temperatures=temperatures, inference_logprobs=inference)
    return tempered


def _case_arrays(name, tmp_root):
    """The per-token arrays of each sample in the token case `name`."""
    return _tempered_arrays(tmp_root) if name == TEMPERED else _setup(tmp_root)[3]


def _token_packs(layout, model, raw, arrays):
    return [[build_batch([_as_sample(raw[n], model, arrays[n], f"{n}.jsonl:1") for n in names])
             for names in rank_micro] for rank_micro in layout]


def _pair_rows(names, model, pairs, reference):
    """The pair samples of `names`, one row (chosen, rejected) per pair."""
    rows = []
    for name in names:
        halves = [_as_sample(half, model, {}, f"{name}.jsonl:1", role, {REF_LOGP: ref})
                  for half, role, ref in zip(pairs[name], ("chosen", "rejected"), reference[name])]
        rows.append(halves)
    return rows


def _pair_packs(layout, model, pairs, reference):
    return [[build_batch([s for row in _pair_rows(names, model, pairs, reference) for s in row])
             for names in rank_micro] for rank_micro in layout]


def _with_degrees(packs, degrees, repeats=()):
    """`packs` (per rank, per micro-batch) with `degrees` (per micro-batch) set on each rank's
    micro-batches, and the packs at `repeats` ((rank, micro-batch)) as (pack, 0.0): repeats at
    weight 0 (tests/helpers/sp_cases.engine_step)."""
    for rank_packs in packs:
        for batch, degree in zip(rank_packs, degrees, strict=True):
            batch.sp_degree = degree
    for rank, micro in repeats:
        packs[rank][micro] = (packs[rank][micro], 0.0)
    return packs


def _once_per_step(layout, degrees, repeats=()):
    """The names of a per-rank `layout`'s step, each pack counted once: a spread micro-batch's
    (listed alike on every rank) once, each degree-1 pack of weight 1 once."""
    names = []
    for micro, degree in enumerate(degrees):
        if degree is None:
            assert all(rank_micro[micro] == layout[0][micro] for rank_micro in layout)
            names += layout[0][micro]
        else:
            names += [n for rank, rank_micro in enumerate(layout)
                      if (rank, micro) not in repeats for n in rank_micro[micro]]
    return names


@functools.cache
def _results(sp, tmp_root):
    model, checkpoint, raw, arrays, pairs, reference, objectives = _setup(tmp_root)
    world, sp_size, accum, layout, pair_layout = LAYOUTS[sp]
    tempered = _tempered_arrays(tmp_root)
    packs = _token_packs(layout, model, raw, arrays)
    tempered_packs = _token_packs(layout, model, raw, tempered)
    pair_packs = _pair_packs(pair_layout, model, pairs, reference)
    if sp in DYNAMIC_DEGREES:
        degrees, pair_degrees = DYNAMIC_DEGREES[sp]
        # every sample and every pair once in the step
        assert sorted(_once_per_step(layout, degrees)) == sorted(SAMPLES)
        assert sorted(_once_per_step(pair_layout, pair_degrees, PAIR_REPEATS[sp])) == sorted(PAIRS)
        packs, tempered_packs = (_with_degrees(p, degrees) for p in (packs, tempered_packs))
        pair_packs = _with_degrees(pair_packs, pair_degrees, PAIR_REPEATS[sp])
    order = [n for rank_micro in layout for names in rank_micro for n in names]
    pair_order = [n for rank_micro in pair_layout for names in rank_micro for n in names]
    if sp in DYNAMIC_DEGREES:
        # the rows scored after the step: each sample (pair) once, in the step's order
        order = _once_per_step(layout, DYNAMIC_DEGREES[sp][0])
        pair_order = _once_per_step(pair_layout, DYNAMIC_DEGREES[sp][1], PAIR_REPEATS[sp])
    runs = {name: (Loss(tuple(terms)), tempered_packs if name == TEMPERED else packs)
            for name, terms in objectives.items()}
    runs.update({name: (Loss((term,)), pair_packs) for name, term in PAIR_OBJECTIVES.items()})
    base = dict(checkpoint=str(checkpoint), stage=STAGES[sp], mode="state", grad_accum=accum,
                loss_chunk_mb=CHUNK_MB[sp], score_max_len=SCORE_MAX_LEN)
    score_rows = {name: [[_as_sample(raw[n], model, case_arrays[n], f"{n}.jsonl:1")]
                         for n in order]
                  for name, case_arrays in (("weighted_ce", arrays), (TEMPERED, tempered))}
    score_rows["dpo"] = _pair_rows(pair_order, model, pairs, reference)
    if sp in DYNAMIC_DEGREES:
        cases = {"objectives": dict(base, runs=runs, per_rank=True, scores=score_rows,
                                    score_dynamic=True)}
        return order, pair_order, run_ranks(engine_step, world, sp_size, cases)
    cases = {"objectives": dict(base, runs=runs, scores=score_rows)}
    if sp == 2:
        cases["lora"] = dict(base, lora=LORA, runs={"dpo": (Loss((PAIR_OBJECTIVES["dpo"],)),
                                                            pair_packs)})
    return order, pair_order, run_ranks(engine_step, world, sp_size, cases)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("objective_parity")


class _References:
    """A reference in fp32, and in float64 (float64_truth) only when a comparison needs it."""

    def __init__(self, reference, model, *args, adapt=lambda ref: ref):
        self._compute = lambda m: adapt(reference(m, *args))
        self._model = model
        self.fp32 = self._compute(model)
        self._truth = None

    @property
    def truth(self):
        if self._truth is None:
            with float64_truth():
                self._truth = self._compute(copy.deepcopy(self._model).double())
        return self._truth


@functools.cache
def _token_references(name, tmp_root):
    model, _, raw, _, _, _, objectives = _setup(tmp_root)
    arrays = _case_arrays(name, tmp_root)
    names = list(SAMPLES)
    return _References(reference_step, model, [raw[n] for n in names],
                       [arrays[n] for n in names], objectives[name])


def _scale(key: str, ref: Reference) -> float:
    """The magnitude a metric's rounding scales with: its own, or for a difference of two nearly
    equal values (a reward beta * (logp - ref), a margin of two rewards, the mean of mu - logp)
    its operands'."""
    stats = ref.stats
    if key in ref.scales:
        return ref.scales[key]
    if key == "rewards/margins":
        return abs(stats["rewards/chosen"]) + abs(stats["rewards/rejected"])
    return abs(stats[key])


def _assert_step_close(result, refs, expected_keys):
    """`result` within TOL of plain transformers in fp32; where not (two fp32 computations that
    round differently), within TOL of the float64 reference plus fp32's own distance from it."""
    fp32 = refs.fp32

    def check(got, pick, scale, what):
        """got: vlmcp's value; pick(ref): the reference's; scale(ref): its magnitude."""
        if _abs_err(got, pick(fp32)) <= TOL * scale(fp32):
            return
        truth = refs.truth
        allowed = TOL * scale(truth) + _abs_err(pick(fp32), pick(truth))
        assert _abs_err(got, pick(truth)) <= allowed, what

    check(result["loss"], lambda r: r.loss, lambda r: abs(r.loss), "loss")
    assert set(result["stats"]) == set(fp32.stats)
    for key in fp32.stats:
        check(result["stats"][key], lambda r: r.stats[key],
              lambda r: _scale(key, r) + 1e-12 / TOL, key)
    grads = result["grads"]
    assert grads.keys() == expected_keys
    for pname, grad in grads.items():
        check(grad, lambda r: r.grads[pname], lambda r: float(r.grads[pname].norm()), pname)


def _abs_err(a, b) -> float:
    """|a - b| of numbers, the norm of the difference of tensors (in float64)."""
    if isinstance(a, torch.Tensor):
        return float((a.double() - b.double()).norm())
    return abs(a - b)


@pytest.mark.parametrize("name", list(_objectives(0.0)))
@pytest.mark.parametrize("sp", [1, 2, 4, DYNAMIC, DYNAMIC_4])
def test_token_objective_step_equals_plain_transformers_per_sample(sp, name, tmp_root):
    refs = _token_references(name, tmp_root)
    for side in COVERAGE.get(name, ()):
        assert refs.fp32.coverage[side] > 0, (side, dict(refs.fp32.coverage))
    raw = _setup(tmp_root)[2]
    carriers = TEMPERED_SAMPLES if name == TEMPERED else list(SAMPLES)
    assert refs.fp32.stats["mismatch_targets"] == sum(
        int((raw[n].labels[1:] != IGNORE_INDEX).sum()) for n in carriers)
    _, _, per_rank = _results(sp, tmp_root)
    trained = {n for n in refs.fp32.grads if not n.startswith("model.visual")}
    for result in per_rank:
        _assert_step_close(result[f"objectives/{name}"], refs, trained)


@pytest.mark.parametrize("name", list(PAIR_OBJECTIVES))
@pytest.mark.parametrize("sp", [1, 2, 4, DYNAMIC, DYNAMIC_4])
def test_pair_objective_step_equals_plain_transformers_per_half(sp, name, tmp_root):
    refs = _pair_references(name, False, tmp_root)
    _, _, per_rank = _results(sp, tmp_root)
    trained = {n for n in refs.fp32.grads if not n.startswith("model.visual")}
    for result in per_rank:
        _assert_step_close(result[f"objectives/{name}"], refs, trained)


@functools.cache
def _pair_references(name, lora, tmp_root):
    """The fp32 and float64 references of a pair objective (`lora`: on PEFT adapters)."""
    from peft import LoraConfig, get_peft_model

    model, _, _, _, pairs, reference, _ = _setup(tmp_root)
    if lora:
        model = get_peft_model(copy.deepcopy(model), LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"]))
        seed_adapter_weights(model)
    names = list(PAIRS)

    def unprefixed(ref):
        ref.grads = {n.removeprefix("base_model.model."): g for n, g in ref.grads.items()}
        return ref

    return _References(reference_pairs, model, [pairs[n] for n in names],
                       [reference[n] for n in names], PAIR_OBJECTIVES[name], adapt=unprefixed)


def test_lora_dpo_step_equals_peft_on_plain_transformers(tmp_root):
    refs = _pair_references("dpo", True, tmp_root)
    _, _, per_rank = _results(2, tmp_root)
    adapters = set(refs.fp32.grads)
    assert adapters and all("lora_" in n for n in adapters)
    for result in per_rank:
        _assert_step_close(result["lora/dpo"], refs, adapters)


def test_pair_halves_on_different_sp_ranks_share_one_image_encoding(tmp_root):
    _, _, per_rank = _results(2, tmp_root)
    calls = [result["objectives/dpo"]["tower_calls"] for result in per_rank]
    # the step's micro-batch 1 is pair P alone (its prompt image, encoded by rank 0 for both
    # halves), micro-batch 2 holds Q, R and S (R's image); scoring then packs [P, Q] and [R, S]:
    # each pack encodes its one image once, on one rank
    encoded = [grids for rank_calls in calls for grids, blank in rank_calls if not blank]
    assert sorted(encoded) == [[(1, 2, 4)], [(1, 2, 4)], [(1, 4, 4)], [(1, 4, 4)]]


@pytest.mark.parametrize("sp", [1, 2, 4, DYNAMIC, DYNAMIC_4])
def test_score_logprobs_and_pair_sums_equal_plain_transformers(sp, tmp_root):
    model, _, raw, _, pairs, _, _ = _setup(tmp_root)
    order, pair_order, per_rank = _results(sp, tmp_root)
    if sp in DYNAMIC_DEGREES:
        # scored on training's degree plan: short packs whole on one rank beside a spread one
        slots = dynamic_slots([len(raw[n].input_ids) for n in order], SCORE_MAX_LEN, LAYOUTS[sp][1])
        assert {slot.degree for slot in slots} == {None, 1}
    records = per_rank[0]["objectives/weighted_ce"]["scores"]
    assert [r["index"] for r in records] == list(range(len(order)))
    assert all(not r["objectives/weighted_ce"]["scores"] for r in per_rank[1:])
    with torch.no_grad():
        for record, name in zip(records, order):
            logp, entropy, _ = target_logprobs(model, raw[name])
            assert rel_err(torch.tensor(record["logprobs"], dtype=torch.float64),
                           logp.double()) <= TOL
            assert rel_err(torch.tensor(record["entropy"], dtype=torch.float64),
                           entropy.double()) <= TOL
            assert abs(record["logprob_sum"] - float(logp.double().sum())) \
                <= TOL * abs(float(logp.sum()))
        pair_records = per_rank[0]["objectives/dpo"]["scores"]
        assert [r["index"] for r in pair_records] == list(range(len(pair_order)))
        for record, name in zip(pair_records, pair_order):
            for half, key in zip(pairs[name], ("chosen", "rejected")):
                total = float(target_logprobs(model, half)[0].double().sum())
                assert abs(record[key]["logprob_sum"] - total) <= TOL * abs(total)


@pytest.mark.parametrize("sp", [1, 2, 4, DYNAMIC, DYNAMIC_4])
def test_score_logprobs_at_per_token_temperatures_equal_plain_transformers(sp, tmp_root):
    model, _, raw, *_ = _setup(tmp_root)
    tempered = _tempered_arrays(tmp_root)
    order, _, per_rank = _results(sp, tmp_root)
    records = per_rank[0][f"objectives/{TEMPERED}"]["scores"]
    assert [r["index"] for r in records] == list(range(len(order)))
    assert all(not r[f"objectives/{TEMPERED}"]["scores"] for r in per_rank[1:])
    with torch.no_grad():
        for record, name in zip(records, order):
            logp, entropy, _ = target_logprobs(model, raw[name],
                                               tempered[name].get("temperatures"))
            assert rel_err(torch.tensor(record["logprobs"], dtype=torch.float64),
                           logp.double()) <= TOL
            assert rel_err(torch.tensor(record["entropy"], dtype=torch.float64),
                           entropy.double()) <= TOL
