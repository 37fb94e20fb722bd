"""One SGD step of `vlmcp train` under torchrun equals a step on plain-transformers gradients.

The reference never touches vlmcp's model code: an untouched `Qwen3_5ForConditionalGeneration`
forwards every sample of the step alone, the loss is sum(CE of all targets) / N, i.e.
sum_i mean_loss_i * n_i / N, and w_ref = w0 - lr * grad, with grad computed in float64
(`float64_reference`) and again in fp32. The exported OUTPUT_DIR/final weights must match it per
tensor: |update - (-lr * grad)| <= a * |lr * grad| + the fp32 rounding of storing w0 + update (a
large lr keeps that rounding small against the update), where a = `fp32_allowance`: 1e-5, or
more where the fp32 reference's own distance from float64 calls for it. A frozen vision
tower must not move; a trainable one must take the reference step too. The MoE case trains the
router load-balancing loss as well: its reference adds router_aux_loss_coef x the mean over the
step's packs of transformers' aux loss for each pack's samples batched with an attention mask.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, train_losses, write_job
from tests.helpers.parity import (RawSample, assert_within_fp32_error, float64_reference, fp32_allowance,
                                  make_lively, plain_sample_loss)
from tests.helpers.router_reference import reference_router_aux_and_grads
from vlmcp.data.dataset import load_samples
from vlmcp.data.pack import PackedDataset, build_batch, first_fit
from vlmcp.data.processor import load_processor
from vlmcp.model.flops import Trains, batch_flops
from vlmcp.model.load import load_config
from vlmcp.model.tiny import build_tiny_checkpoint

pytestmark = pytest.mark.e2e

LR = 1000.0
WORLD = 2
#: Storing w0 + update in fp32 rounds each element by up to half an ulp of the weight; allow a
#: few ulps of |w0| on top of the 1e-5 relative tolerance of the update itself.
ROUNDING = 4 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def lively_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose DeltaNet gates decay moderately (A_log in [-1, 1]) and whose conv
    taps are large, so that every gradient is far from zero (with the default init the decay
    saturates and some A_log gradients are pure cancellation noise)."""
    return make_lively(build_tiny_checkpoint(tmp_path_factory.mktemp("lively"), seed=0))


@pytest.fixture(scope="module")
def lively_moe_checkpoint(tmp_path_factory):
    """The same for the MoE model, with router_aux_loss_coef raised so that the router loss matters."""
    return make_lively(build_tiny_checkpoint(tmp_path_factory.mktemp("lively_moe"), moe=True, seed=0,
                                         router_aux_loss_coef=0.5))


def _mixed_jsonl(digits_dir, out_path):
    """Digit samples (one image), a two-image sample and a text-only sample, one JSONL."""
    lines = (digits_dir / "train.jsonl").read_text().splitlines()[:7]
    records = [json.loads(line) for line in lines]
    for record in records:
        record["images"] = [str(digits_dir / p) for p in record["images"]]
    two = records[0]["images"] + records[1]["images"]
    records.append({"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "Which digits are these?"}]},
        {"role": "assistant", "content": "The answer is 0 1"}], "images": two})
    records.append({"conversations": [{"from": "human", "value": "Describe the picture."},
                                      {"from": "gpt", "value": "It shows a handwritten number."}]})
    out_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out_path


def _seq_len_for(lengths, packs):
    """The smallest max_seq_len whose first-fit packing gives exactly `packs` packs."""
    for max_len in range(max(lengths), sum(lengths) + 1):
        if len(first_fit(lengths, max_len)) == packs:
            return max_len
    raise AssertionError(f"no max_seq_len packs {lengths} into {packs}")


def _reference_updates(checkpoint, samples, router_packs=None):
    """`_reference_update` of the checkpoint's plain transformers model in fp32 and in float64."""
    cls = Qwen3_5ForConditionalGeneration if router_packs is None else Qwen3_5MoeForConditionalGeneration
    model = cls.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="sdpa")
    return (_reference_update(model, samples, router_packs),
            float64_reference(_reference_update, model, samples, router_packs))


def _reference_update(model, samples, router_packs=None):
    """-LR * d(sum CE / N)/dw of plain transformers, each sample forwarded alone; with
    `router_packs` (the step's packs, lists of sample indices), plus the router aux term."""
    router_grads = {}
    if router_packs is not None:
        raw = [RawSample(torch.tensor(s.input_ids), torch.tensor(s.labels), s.pixel_values, s.image_grid_thw)
               for s in samples]
        _, router_grads = reference_router_aux_and_grads(model, [[raw[i] for i in pack] for pack in router_packs])
    n_total = sum(sum(label != -100 for label in s.labels[1:]) for s in samples)
    for s in samples:
        loss, n = plain_sample_loss(model, s)
        (loss * n / n_total).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for name, grad in router_grads.items():
        grads[name] = grads[name] + grad if name in grads else grad
    return {name: -LR * grad for name, grad in grads.items()}


@pytest.mark.parametrize("sp_size,grad_accum,freeze_vision,moe_router", [(1, 2, True, False), (2, 2, True, False),
                                                                         (2, 1, False, False), (2, 2, True, True)])
def test_one_sgd_step_under_torchrun_matches_plain_transformers(
        sp_size, grad_accum, freeze_vision, moe_router, lively_checkpoint, lively_moe_checkpoint, digits_jsonl,
        tmp_path):
    checkpoint = lively_moe_checkpoint if moe_router else lively_checkpoint
    data = _mixed_jsonl(digits_jsonl, tmp_path / "mixed.jsonl")
    processor = load_processor(checkpoint)
    samples = load_samples(data, processor, max_seq_len=10_000)
    dp_size = WORLD // sp_size
    max_seq_len = _seq_len_for([len(s) for s in samples], dp_size * grad_accum)
    step_packs = []
    for dp_rank in range(dp_size):
        dataset = PackedDataset([len(s) for s in samples], max_seq_len, dp_rank=dp_rank, dp_size=dp_size,
                                multiple_of=grad_accum)
        step_packs += dataset.rank_packs(0)[:grad_accum]
    step_samples = [i for pack in step_packs for i in pack]
    assert sorted(step_samples) == list(range(len(samples))), "the step must see every sample once"

    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", tiny_job(
        checkpoint, data, out,
        model={"freeze_vision": freeze_vision, "router_aux_loss": moe_router},
        data={"max_seq_len": max_seq_len},
        parallel={"sp_size": sp_size},
        optimizer={"type": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
        train={"max_steps": 1, "grad_accum": grad_accum, "grad_clip": 0.0}))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=WORLD))

    # Loaded, not read from the file: a MoE checkpoint stores its experts one by one.
    cls = Qwen3_5MoeForConditionalGeneration if moe_router else Qwen3_5ForConditionalGeneration
    before = cls.from_pretrained(str(checkpoint), dtype=torch.float32).state_dict()
    after = cls.from_pretrained(str(out / "final"), dtype=torch.float32).state_dict()
    reference, truth = _reference_updates(checkpoint, samples, step_packs if moe_router else None)
    assert set(after) == set(before)
    frozen = "model.visual." if freeze_vision else None
    trained = [k for k in before if not (frozen and k.startswith(frozen))]
    assert set(trained) <= set(reference)
    for key, w0 in before.items():
        update = after[key] - w0
        if frozen and key.startswith(frozen):
            assert torch.equal(update, torch.zeros_like(update)), f"frozen {key} moved"
            continue
        ref, exact = reference[key], truth[key]
        error = float((update - exact).norm())
        allowed = fp32_allowance(ref, exact, at_least=1e-5) * float(exact.norm()) + ROUNDING * float(w0.norm())
        assert error <= allowed, f"{key}: |update - ref| = {error:.3e} > {allowed:.3e}"
    assert len(train_losses(out)) == 1
    _assert_row_counts_the_step_flops(out, checkpoint, samples, step_packs, freeze_vision)


@pytest.mark.parametrize("zero_stage,freeze_vision,short_slot,moe_router",
                         [(2, True, False, False), (3, False, False, False), (2, True, True, True)])
def test_one_sgd_step_at_per_micro_batch_sp_degree_matches_plain_transformers(
        zero_stage, freeze_vision, short_slot, moe_router, lively_checkpoint, lively_moe_checkpoint,
        digits_jsonl, tmp_path):
    """parallel.sp_dynamic at SP 2, world 2: the step's short packs (images, a text-only one) run
    whole, one per rank, its long two-image pack spread over both ranks; the weights take the
    reference step, and the row counts every pack once at its degree. With `short_slot` one
    degree-1 slot holds a single pack (rank 1 repeats it at weight 0), on the MoE model with the
    router load-balancing loss (a mean over the step's packs)."""
    checkpoint = lively_moe_checkpoint if moe_router else lively_checkpoint
    data = _mixed_jsonl(digits_jsonl, tmp_path / "mixed.jsonl")
    if short_slot:
        data.write_text("".join(data.read_text().splitlines(keepends=True)[1:]))
    samples = load_samples(data, load_processor(checkpoint), max_seq_len=10_000)
    lengths = [len(s) for s in samples]
    max_seq_len = 2 * (max(lengths) - 1)  # the longest sample alone exceeds one rank's budget
    dataset = PackedDataset(lengths, max_seq_len, sp_size=2, sp_dynamic=True)
    slots = dataset.slots(0)
    step_packs = [list(pack) for slot in slots for pack in slot.packs]
    assert sorted(i for pack in step_packs for i in pack) == list(range(len(samples)))
    assert {slot.degree for slot in slots} == {None, 1}
    assert [len(slot.packs) for slot in slots if slot.degree == 1].count(1) == int(short_slot)

    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", tiny_job(
        checkpoint, data, out,
        model={"freeze_vision": freeze_vision, "router_aux_loss": moe_router},
        data={"max_seq_len": max_seq_len},
        parallel={"sp_size": 2, "sp_dynamic": True},
        optimizer={"type": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
        deepspeed={"zero_optimization": {"stage": zero_stage}},
        train={"max_steps": 1, "grad_accum": len(slots), "grad_clip": 0.0}))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=WORLD))

    cls = Qwen3_5MoeForConditionalGeneration if moe_router else Qwen3_5ForConditionalGeneration
    before = cls.from_pretrained(str(checkpoint), dtype=torch.float32).state_dict()
    after = cls.from_pretrained(str(out / "final"), dtype=torch.float32).state_dict()
    reference, truth = _reference_updates(checkpoint, samples, step_packs if moe_router else None)
    for key, w0 in before.items():
        update = after[key] - w0
        if freeze_vision and key.startswith("model.visual."):
            assert torch.equal(update, torch.zeros_like(update)), f"frozen {key} moved"
            continue
        ref, exact = reference[key], truth[key]
        error = float((update - exact).norm())
        allowed = fp32_allowance(ref, exact, at_least=1e-5) * float(exact.norm()) + ROUNDING * float(w0.norm())
        assert error <= allowed, f"{key}: |update - ref| = {error:.3e} > {allowed:.3e}"
    _assert_row_counts_the_step_flops(out, checkpoint, samples, step_packs, freeze_vision)
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    spread = [pack for slot in slots if slot.degree is None for pack in slot.packs]
    whole = [pack for slot in slots if slot.degree == 1 for pack in slot.packs]
    assert row["sp_degree_packs"] == {"1": len(whole), "2": len(spread)}
    assert row["sp_degree_tokens"] == {"1": sum(lengths[i] for pack in whole for i in pack),
                                       "2": sum(lengths[i] for pack in spread for i in pack)}
    assert row["tokens"] == sum(lengths)


def _assert_row_counts_the_step_flops(out, checkpoint, samples, step_packs, freeze_vision):
    """The training row's model FLOPs are the formula's over every pack of the step (each DP
    group's packs once), its tflops_per_s per device, and its mfu against a measured CPU peak."""
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    config = load_config(checkpoint)
    flops = sum(batch_flops(config, build_batch([samples[i] for i in pack]),
                            Trains(vision=not freeze_vision)).total for pack in step_packs)
    assert row["model_tflops"] == pytest.approx(flops / 1e12, rel=1e-12)
    assert row["tflops_per_s"] == pytest.approx(flops / 1e12 / row["step_time_s"] / WORLD, rel=1e-6)
    assert row["mfu"] > 0


def _tokens_jsonl_with_advantages(samples, out_path, seed=0):
    """The samples as tokens-format lines with random per-token advantages (null off target)."""
    generator = torch.Generator().manual_seed(seed)
    lines = []
    for s in samples:
        values = torch.randn(len(s.labels), generator=generator).tolist()
        lines.append({"input_ids": s.input_ids, "labels": s.labels, "images": s.image_paths,
                      "advantages": [None if label == -100 else v
                                     for label, v in zip(s.labels, values)]})
    out_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out_path


def _reference_policy_gradient_update(model, samples):
    """(loss, -LR * d/dw) of the step's sequence-normalised policy-gradient loss, plain
    transformers, each sample alone: mean over samples of (sum over targets of -A_t log pi(y_t)) /
    targets."""
    total = 0.0
    for s in samples:
        kwargs = {}
        if s.pixel_values is not None:
            kwargs = {"pixel_values": s.pixel_values, "image_grid_thw": s.image_grid_thw}
        logits = model(input_ids=torch.tensor([s.input_ids]), mm_token_type_ids=s.mm_token_type_ids[None],
                       use_cache=False, **kwargs).logits[0]
        positions = [t for t in range(1, len(s.labels)) if s.labels[t] != -100]
        logp = torch.log_softmax(logits[[t - 1 for t in positions]], dim=-1)
        logp = logp.gather(1, torch.tensor([s.labels[t] for t in positions])[:, None])[:, 0]
        loss = -(s.token_arrays["advantages"][positions] * logp).sum() / len(positions) / len(samples)
        loss.backward()
        total += float(loss.detach())
    return total, {name: -LR * p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_policy_gradient_sgd_step_with_sequence_normalisation_matches_plain_transformers(
        lively_checkpoint, digits_jsonl, tmp_path):
    """`vlmcp train` with loss.type policy_gradient, normalize sequence, SP 2, 2 accumulation
    steps: the exported weights and the logged loss equal plain transformers' step."""
    checkpoint = lively_checkpoint
    processor = load_processor(checkpoint)
    chat = load_samples(_mixed_jsonl(digits_jsonl, tmp_path / "mixed.jsonl"), processor, max_seq_len=10_000)
    data = _tokens_jsonl_with_advantages(chat, tmp_path / "pg.jsonl")
    samples = load_samples(data, processor, max_seq_len=10_000)
    max_seq_len = _seq_len_for([len(s) for s in samples], 2)
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", tiny_job(
        checkpoint, data, out, data={"max_seq_len": max_seq_len}, parallel={"sp_size": 2},
        loss={"type": "policy_gradient", "normalize": "sequence"},
        optimizer={"type": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
        train={"max_steps": 1, "grad_accum": 2, "grad_clip": 0.0}))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=WORLD))

    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="sdpa")
    ref_loss, reference = _reference_policy_gradient_update(model, samples)
    truth_loss, truth = float64_reference(_reference_policy_gradient_update, model, samples)
    _assert_language_update_is_exact(checkpoint, out, reference, truth)
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_within_fp32_error(row["loss"], ref_loss, truth_loss, at_least=1e-5, name="loss")
    assert row["entropy"] > 0 and "clip_fraction" not in row


def _assert_language_update_is_exact(checkpoint, out, reference, truth):
    """OUTPUT_DIR/final minus the checkpoint, per language-model weight, within fp32's allowance
    of the float64 update `truth` (`reference`: the same update in fp32), plus the rounding of
    adding it to the weight."""
    before = load_file(checkpoint / "model.safetensors")
    after = Qwen3_5ForConditionalGeneration.from_pretrained(str(out / "final"),
                                                            dtype=torch.float32).state_dict()
    for key, w0 in before.items():
        if key.startswith("model.visual."):
            continue
        update, ref, exact = after[key] - w0, reference[key], truth[key]
        error = float((update - exact).norm())
        allowed = fp32_allowance(ref, exact, at_least=1e-5) * float(exact.norm()) + ROUNDING * float(w0.norm())
        assert error <= allowed, f"{key}: |update - exact| = {error:.3e} > {allowed:.3e}"


def _digit_pairs_jsonl(digits_dir, out_path, count=4):
    """TRL conversational pairs of the digits prompts: chosen the right digit, rejected the next
    one (image paths absolute)."""
    lines = []
    for line in (digits_dir / "train.jsonl").read_text().splitlines()[:count]:
        record = json.loads(line)
        user, answer = record["messages"]
        wrong = str((int(answer["content"]) + 1) % 10)
        lines.append({"prompt": [user], "chosen": [answer],
                      "rejected": [{"role": "assistant", "content": wrong}],
                      "images": [str(digits_dir / p) for p in record["images"]]})
    out_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out_path


def _reference_dpo_update(model, halves, beta):
    """-LR * d/dw of the mean DPO loss over the pairs, plain transformers, each half alone, with
    the reference sums of the initial policy itself (the same weights), and those sums."""
    pairs = len(halves) // 2
    total, sums = 0.0, []
    for chosen, rejected in zip(halves[::2], halves[1::2]):
        logps = []
        for s in (chosen, rejected):
            loss, n = plain_sample_loss(model, s)
            logps.append(-loss * n)
        sums.append([float(x.detach()) for x in logps])
        h = beta * ((logps[0] - logps[0].detach()) - (logps[1] - logps[1].detach()))
        loss = -torch.nn.functional.logsigmoid(h) / pairs
        loss.backward()
        total += float(loss.detach())
    return total, sums, {name: -LR * p.grad for name, p in model.named_parameters()
                         if p.grad is not None}


def test_dpo_sgd_step_on_trl_pairs_with_initial_reference_matches_plain_transformers(
        lively_checkpoint, digits_jsonl, tmp_path):
    """`vlmcp train` with loss.type dpo and reference_logps "initial" on TRL pairs with images,
    SP 2, 2 accumulation steps: the run scores its initial policy (OUTPUT_DIR/reference_logps.jsonl
    equals plain transformers' sums), then its exported weights and the logged loss and TRL
    metrics equal plain transformers' step, each half forwarded alone."""
    checkpoint = lively_checkpoint
    processor = load_processor(checkpoint)
    data = _digit_pairs_jsonl(digits_jsonl, tmp_path / "pairs.jsonl")
    halves = load_samples(data, processor, max_seq_len=10_000)
    lengths = [len(c) + len(r) for c, r in zip(halves[::2], halves[1::2])]
    out = tmp_path / "out"
    beta = 0.5
    job = write_job(tmp_path / "job.json", tiny_job(
        checkpoint, data, out, data={"max_seq_len": _seq_len_for(lengths, 2)},
        parallel={"sp_size": 2}, loss={"type": "dpo", "beta": beta, "reference_logps": "initial"},
        optimizer={"type": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
        train={"max_steps": 1, "grad_accum": 2, "grad_clip": 0.0}))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=WORLD))

    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="sdpa")
    ref_loss, ref_sums, reference = _reference_dpo_update(model, halves, beta)
    truth_loss, truth_sums, truth = float64_reference(_reference_dpo_update, model, halves, beta)
    scored = [json.loads(line) for line in (out / "reference_logps.jsonl").read_text().splitlines()]
    assert [r["index"] for r in scored] == list(range(len(lengths)))
    for record, sums32, sums64 in zip(scored, ref_sums, truth_sums, strict=True):
        for half, ref32, ref64 in zip(("chosen", "rejected"), sums32, sums64, strict=True):
            assert_within_fp32_error(record[half]["logprob_sum"], ref32, ref64, at_least=1e-5,
                                     name=f"{half} reference sum")
    _assert_language_update_is_exact(checkpoint, out, reference, truth)
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_within_fp32_error(row["loss"], ref_loss, truth_loss, at_least=1e-5, name="loss")
    assert abs(row["rewards/margins"]) < 1e-4 and row["logps/chosen"] < 0
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies"} <= set(row)
