"""A checkpoint saved at one layout resumes at another and trains the next step as the
uninterrupted run does: world size, SP, DP against train.grad_accum, ZeRO stage, expert
parallelism, LoRA (on the routed experts too, at ZeRO 3 under EP), and a rollout job.

Each case trains 3 steps at layout A with a checkpoint after step 2 (tests/helpers/resume_runs.py),
and `vlmcp train`'s loop resumes a copy of that checkpoint at layout B for step 3. Step 3's loss
and weight update (its weights less those after step 2) of the resumed run are held to plain
transformers' float64 run of the same samples (each sample alone, torch's AdamW, the job's
schedule and clipping), with the uninterrupted run's own distance from it as fp32's error
(docs/test-bounds.md), and to the uninterrupted run to fp32 rounding; the resumed step's learning
rate is the uninterrupted one (the schedule and the step count carried over). fp32 AdamW: a
resume that lost the optimizer's moments, or started its schedule again, is far outside.

Ranks: one set at world 2 runs every uninterrupted run at world 2 and then the resumes at world 2;
one at world 1 the uninterrupted run at world 1 and the resumes at world 1. `world1_to_world2_sp2_
zero3` resumes through `vlmcp train --set ...` under torchrun, after a first launch whose converting
rank was SIGKILLed while it converted the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import assert_ok, launcher_prefix, run_vlmcp, vlmcp_env, write_job
from tests.helpers.parity import assert_agree_to_fp32_rounding, assert_within_fp32_error
from tests.helpers.resume_runs import (SAVED, STEPS, copy_saved, layout_job, reference_run,
                                       run_all, trained_weights)
from tests.helpers.rollout_producer import rollout_line, write_step
from vlmcp.cli import main
from vlmcp.data.processor import load_processor
from vlmcp.data.rollouts import is_complete, step_dir
from vlmcp.training.checkpoint import incomplete_reason

pytestmark = pytest.mark.e2e

LORA = {"target_modules": ["q_proj", "down_proj"]}
LORA_EXPERTS = {"target_modules": ["q_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}

#: Uninterrupted runs: (model, world size, layout).
UNINTERRUPTED = {
    "dense_sp2_zero2": ("dense", 2, dict(sp=2, stage=2)),
    "dense_dp2_zero2": ("dense", 2, dict(stage=2)),
    "dense_world1_zero2": ("dense", 1, dict(stage=2)),
    "dense_sp2_accum2_zero3": ("dense", 2, dict(sp=2, accum=2, stage=3)),
    "moe_ep2_zero2": ("moe", 2, dict(ep=2, stage=2)),
    "moe_ep1_zero2": ("moe", 2, dict(stage=2)),
    "lora_dp2_zero2": ("dense", 2, dict(stage=2, lora=LORA)),
    "lora_experts_ep2_zero3": ("moe", 2, dict(ep=2, stage=3, lora=LORA_EXPERTS)),
}
#: Resumes: (the uninterrupted run whose checkpoint, world size, layout, whether it loads the
#: universal checkpoint).
CASES = {
    "world2_sp2_to_world1": ("dense_sp2_zero2", 1, dict(stage=2), True),
    "dp2_to_grad_accum2": ("dense_dp2_zero2", 1, dict(stage=2, accum=2), True),
    "world1_to_world2_sp2_zero3": ("dense_world1_zero2", 2, dict(sp=2, stage=3), True),
    "sp2_accum2_zero3_to_dp2_zero3": ("dense_sp2_accum2_zero3", 2, dict(stage=3), False),
    "zero2_to_zero3_same_world": ("dense_sp2_zero2", 2, dict(sp=2, stage=3), True),
    "moe_ep2_to_ep1": ("moe_ep2_zero2", 2, dict(stage=2), True),
    "moe_ep1_to_ep2": ("moe_ep1_zero2", 2, dict(ep=2, stage=2), True),
    "lora_world2_to_world1": ("lora_dp2_zero2", 1, dict(stage=2, accum=2, lora=LORA), True),
    "lora_experts_ep2_zero3_to_ep1": ("lora_experts_ep2_zero3", 2,
                                      dict(stage=3, lora=LORA_EXPERTS), True),
}
#: The case `vlmcp train` resumes in a launch of its own (the fault test).
BY_THE_CLI = "world1_to_world2_sp2_zero3"
ROLLOUT_SAMPLES = 4


def _rollout_job(model: Path, root: Path, out: Path, **layout) -> dict:
    """A rollout job: step N trains rollouts/step_N and publishes its weights."""
    job = layout_job(model, Path("unused"), out, **layout,
                     loss={"type": "policy_gradient"},
                     rollouts={"dir": str(root / "rollouts"), "timeout_s": 60, "poll_s": 0.1},
                     publish={"dir": str(out / "weights"), "every": 1, "keep": STEPS})
    del job["data"]["train"]
    return job


def _write_rollouts(model: Path, digits: Path, rollouts: Path) -> None:
    """STEPS rollout steps of the base model's own logprobs, ROLLOUT_SAMPLES digits each."""
    from transformers import Qwen3_5ForConditionalGeneration

    processor = load_processor(model)
    policy = Qwen3_5ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    records = [json.loads(t) for t in (digits / "train.jsonl").read_text().splitlines()]
    generator = torch.Generator().manual_seed(0)
    for number in range(1, STEPS + 1):
        first = ROLLOUT_SAMPLES * (number - 1)
        lines = [rollout_line(policy, processor, records[i], f"train.jsonl:{i + 1}", digits,
                              generator) for i in range(first, first + ROLLOUT_SAMPLES)]
        write_step(step_dir(rollouts, number), lines, 0, 0.0)


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tiny_moe_checkpoint, digits_jsonl, tmp_path_factory) -> dict:
    """Every run of the module but `BY_THE_CLI`'s resume, in two sets of ranks (module
    docstring); {"results", "jobs" (uninterrupted), "resumes", "root"}."""
    root = tmp_path_factory.mktemp("resume_layouts")
    models = {"dense": tiny_checkpoint, "moe": tiny_moe_checkpoint}
    data = digits_jsonl / "train.jsonl"
    jobs = {name: layout_job(models[model], data, root / name, **layout)
            for name, (model, _, layout) in UNINTERRUPTED.items()}
    resumes = {name: layout_job(models[UNINTERRUPTED[a][0]], data, root / name, **layout)
               for name, (a, _, layout, _) in CASES.items()}
    _write_rollouts(tiny_checkpoint, digits_jsonl, root / "rollouts")
    rollout_a = _rollout_job(tiny_checkpoint, root, root / "rollouts_sp2", sp=2)
    rollout_b = _rollout_job(tiny_checkpoint, root, root / "rollouts_world1")

    def batch(world: int) -> list[tuple]:
        first = [("uninterrupted", name, jobs[name], None)
                 for name, (_, w, _) in UNINTERRUPTED.items() if w == world]
        return first + [("trained", name, resumes[name], jobs[a]["output_dir"])
                        for name, (a, w, _, _) in CASES.items()
                        if w == world and name != BY_THE_CLI]

    dropout = layout_job(tiny_checkpoint, data, root / "dropout_straight", stage=2,
                         lora={**LORA, "dropout": 0.5})
    results = {}
    results.update(_merged(run_ranks(run_all, 2, batch(2) + [
        ("trained", "rollouts_sp2", rollout_a, None),
        ("trained", "dropout_straight", dropout, None),
        ("trained", "dropout_resumed", {**dropout, "output_dir": str(root / "dropout_resumed")},
         dropout["output_dir"])])))
    results.update(_merged(run_ranks(run_all, 1, batch(1) + [
        ("trained", "rollouts_world1", rollout_b, rollout_a["output_dir"])])))
    return {"results": results, "jobs": jobs, "resumes": resumes, "root": root,
            "rollout_jobs": (rollout_a, rollout_b)}


def _merged(per_rank: list[dict]) -> dict:
    """Rank 0's rows of each run, and an uninterrupted run's samples of each step over every
    rank (each rank returns those of the micro-batches it ran)."""
    merged = {}
    for name, result in per_rank[0].items():
        merged[name] = dict(result)
        if "samples" in result:
            merged[name]["samples"] = [sorted(set().union(*(r[name]["samples"][step]
                                                             for r in per_rank)))
                                       for step in range(STEPS)]
    return merged


@pytest.fixture(scope="module")
def references(runs) -> dict:
    """The float64 reference run of each uninterrupted run a case resumes."""
    sources = {source for source, _, _, _ in CASES.values()}
    return {name: reference_run(job, runs["results"][name]["samples"],
                                Path(job["output_dir"]) / "weights_0" if job.get("lora") else None)
            for name, job in runs["jobs"].items() if name in sources}


def _update(after: dict, before: dict) -> dict:
    return {k: after[k].double() - before[k].double() for k in after}


def _assert_resumed_as_uninterrupted(name: str, runs: dict, references: dict,
                                     b_rows: list[dict]) -> None:
    """The resume `name`'s step against the uninterrupted run and the reference (module
    docstring)."""
    source, _, _, universal = CASES[name]
    job, resumed_job = runs["jobs"][source], runs["resumes"][name]
    a_rows, exact = runs["results"][source]["rows"], references[source]
    assert [row["step"] for row in b_rows if "loss" in row] == [STEPS]
    assert b_rows[-1]["lr"] == a_rows[-1]["lr"], "the LR schedule did not carry over"
    a_loss, b_loss = a_rows[-1]["loss"], b_rows[-1]["loss"]
    assert_within_fp32_error(b_loss, a_loss, exact.losses[-1], at_least=1e-5,
                             name=f"{name}: step {STEPS}'s loss")
    assert_agree_to_fp32_rounding(a_loss, b_loss, a_loss, exact.losses[-1],
                                  name=f"{name}: step {STEPS}'s loss against the uninterrupted")
    a_out, b_out = Path(job["output_dir"]), Path(resumed_job["output_dir"])
    before = trained_weights(a_out / f"weights_{SAVED}", job)
    a_update = _update(trained_weights(a_out / f"weights_{STEPS}", job), before)
    b_update = _update(trained_weights(b_out / "final", resumed_job), before)
    ref64 = _update(exact.last, exact.saved)
    moved = [k for k in ref64 if ref64[k].abs().max() > 0]
    assert moved and set(moved) <= set(b_update)
    for key in moved:
        assert_within_fp32_error(b_update[key], a_update[key], ref64[key],
                                 name=f"{name}: step {STEPS}'s update of {key}")
    assert (b_out / "checkpoints" / f"step{SAVED}" / "universal").is_dir() == universal


@pytest.mark.parametrize("name", [name for name in CASES if name != BY_THE_CLI])
def test_a_resume_at_another_layout_trains_the_next_step_as_the_uninterrupted_run(
        name, runs, references):
    _assert_resumed_as_uninterrupted(name, runs, references, runs["results"][name]["rows"])


def _killed_while_converting(command: list[str], tag_dir: Path, log: Path) -> bool:
    """Start the launch `command`; once the conversion's temporary directory is there, SIGKILL
    the rank that converts (rank 0; as the OOM killer or a preempted node does), wait for the
    launcher to end the others, and kill what is left. Whether the kill landed mid-conversion
    (False: the conversion had finished)."""
    with log.open("w") as handle:
        proc = subprocess.Popen(command, env=vlmcp_env(), stdout=handle, stderr=subprocess.STDOUT)
        ranks: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + 300
            while not any(tag_dir.glob(".tmp-universal-*")):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.005)
            ranks = psutil.Process(proc.pid).children(recursive=True)
            next(p for p in ranks if p.environ().get("RANK") == "0").kill()
            proc.wait(timeout=120)
        finally:
            for rank in ranks:
                if rank.is_running():
                    rank.kill()
            if proc.poll() is None:
                proc.kill()
    return not (tag_dir / "universal").exists()


def test_vlmcp_train_resumes_at_another_layout_after_a_conversion_killed_midway(
        runs, references, tmp_path):
    """`vlmcp train --set train.resume=true --set parallel.sp_size=2 --set deepspeed...stage=3`
    under torchrun, from world 1: SIGKILLed while it converts, it leaves the checkpoint whole and
    no conversion a resume would read; run again, it converts again and trains step 3 as the
    uninterrupted run."""
    job = runs["resumes"][BY_THE_CLI]
    out = Path(job["output_dir"])
    copy_saved(Path(runs["jobs"][CASES[BY_THE_CLI][0]]["output_dir"]), out)
    unchanged = {**job, "parallel": {"sp_size": 1, "ep_size": 1},
                 "deepspeed": {"zero_optimization": {"stage": 2}}}
    path = write_job(tmp_path / "job.json", unchanged)
    command = ["train", str(path), "--set", "train.resume=true", "--set", "parallel.sp_size=2",
               "--set", "deepspeed.zero_optimization.stage=3"]
    tag_dir = out / "checkpoints" / f"step{SAVED}"
    for attempt in range(5):
        if _killed_while_converting(launcher_prefix("torchrun", 2) + command, tag_dir,
                                    tmp_path / f"killed{attempt}.log"):
            break
        shutil.rmtree(tag_dir / "universal")  # the kill came too late: again
    else:
        pytest.fail("every kill landed after the conversion")
    assert not (tag_dir / "universal").exists()
    assert incomplete_reason(tag_dir) is None, "the checkpoint itself is whole"
    result = run_vlmcp(command, launcher="torchrun", nproc=2)
    assert_ok(result)
    assert "converted" in result.stderr and "to DeepSpeed's universal checkpoint" in result.stderr
    assert not list(tag_dir.glob(".tmp-universal-*")), "the interrupted conversion is gone"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    _assert_resumed_as_uninterrupted(BY_THE_CLI, runs, references, rows)


def test_a_rollout_job_resumed_at_another_layout_trains_the_next_rollout_step_and_publishes_it(
        runs):
    """A rollout job saved at SP 2 (world 2) resumes at world 1: it trains rollout step 3 (its
    samples, tokens and targets those the uninterrupted run trained at step 3) and publishes
    step_3 beside the steps the first run published, each in the layout of the run that wrote
    it (two shards at world 2, one at world 1)."""
    a_job, b_job = runs["rollout_jobs"]
    a_rows = [r for r in runs["results"]["rollouts_sp2"]["rows"] if "loss" in r]
    b_rows = [r for r in runs["results"]["rollouts_world1"]["rows"] if "loss" in r]
    assert [r["step"] for r in b_rows] == [STEPS]
    for key in ("rollout_samples", "policy_step", "tokens", "targets", "lr"):
        assert b_rows[0][key] == a_rows[-1][key], key
    weights = Path(b_job["publish"]["dir"])
    assert sorted(p.name for p in weights.iterdir()) == [f"step_{n}" for n in range(1, STEPS + 1)]
    assert all(is_complete(weights / f"step_{n}") for n in range(1, STEPS + 1))
    assert (weights / f"step_{STEPS}" / "model.safetensors").is_file()
    assert len(list((weights / f"step_{SAVED}").glob("model-*-of-*.safetensors"))) == 2
    published = trained_weights(weights / f"step_{STEPS}", {})
    final = trained_weights(Path(b_job["output_dir"]) / "final", {})
    assert all(torch.equal(published[k], final[k]) for k in final)


def test_each_rank_draws_the_random_numbers_it_would_have_drawn_after_a_resume_at_its_layout(
        runs):
    """LoRA dropout 0.5 at world 2, `vlmcp train`'s loop 3 steps straight: a resume of its step-2
    checkpoint at the saved world size restores each rank's RNG states, so step 3's dropout masks,
    and its loss, are the straight run's bit for bit."""
    uninterrupted = [r for r in runs["results"]["dropout_straight"]["rows"] if "loss" in r]
    resumed = [r for r in runs["results"]["dropout_resumed"]["rows"] if "loss" in r]
    assert [r["step"] for r in resumed] == [STEPS]
    assert resumed[0]["loss"] == uninterrupted[-1]["loss"]


def test_vlmcp_export_writes_a_lora_checkpoint_of_the_routed_experts_at_zero3_under_ep(
        runs, tmp_path):
    """LoRA on the routed experts at EP 2, ZeRO 3 (saved as a dense model's checkpoint, its
    experts' factors from vlmcp's own files): `vlmcp export` of step 2 writes the adapter the run
    held after step 2, every expert's factors in PEFT's layout."""
    job = runs["jobs"]["lora_experts_ep2_zero3"]
    path = write_job(tmp_path / "job.json", job)
    assert main(["export", str(path), "--tag", f"step{SAVED}", "--out",
                 str(tmp_path / "exported")]) == 0
    exported = trained_weights(tmp_path / "exported", job)
    held = trained_weights(Path(job["output_dir"]) / f"weights_{SAVED}", job)
    assert exported.keys() == held.keys()
    assert any(".mlp.experts.lora_A" in key for key in held)
    assert all(torch.equal(exported[key], held[key]) for key in held)
