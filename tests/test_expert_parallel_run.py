"""`vlmcp train` under expert parallelism (`parallel.ep_size` 2 on the SP group of `parallel.sp_size`
2, world 2, the tiny MoE model, AdamW):
the run trains as the same job without EP does (losses and final weights to fp32 rounding),
SIGTERM then resume at the same E is bit-exact, the final model, every published step and
`vlmcp export` of a checkpoint are Hugging Face models with every expert, written by the ranks
that hold them (each shard holds its writer's experts only), at ZeRO 2 and at ZeRO 3; a resume at
another E validates and says it loads the universal checkpoint (tests/test_resume_layouts.py trains
such resumes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from tests.helpers.launching import (assert_ok, run_vlmcp, tiny_job, train_losses,
                                     stop_by_sigterm_then_resume, write_job)
from vlmcp.cli import main

pytestmark = pytest.mark.e2e

STEPS = 4


def _job(checkpoint: Path, digits: Path, out: Path, *, ep: int = 2, zero: int = 2) -> dict:
    return tiny_job(checkpoint, digits / "train.jsonl", out, parallel={"sp_size": 2, "ep_size": ep},
                    data={"max_seq_len": 64, "shuffle": True},
                    deepspeed={"zero_optimization": {"stage": zero}},
                    publish={"dir": str(out / "weights"), "every": 2},
                    train={"max_steps": STEPS, "save_every": 2, "seed": 3, "grad_accum": 2})


def _train(job: dict, path: Path, *extra: str) -> Path:
    assert_ok(run_vlmcp(["train", str(write_job(path, job)), *extra], launcher="torchrun", nproc=2))
    return Path(job["output_dir"])


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's state dict as transformers loads it (per-expert or fused files alike)."""
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict()


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _experts_per_shard(model_dir: Path) -> list[set[int]]:
    """The expert ids each weights file of a sharded model directory holds, in file order."""
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return [{int(k.split(".experts.")[1].split(".")[0]) for k, f in weight_map.items()
             if f == name and ".experts." in k} for name in sorted(set(weight_map.values()))]


@pytest.fixture(scope="module")
def ep_run(tiny_moe_checkpoint, digits_jsonl, tmp_path_factory) -> Path:
    """The job at SP 2 and EP 2, ZeRO 2, four steps straight."""
    root = tmp_path_factory.mktemp("ep_run")
    return _train(_job(tiny_moe_checkpoint, digits_jsonl, root / "out"), root / "job.json")


def test_an_ep_run_trains_as_without_ep_and_writes_every_expert_from_the_rank_holding_it(
        ep_run, tiny_moe_checkpoint, digits_jsonl, tmp_path):
    plain = _train(_job(tiny_moe_checkpoint, digits_jsonl, tmp_path / "plain", ep=1),
                   tmp_path / "plain.json")
    assert train_losses(ep_run) == pytest.approx(train_losses(plain), rel=1e-5)
    final, reference = _weights(ep_run / "final"), _weights(plain / "final")
    assert final.keys() == reference.keys()
    for key, value in final.items():
        torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-5, msg=key)
    # rank 0 holds experts 0 and 1, rank 1 experts 2 and 3: each writes its own
    assert _experts_per_shard(ep_run / "final") == [{0, 1}, {2, 3}]
    _assert_equal(_weights(ep_run / "weights" / f"step_{STEPS}"), final)
    exported = tmp_path / "exported"
    assert_ok(run_vlmcp(["export", str(ep_run.parent / "job.json"), "--tag", f"step{STEPS}",
                         "--out", str(exported)]))
    _assert_equal(_weights(exported), final)


def test_sigterm_then_resume_at_the_same_ep_size_is_bit_exact(
        ep_run, tiny_moe_checkpoint, digits_jsonl, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.json", _job(tiny_moe_checkpoint, digits_jsonl, out))
    stop_by_sigterm_then_resume(job, out, tmp_path / "log")
    assert train_losses(out) == train_losses(ep_run)
    _assert_equal(_weights(out / "final"), _weights(ep_run / "final"))


def test_a_resume_at_another_ep_size_validates_and_says_it_loads_the_universal_checkpoint(
        ep_run, capsys):
    job = ep_run.parent / "job.json"
    assert main(["validate", str(job), "--world-size", "2", "--set", "train.resume=true",
                 "--set", "parallel.ep_size=1"]) == 0
    out = capsys.readouterr().out
    assert "EP 2, ZeRO 2, fp32) at world 2, SP 2, DP 1, EP 1, ZeRO 2, fp32, through " \
        "DeepSpeed's universal checkpoint" in out, out


def test_at_zero3_the_final_model_published_steps_and_export_hold_every_expert_and_match_zero2(
        ep_run, tiny_moe_checkpoint, digits_jsonl, tmp_path):
    out = _train(_job(tiny_moe_checkpoint, digits_jsonl, tmp_path / "out", zero=3),
                 tmp_path / "job.json")
    final = _weights(out / "final")
    assert _experts_per_shard(out / "final") == [{0, 1}, {2, 3}]
    _assert_equal(_weights(out / "weights" / f"step_{STEPS}"), final)
    zero2 = _weights(ep_run / "final")
    for key, value in final.items():
        torch.testing.assert_close(value, zero2[key], rtol=1e-4, atol=1e-5, msg=key)
    exported, checkpoints = tmp_path / "exported", out / "checkpoints"
    before = sorted(path.name for path in checkpoints.iterdir())
    assert main(["export", str(tmp_path / "job.json"), "--tag", f"step{STEPS}",
                 "--out", str(exported)]) == 0
    _assert_equal(_weights(exported), final)
    assert sorted(path.name for path in checkpoints.iterdir()) == before  # the scratch is gone


def test_score_routes_under_ep_equal_those_without_and_replay_with_agreement_one(
        tiny_moe_checkpoint, tmp_path):
    """`vlmcp score --routes` (R2) at EP 2 over 2 ranks records the experts and target logprobs
    it records on one process without EP; a step of `vlmcp train` at EP 2 on those routes replays
    every (token, layer) with agreement 1.0."""
    gen = torch.Generator().manual_seed(31)
    records = []
    for n in (19, 26, 11, 30):
        ids = torch.randint(10, 400, (n,), generator=gen).tolist()
        records.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    scored = {}
    for ep, nproc in ((1, 1), (2, 2)):
        job = tiny_job(tiny_moe_checkpoint, data, tmp_path / f"score{ep}", parallel={"ep_size": ep},
                       train={"max_steps": 1},
                       data={"cache_dir": str(tmp_path / "cache"), "max_seq_len": 64})
        out = tmp_path / f"scores{ep}.jsonl"
        assert_ok(run_vlmcp(["score", str(write_job(tmp_path / f"score{ep}.json", job)), "--routes",
                             "--out", str(out)], launcher="torchrun" if nproc > 1 else None,
                            nproc=nproc))
        scored[ep] = [json.loads(line) for line in out.read_text().splitlines()]
    for plain, ep in zip(scored[1], scored[2]):
        assert ep["routed_experts"] == plain["routed_experts"]
        assert ep["logprobs"] == pytest.approx(plain["logprobs"], rel=1e-5, abs=1e-5)
    for record, row in zip(records, scored[2]):
        record["routed_experts"] = row["routed_experts"]
    routed = tmp_path / "routed.jsonl"
    routed.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = tiny_job(tiny_moe_checkpoint, routed, tmp_path / "out", parallel={"ep_size": 2},
                   train={"max_steps": 1}, data={"max_seq_len": 64})
    _train(job, tmp_path / "train.json")
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "loss" in r)
    assert row["router_replay_tokens"] == sum(len(r["input_ids"]) for r in records) * 4
    assert row["router_replay_agreement"] == 1.0


def test_greedy_generation_at_ep2_reproduces_the_plain_models_own_continuations(
        tiny_moe_checkpoint, tmp_path):
    """`eval.generate` at EP 2 (world 2, synced decoding: the two ranks' samples have prompts
    and continuations of other lengths, so one rank steps on while the other is done) finds every
    held-out continuation that plain transformers' greedy `generate` on one process produced from
    the same weights (optimizer lr 0): accuracy 1.0 over the 4 samples."""
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_moe_checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_checkpoint)
    text_ids = range(max(tokenizer.all_special_ids) + 1, len(tokenizer))
    gen = torch.Generator().manual_seed(5)
    records = []
    for length, new in ((7, 3), (12, 6), (9, 2), (15, 5)):
        continuation = [-1]
        while not all(t in text_ids for t in continuation):  # plain text tokens only
            prompt = torch.randint(10, 400, (1, length), generator=gen)
            with torch.no_grad():
                output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                        mm_token_type_ids=torch.zeros_like(prompt),
                                        max_new_tokens=new, min_new_tokens=new, do_sample=False)
            continuation = output[0, length:].tolist()
        records.append({"input_ids": prompt[0].tolist() + continuation,
                        "labels": [-100] * length + continuation})
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = tiny_job(tiny_moe_checkpoint, data, tmp_path / "out", parallel={"ep_size": 2},
                   data={"eval": str(data), "max_seq_len": 32}, optimizer={"lr": 0.0},
                   eval={"generate": True, "max_new_tokens": 8},
                   train={"max_steps": 1, "eval_every": 1})
    out = _train(job, tmp_path / "job.json")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluation,) = [row for row in rows if "eval_accuracy" in row]
    assert (evaluation["eval_accuracy"], evaluation["eval_samples"]) == (1.0, 4)
