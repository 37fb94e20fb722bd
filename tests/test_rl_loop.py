"""vlmcp as the trainer of an online RL loop (docs/rl-loop.md): `vlmcp train` under torchrun on 2
CPU ranks over gloo reads rollout steps that a producer in a process of its own writes
(tests/helpers/rollout_producer.py: plain-transformers inference from the published weights, with
per-token temperatures and inference logprobs), and publishes its weights after each step.

* The loop run (SP 2, ZeRO-3): a step written slowly is read only once complete, and whole; the
  policy lag comes from meta.json; an over-stale step is skipped and a malformed sample dropped,
  both counted; on-policy steps show no train-inference mismatch, so the trainer's logprobs at
  the sampling temperatures equal the producer's log_softmax(logits / tau) from the published
  weights, and so do `vlmcp score`'s on that published step; `publish.keep` keeps exactly K
  complete steps, the newest loadable by `from_pretrained` and equal to the final model.
* SIGTERM mid-run, then a resume: the stop leaves OUTPUT_DIR/stopped.json naming its step and
  checkpoint; training continues at the next rollout step (the test publishes the later steps by
  atomic rename) and its per-step losses equal the loop run's; every step ends up published; a
  producer that stops means a clear exit after rollouts.timeout_s, with a checkpoint; no file of
  the rollout directory was changed.
* LoRA (SP 2, ZeRO-2): only the adapter is published, `PeftModel.from_pretrained` loads it and
  the producer's logprobs from it equal the trainer's; a malformed sample with
  rollouts.on_bad_sample "error" stops the run with one error naming step_N/file:line.
* DP 2 (SP 1): one SGD step on a rollout step whose packs do not divide over the DP ranks equals
  plain transformers' step on exactly those samples (token normalisation over the step's batch,
  at the sampling temperatures); an over-stale step with rollouts.on_stale "error" is refused.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import Qwen3_5ForConditionalGeneration

from tests.helpers.launching import (REPO, assert_ok, launcher_prefix, run_vlmcp, tiny_job,
                                     train_losses, vlmcp_env, write_job)
from tests.helpers.parity import make_lively
from tests.helpers.rollout_producer import DATA_FILE
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.dataset import load_samples
from vlmcp.data.processor import load_processor
from vlmcp.data.rollouts import STABLE, step_dir
from vlmcp.model.tiny import build_tiny_checkpoint
from vlmcp.training.checkpoint import newest_complete
from vlmcp.training.metrics import read_metrics
from vlmcp.training.signals import STOP_MARKER
from vlmcp.training.weights.hf_format import INDEX_NAME, read_hf_weights

pytestmark = pytest.mark.e2e

TOL = 1e-5
#: The loop run's steps: (digit samples, generating policy, seconds between written lines,
#: malformed line). Step 2 is one step off-policy, step 3 waits for the weights of step 2 and is
#: written slowly, step 4 is 3 steps behind (max_staleness 2: skipped), step 5 is on-policy again.
LOOP_STEPS = [(range(0, 6), 0, 0.0, None), (range(6, 12), 0, 0.0, 2),
              (range(12, 18), 2, 0.5, None), (range(18, 24), 0, 0.0, None),
              (range(24, 30), 4, 0.0, None)]


def _rl_job(checkpoint, out, rollouts_dir, weights_dir, **sections):
    job = tiny_job(checkpoint, Path("unused"), out,
                   data={"max_seq_len": 64, "num_workers": 1},
                   parallel={"sp_size": 2},
                   loss={"type": "policy_gradient"},
                   optimizer={"type": "adamw", "lr": 2e-3},
                   deepspeed={"zero_optimization": {"stage": 3}},
                   rollouts={"dir": str(rollouts_dir), "timeout_s": 120, "poll_s": 0.2},
                   publish={"dir": str(weights_dir), "every": 1})
    del job["data"]["train"]
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def _producer(tmp_path, checkpoint, digits, rollouts, weights, steps) -> subprocess.Popen:
    """Start the producer process on `steps` [(samples, policy, slow_s, malformed)]."""
    plan = {"rollouts": str(rollouts), "weights": str(weights), "checkpoint": str(checkpoint),
            "digits": str(digits / "train.jsonl"), "timeout_s": 400,
            "steps": [{"samples": list(samples), "policy": policy, "slow_s": slow,
                       "malformed": malformed} for samples, policy, slow, malformed in steps]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.rollout_producer", str(path)],
                            cwd=REPO, env=vlmcp_env(), stdout=(tmp_path / "producer.log").open("w"),
                            stderr=subprocess.STDOUT)


def _finish(producer: subprocess.Popen, log: Path, strict: bool = True) -> None:
    """Wait for the producer: with `strict` it must exit 0 within 120 s; else (the trainer
    failed, so the producer may wait for weights that never come) it is stopped after 30 s."""
    try:
        code = producer.wait(timeout=120 if strict else 30)
    except subprocess.TimeoutExpired:
        producer.kill()
        producer.wait()
        assert not strict, f"the producer did not finish:\n{log.read_text()[-3000:]}"
        return
    assert code == 0 or not strict, log.read_text()[-3000:]


def _training_rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(out / "metrics.jsonl")
            if "loss" in row or "skipped_rollout" in row}


def _lines(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def _mismatch_rel(row: dict, lines: list[dict]) -> float:
    """An upper bound of |trainer logprobs - inference logprobs| / |inference logprobs| over the
    step's targets from its metrics row: each token's k3 >= d^2 / 2 (1 - |d| / 3)."""
    mu = [v for line in lines for v in line["inference_logprobs"] if v is not None]
    assert row["mismatch_targets"] == len(mu)
    return math.sqrt(2.01 * row["mismatch_kl"] * len(mu)) / math.sqrt(sum(v * v for v in mu))


@pytest.fixture(scope="module")
def loop_run(tiny_checkpoint, digits_jsonl, tmp_path_factory):
    """The loop run: 5 rollout steps from the producer process, weights published every step,
    the newest 2 kept."""
    root = tmp_path_factory.mktemp("rl_loop")
    rollouts, weights, out = root / "rollouts", root / "weights", root / "out"
    job = write_job(root / "job.json", _rl_job(
        tiny_checkpoint, out, rollouts, weights,
        # a hang ends through the watchdog, its line naming where, well before the 600 s run limit
        train={"max_steps": 5, "collective_timeout_s": 120},
        rollouts={"max_staleness": 2, "on_stale": "skip", "on_bad_sample": "skip"},
        publish={"keep": 2}))
    producer = _producer(root, tiny_checkpoint, digits_jsonl, rollouts, weights, LOOP_STEPS)
    result = None
    try:
        result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=600)
    finally:
        _finish(producer, root / "producer.log", strict=result is not None and not result.returncode)
    assert_ok(result)
    return {"root": root, "rollouts": rollouts, "weights": weights, "out": out, "job": job,
            "stderr": result.stderr}


def test_a_slowly_written_step_is_read_only_once_complete_and_whole(loop_run):
    rows = _training_rows(loop_run["out"])
    lines = _lines(step_dir(loop_run["rollouts"], 3) / DATA_FILE)
    assert rows[3]["rollout_samples"] == len(lines) == 6
    assert rows[3]["rollout_wait_s"] > 1.0
    assert f"waiting for rollout step {step_dir(loop_run['rollouts'], 3)}" in loop_run["stderr"]


def test_the_policy_lag_comes_from_meta_json_and_an_over_stale_step_is_skipped(loop_run):
    rows = _training_rows(loop_run["out"])
    assert [rows[n]["policy_step"] for n in range(1, 6)] == [0, 0, 2, 0, 4]
    assert [rows[n]["policy_lag"] for n in range(1, 6)] == [0, 1, 0, 3, 0]
    assert rows[4]["skipped_rollout"] == "stale" and "loss" not in rows[4]
    assert "skipping rollout step" in loop_run["stderr"] and "1 stale steps" in loop_run["stderr"]
    assert all("loss" in rows[n] for n in (1, 2, 3, 5))


def test_a_malformed_sample_is_skipped_with_a_count_naming_it(loop_run):
    rows = _training_rows(loop_run["out"])
    assert rows[2]["rollout_samples"] == 5 and rows[2]["rollout_skipped_samples"] == 1
    assert all(rows[n]["rollout_skipped_samples"] == 0 for n in (1, 3, 5))
    assert f"{step_dir(loop_run['rollouts'], 2) / DATA_FILE}:3: " in loop_run["stderr"]


def test_on_policy_steps_have_no_train_inference_mismatch_at_the_sampling_temperatures(loop_run):
    rows = _training_rows(loop_run["out"])
    for step in (1, 3, 5):
        lines = _lines(step_dir(loop_run["rollouts"], step) / DATA_FILE)
        assert _mismatch_rel(rows[step], lines) <= TOL, (step, rows[step])
        assert abs(rows[step]["mismatch_logprob_diff"]) <= TOL
    # One step off-policy, the trainer has moved on from the generating weights.
    assert rows[2]["mismatch_kl"] > 1e3 * max(rows[n]["mismatch_kl"] for n in (1, 3, 5))


def test_publish_keep_leaves_exactly_the_newest_complete_steps_and_they_load_offline(loop_run):
    weights = loop_run["weights"]
    assert sorted(p.name for p in weights.iterdir()) == ["step_4", "step_5"]
    for name in ("step_4", "step_5"):
        assert {"config.json", INDEX_NAME, "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors", STABLE, "tokenizer.json",
                "preprocessor_config.json"} <= {p.name for p in (weights / name).iterdir()}
    published = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(weights / "step_5"), dtype=torch.float32, local_files_only=True).state_dict()
    final = read_hf_weights(loop_run["out"] / "final")
    assert published.keys() >= final.keys()
    for key, value in final.items():
        assert torch.equal(published[key], value), key
    rows = [row for row in read_metrics(loop_run["out"] / "metrics.jsonl") if "published" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(row["publish_s"] > 0 and row["publish_bytes"] > 10**5 for row in rows)


def test_vlmcp_score_on_a_published_step_gives_the_trainers_logprobs_of_its_batch(loop_run,
                                                                                 tmp_path):
    """Step 5 was generated by WEIGHTS/step_4 at lag 0: the trainer's logprobs of it equal the
    producer's (no mismatch, above); `vlmcp score` of WEIGHTS/step_4 on that batch gives them too."""
    batch = step_dir(loop_run["rollouts"], 5) / DATA_FILE
    job = write_job(tmp_path / "score.json", tiny_job(
        loop_run["weights"] / "step_4", batch, tmp_path / "out", data={"max_seq_len": 64}))
    assert_ok(run_vlmcp(["score", str(job), "--out", str(tmp_path / "scores.jsonl")]))
    scored = torch.tensor([v for line in _lines(tmp_path / "scores.jsonl")
                           for v in line["logprobs"]], dtype=torch.float64)
    producer = torch.tensor([v for line in _lines(batch) for v in line["inference_logprobs"]
                             if v is not None], dtype=torch.float64)
    assert float((scored - producer).norm() / producer.norm()) <= TOL


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`: its bytes and mtime."""
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _wait_for_a_row(out: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and _training_rows(out):
            return
        time.sleep(0.05)
    raise AssertionError(f"no training row in {out} (exit {proc.poll()})")


def test_sigterm_then_resume_continues_at_the_next_step_and_a_stopped_producer_times_out(
        loop_run, tiny_checkpoint, tmp_path):
    rollouts, weights, out = tmp_path / "rollouts", tmp_path / "weights", tmp_path / "out"
    rollouts.mkdir()
    for step in (1, 2, 3):
        shutil.copytree(step_dir(loop_run["rollouts"], step), step_dir(rollouts, step))
    first_steps = _snapshot(rollouts)
    job = write_job(tmp_path / "job.json", _rl_job(
        tiny_checkpoint, out, rollouts, weights, train={"max_steps": 6},
        rollouts={"max_staleness": 2, "on_stale": "skip", "on_bad_sample": "skip"}))
    log = tmp_path / "log"
    proc = subprocess.Popen([*launcher_prefix("torchrun", 2), "train", str(job)], cwd=REPO,
                            env=vlmcp_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_for_a_row(out, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "exitcode  : 143" in text or "exit 143" in text, text[-3000:]
    tag, _ = newest_complete(out / "checkpoints")
    stopped = int(tag.removeprefix("step"))
    assert 1 <= stopped <= 3
    assert json.loads((out / STOP_MARKER).read_text()) == {
        "step": stopped, "stopped": "SIGTERM", "exit_code": 143,
        "checkpoint": str(out / "checkpoints" / tag)}
    # The later steps arrive by atomic rename, STABLE inside.
    for step in (4, 5):
        incoming = rollouts / f".incoming-{step}"
        shutil.copytree(step_dir(loop_run["rollouts"], step), incoming)
        os.rename(incoming, step_dir(rollouts, step))
    produced = _snapshot(rollouts)
    assert {k: produced[k] for k in first_steps} == first_steps
    result = run_vlmcp(["train", str(job), "--set", "train.resume=true",
                        "--set", "rollouts.timeout_s=5"], launcher="torchrun", nproc=2,
                       timeout=400)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "rollouts.timeout_s=5: no complete" in errors[0] \
        and str(step_dir(rollouts, 6)) in errors[0] and "a checkpoint of step 5" in errors[0], errors
    assert "resumed from" in result.stderr and f"at step {stopped}" in result.stderr
    assert newest_complete(out / "checkpoints")[0] == "step5"
    assert _snapshot(rollouts) == produced, "the trainer changed the producer's files"
    assert train_losses(out) == train_losses(loop_run["out"])
    assert sorted(_training_rows(out)) == [1, 2, 3, 4, 5]
    assert all((weights / f"step_{n}" / STABLE).is_file() for n in range(1, 6))
    assert not (out / STOP_MARKER).exists()


def test_lora_publishes_only_the_adapter_which_peft_loads_and_a_malformed_sample_is_one_error(
        tiny_checkpoint, digits_jsonl, tmp_path):
    rollouts, weights, out = tmp_path / "rollouts", tmp_path / "weights", tmp_path / "out"
    steps = [(range(0, 4), 0, 0.0, None), (range(4, 8), 1, 0.0, None),
             (range(8, 12), 2, 0.0, 2)]
    job = write_job(tmp_path / "job.json", _rl_job(
        tiny_checkpoint, out, rollouts, weights, train={"max_steps": 3},
        deepspeed={"zero_optimization": {"stage": 2}},
        optimizer={"lr": 1e-2}, lora={"r": 4, "alpha": 8}))
    producer = _producer(tmp_path, tiny_checkpoint, digits_jsonl, rollouts, weights, steps)
    result = None
    try:
        result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=600)
    finally:
        _finish(producer, tmp_path / "producer.log",
                strict=result is not None and result.returncode == 1)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: {step_dir(rollouts, 3) / DATA_FILE}:3: ")
    assert newest_complete(out / "checkpoints")[0] == "step2"
    for step in (1, 2):
        names = {p.name for p in (weights / f"step_{step}").iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", STABLE} <= names
        assert not any(name.startswith("model") for name in names)
    base = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_checkpoint),
                                                           dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(weights / "step_2"))
    assert any("lora_B" in name and float(p.abs().max()) > 0
               for name, p in adapted.named_parameters())
    # The producer generated step 2 from the published adapter of step 1: the trainer agrees.
    row = _training_rows(out)[2]
    assert row["policy_lag"] == 0
    assert _mismatch_rel(row, _lines(step_dir(rollouts, 2) / DATA_FILE)) <= TOL


def _sgd_reference_update(checkpoint, samples, lr):
    """-lr * d/dw of the step's token-normalised policy-gradient loss at the sampling
    temperatures, plain transformers, each sample alone."""
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="sdpa")
    n_total = sum(int((torch.tensor(s.labels[1:]) != IGNORE_INDEX).sum()) for s in samples)
    for s in samples:
        logits = model(input_ids=torch.tensor([s.input_ids]), mm_token_type_ids=s.mm_token_type_ids[None],
                       pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                       use_cache=False).logits[0]
        positions = [t for t in range(1, len(s.labels)) if s.labels[t] != IGNORE_INDEX]
        tau = s.token_arrays["temperatures"][positions]
        logp = torch.log_softmax(logits[[t - 1 for t in positions]] / tau[:, None], dim=-1)
        logp = logp.gather(1, torch.tensor([s.labels[t] for t in positions])[:, None])[:, 0]
        (-(s.token_arrays["advantages"][positions] * logp).sum() / n_total).backward()
    return {name: -lr * p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_a_rollout_step_over_dp_2_is_one_exact_sgd_step_and_an_over_stale_step_is_refused(
        digits_jsonl, tmp_path):
    checkpoint = make_lively(build_tiny_checkpoint(tmp_path / "lively", seed=0))
    rollouts, weights, out = tmp_path / "rollouts", tmp_path / "weights", tmp_path / "out"
    producer = _producer(tmp_path, checkpoint, digits_jsonl, rollouts, weights,
                         [(range(0, 7), 0, 0.0, None), (range(7, 9), 0, 0.0, None)])
    _finish(producer, tmp_path / "producer.log")
    samples = load_samples(step_dir(rollouts, 1) / DATA_FILE, load_processor(checkpoint),
                           max_seq_len=10_000)
    assert {len(s) for s in samples} == {len(samples[0])}  # 7 samples: packs of 3, 3 and 1
    per_pack = 3
    lr = 1000.0
    job = write_job(tmp_path / "job.json", _rl_job(
        checkpoint, out, rollouts, weights, train={"max_steps": 2, "grad_clip": 0.0},
        data={"max_seq_len": per_pack * len(samples[0])}, parallel={"sp_size": 1},
        deepspeed={"zero_optimization": {"stage": 0}},
        optimizer={"type": "sgd", "lr": lr, "momentum": 0.0, "weight_decay": 0.0},
        rollouts={"max_staleness": 0}))
    result = run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=400)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{step_dir(rollouts, 2) / 'meta.json'}: policy_step 0 is 1 " \
        "steps behind" in errors[0] and "rollouts.max_staleness=0" in errors[0], result.stderr[-4000:]
    assert newest_complete(out / "checkpoints")[0] == "step1"

    reference = _sgd_reference_update(checkpoint, samples, lr)
    before = load_file(checkpoint / "model.safetensors")
    after = read_hf_weights(weights / "step_1")
    rounding = 4 * torch.finfo(torch.float32).eps
    for key, w0 in before.items():
        if key.startswith("model.visual."):
            assert torch.equal(after[key], w0), key
            continue
        error = float((after[key] - w0 - reference[key]).norm())
        allowed = TOL * float(reference[key].norm()) + rounding * float(w0.norm())
        assert error <= allowed, f"{key}: |update - ref| = {error:.3e} > {allowed:.3e}"
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert row["rollout_samples"] == 7 and row["targets"] == sum(
        int((torch.tensor(s.labels[1:]) != IGNORE_INDEX).sum()) for s in samples)


def test_a_rollout_step_at_per_micro_batch_sp_degree_is_one_exact_sgd_step(digits_jsonl, tmp_path):
    """parallel.sp_dynamic at SP 2: the step's 7 short samples run whole, one pack per rank (the
    last slot's second rank repeats its pack at weight 0); the published weights take the
    reference step and the row counts every pack once, at degree 1."""
    checkpoint = make_lively(build_tiny_checkpoint(tmp_path / "lively", seed=0))
    rollouts, weights, out = tmp_path / "rollouts", tmp_path / "weights", tmp_path / "out"
    producer = _producer(tmp_path, checkpoint, digits_jsonl, rollouts, weights,
                         [(range(0, 7), 0, 0.0, None)])
    _finish(producer, tmp_path / "producer.log")
    samples = load_samples(step_dir(rollouts, 1) / DATA_FILE, load_processor(checkpoint),
                           max_seq_len=10_000)
    length = len(samples[0])
    assert {len(s) for s in samples} == {length}  # budget = length: one sample per pack
    lr = 1000.0
    job = write_job(tmp_path / "job.json", _rl_job(
        checkpoint, out, rollouts, weights, train={"max_steps": 1, "grad_clip": 0.0},
        data={"max_seq_len": 2 * length}, parallel={"sp_size": 2, "sp_dynamic": True},
        deepspeed={"zero_optimization": {"stage": 0}},
        optimizer={"type": "sgd", "lr": lr, "momentum": 0.0, "weight_decay": 0.0}))
    assert_ok(run_vlmcp(["train", str(job)], launcher="torchrun", nproc=2, timeout=400))

    reference = _sgd_reference_update(checkpoint, samples, lr)
    before = load_file(checkpoint / "model.safetensors")
    after = read_hf_weights(weights / "step_1")
    rounding = 4 * torch.finfo(torch.float32).eps
    for key, w0 in before.items():
        if key.startswith("model.visual."):
            assert torch.equal(after[key], w0), key
            continue
        error = float((after[key] - w0 - reference[key]).norm())
        allowed = TOL * float(reference[key].norm()) + rounding * float(w0.norm())
        assert error <= allowed, f"{key}: |update - ref| = {error:.3e} > {allowed:.3e}"
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert row["sp_degree_packs"] == {"1": 7, "2": 0}
    assert row["sp_degree_tokens"] == {"1": 7 * length, "2": 0} and row["tokens"] == 7 * length
