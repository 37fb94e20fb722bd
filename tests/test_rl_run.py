"""`vlmcp rl` end to end: a real vLLM server (the engine venv) generates, `vlmcp train` trains and
pushes its weights into it, the orchestrator writes the rollout steps between them. One server
for the module (about 20-50 s to start on 2 cores); the run under test is stopped by SIGTERM
after its second step and resumed, as a preemption would.

On the written steps, the contract holds exactly:

* SIGTERM stops all parts cleanly (a trainer checkpoint, exit 143) and the resumed run goes on
  with the same prompt stream: the steps' prompt positions are 0, 1, 2, ... without a gap or a
  repeat, each the seeded stream's row;
* each written answer's token ids and logprobs are the engine's: the engine, serving the
  answer's policy version again, scores the same tokens to the same logprobs (each within bf16's
  own error of transformers in float64);
* each advantage is the estimator's (grpo) from the written rewards of its group, the rewards
  are the reward functions' (a TRL-signature function given by path with the row's columns, and
  the built-ins math and exact_match: a math-verify task), weighted;
* every token's version is within rl.max_off_policy of its step, and every group dynamic
  sampling dropped had one reward value (recomputed from its dumped answers);
* the metrics rows and the console lines report each step and the evaluations.

Faults end as documented, in one line, without a traceback or a hang: a reward that hangs, and
the engine killed mid-run (the last test: it ends the module's server).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.engine_reference import NEEDS_ENGINE, Prompt, reference_logprobs
from tests.helpers.launching import REPO, run_vlmcp, vlmcp_env, write_job
from tests.helpers.parity import bf16_allowance, rel_err
from tests.helpers import vf_dialog
from tests.helpers.rl_rewards import parity
from vlmcp.data.policy_versions import token_versions
from vlmcp.data.processor import load_processor
from vlmcp.data.formats import process_images
from vlmcp.data.rollouts import STABLE, read_meta, step_dir
from vlmcp.demo.image import DEMO_MODEL
from vlmcp.engine.venv import engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmHttpClient, VllmServer
from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint
from vlmcp.rl.advantages import group_advantages
from vlmcp.rl.builtin_rewards import exact_match, math as math_reward
from vlmcp.rl.generation import image_part, sampling_mask
from vlmcp.rl.prompts import PromptStream

ENGINE = engine_python()
pytestmark = [pytest.mark.e2e, NEEDS_ENGINE]

STEPS, GROUP, PER_STEP, TAU, K = 3, 4, 4, 0.9, 1
REWARDS = REPO / "tests" / "helpers" / "rl_rewards.py"


@pytest.fixture(scope="module")
def assets(tmp_path_factory, digits_jsonl):
    """An engine-compatible tiny VLM, and digit prompts whose rows alternate "constant" (one
    reward for the whole group: dropped) and "parity" (rewarded by the first answer token)."""
    root = tmp_path_factory.mktemp("rl_run")
    checkpoint = build_tiny_checkpoint(root / "checkpoint", seed=0,
                                       **{**DEMO_MODEL, **VLLM_CPU_HEADS})
    records = [json.loads(t) for t in (digits_jsonl / "train.jsonl").read_text().splitlines()]
    rows = [{"messages": r["messages"][:1], "images": [str(digits_jsonl / r["images"][0])],
             "answer": r["messages"][1]["content"], "kind": ("constant", "parity")[i % 2]}
            for i, r in enumerate(records[:24])]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[-4:]))
    return {"root": root, "checkpoint": checkpoint, "rows": rows,
            "processor": load_processor(checkpoint)}


def _reset(server, assets) -> VllmHttpClient:
    """The server back on the base checkpoint, labelled version 0 (a fresh run's start); the
    returned client serves any version of `assets["root"] / "versions"`."""
    versions = assets["root"] / "versions"
    if not versions.exists():
        shutil.copytree(assets["checkpoint"], versions / "step_0")
        (versions / "step_0" / STABLE).write_text("")
    client = VllmHttpClient(server.url, versions, assets["checkpoint"], version=1)
    client.serve(0)
    return client


@pytest.fixture(scope="module")
def server(assets):
    """One vLLM server on the base checkpoint for the module, with the push backend and full
    prompt logprobs (for rescoring)."""
    engine = VllmServer(ENGINE, assets["checkpoint"], assets["root"] / "server.log",
                        args=(*CPU_ARGS, *PUSH_ARGS, "--max-model-len", "256", "--seed", "0",
                              "--max-logprobs", "1024"))
    engine.start()
    yield engine
    engine.stop()


def _job(assets, name: str, server, **rl) -> Path:
    root = assets["root"] / name
    job = {"model": {"path": str(assets["checkpoint"])},
           "data": {"max_seq_len": 256, "num_workers": 0},
           "loss": {"type": "ppo_clip", "normalize": "token"},
           "optimizer": {"type": "adamw", "lr": 2e-3},
           "train": {"max_steps": STEPS, "seed": 0},
           "rollouts": {"dir": str(root / "rollouts"), "timeout_s": 120, "poll_s": 0.05},
           "publish": {"dir": str(root / "weights"), "push_dtype": "bfloat16"},
           "rl": {"engines": [server.url], "prompts": str(assets["root"] / "prompts.jsonl"),
                  "prompts_per_step": PER_STEP, "group_size": GROUP, "max_new_tokens": 3,
                  "temperature": TAU, "max_off_policy": K, "max_prompts_per_step": 16,
                  "rewards": [{"function": f"{REWARDS}:parity"},
                              {"function": "math", "weight": 0.5},
                              {"function": "exact_match", "weight": 0.25}], **rl},
           "output_dir": str(root / "out")}
    return write_job(root / "job.json", job)


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def run(assets, server):
    """The run under test: SIGTERM once step 2 is written, then resumed to the end."""
    _reset(server, assets)
    job = _job(assets, "run", server, eval_prompts=str(assets["root"] / "eval.jsonl"),
               eval_every=2)
    root = job.parent
    log = root / "first.log"
    proc = subprocess.Popen([*_vlmcp(), "rl", str(job)], cwd=REPO, env=vlmcp_env(),
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(step_dir(root / "rollouts", 2), proc, log)
        _wait_for(root / "out" / "metrics.jsonl", proc, log)  # the trainer trained step 1
        proc.send_signal(signal.SIGTERM)
        first_code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = json.loads((root / "out" / "stopped.json").read_text())
    resumed = run_vlmcp(["rl", str(job), "--set", "train.resume=true"], timeout=600)
    return {"root": root, "job": json.loads(job.read_text()), "first_code": first_code,
            "first_log": log.read_text(), "stopped": stopped, "resumed": resumed}


def _vlmcp() -> list[str]:
    import sys

    return [sys.executable, "-m", "vlmcp"]


def _lines(root: Path, step: int) -> list[dict]:
    return [json.loads(t) for t in
            (step_dir(root / "rollouts", step) / "rollouts.jsonl").read_text().splitlines()]


def _samples(root: Path, step: int) -> list[dict]:
    path = root / "out" / "rl" / "samples" / f"step_{step}.jsonl"
    return [json.loads(t) for t in path.read_text().splitlines()]


def test_sigterm_stops_every_part_cleanly_and_the_resumed_run_continues_the_prompt_stream(run):
    assert run["first_code"] == 143, run["first_log"][-3000:]
    assert "Traceback" not in run["first_log"]
    assert run["stopped"]["stopped"] == "SIGTERM" and run["stopped"]["exit_code"] == 143
    assert run["resumed"].returncode == 0, run["resumed"].stderr[-3000:]
    stream = PromptStream(24, seed=0)
    positions = []
    for step in range(1, STEPS + 1):
        meta = read_meta(step_dir(run["root"] / "rollouts", step)).fields
        start, end = meta["prompt_position"]
        assert meta["prompts"] == list(range(start, end))
        assert start == len(positions)  # no prompt repeated or skipped, across the stop too
        positions += meta["prompts"]
        for sample in _samples(run["root"], step):
            row = stream.at(sample["prompt_position"])
            assert sample["source"].endswith(f"prompts.jsonl:{row + 1}")
    assert positions == list(range(len(positions)))


def test_each_written_answer_is_the_engines_tokens_and_logprobs_at_its_version(run, assets,
                                                                               server):
    """The engine, serving the answer's policy version again, scores the written tokens (as
    its prompt) to the written logprobs: both lie within bf16's own error of transformers in
    float64 (the engine samples in its decode path and scores in its prefill path)."""
    _reset(server, assets)
    versions_dir = assets["root"] / "versions"
    weights = run["root"] / "weights"
    for step in sorted(weights.glob("step_*")) + sorted(weights.glob(".set-aside/*/step_*")):
        (versions_dir / step.name).unlink(missing_ok=True)
        (versions_dir / step.name).symlink_to(step)
    client = VllmHttpClient(server.url, versions_dir, assets["checkpoint"])
    allowed = set(sampling_mask(assets["processor"]))
    checked = 0
    for step in range(1, STEPS + 1):
        for line in _lines(run["root"], step)[:2]:
            (version,) = {span["version"] for span in line["policy_versions"]}
            client.serve(version)
            written, rescored = _written_and_rescored(client, line, allowed)
            prompt = line["labels"].index(next(t for t in line["labels"] if t != -100))
            answer = line["input_ids"][prompt:]
            pixels, grid = process_images([Path(p) for p in line["images"]], "line",
                                          assets["processor"])
            mm = torch.tensor([[int(t == assets["processor"].image_token_id)
                                for t in line["input_ids"][:prompt]]])
            ref64, ref_bf16 = reference_logprobs(
                versions_dir / f"step_{version}",
                Prompt(line["input_ids"][:prompt], pixels, grid, mm), [answer], TAU,
                sorted(allowed))
            allowance = bf16_allowance(ref_bf16, ref64)
            assert rel_err(written, ref64) <= allowance, (step, version)
            assert rel_err(rescored, ref64) <= allowance, (step, version)
            checked += 1
    assert checked == 2 * STEPS


def _written_and_rescored(client, line: dict, allowed: set[int], tau: float = TAU
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the line's written logprobs, the engine's own of the same tokens): the engine scores
    the whole line as its prompt (full prompt logprobs), tempered and masked as it sampled."""
    reply = client.post("/inference/v1/generate", {
        "token_ids": line["input_ids"], "return_token_ids": True,
        "content_parts": [image_part(Path(p)) for p in line.get("images", [])],
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": -1, "temperature": 1.0}})
    assert reply["prompt_token_ids"] == line["input_ids"]
    written, rescored = [], []
    for t, label in enumerate(line["labels"]):
        if label == -100:
            continue
        full = reply["prompt_logprobs"][t]
        tempered = {int(i): entry["logprob"] / tau for i, entry in full.items()
                    if int(i) in allowed}
        norm = torch.logsumexp(torch.tensor(list(tempered.values()), dtype=torch.float64), 0)
        rescored.append(tempered[label] - float(norm))
        written.append(line["inference_logprobs"][t])
    return (torch.tensor(written, dtype=torch.float64),
            torch.tensor(rescored, dtype=torch.float64))


def test_each_advantage_is_the_estimator_of_its_groups_written_rewards(run):
    for step in range(1, STEPS + 1):
        groups: dict[int, list[dict]] = {}
        for line in _lines(run["root"], step):
            groups.setdefault(line["prompt_position"], []).append(line)
        samples = {s["prompt_position"]: s for s in _samples(run["root"], step)}
        assert len(groups) == PER_STEP
        for position, lines in groups.items():
            sample = samples[position]
            assert sample["status"] == "kept" and len(lines) == GROUP
            assert [line["reward"] for line in lines] == sample["reward"]
            want = group_advantages([line["reward"] for line in lines], "grpo")
            assert [line["advantages"][-1] for line in lines] == pytest.approx(want, abs=1e-12)
            for line in lines:
                answer = [a for a, label in zip(line["advantages"], line["labels"])
                          if label != -100]
                assert len(set(answer)) == 1  # one advantage on every token of the answer
                assert line["reward"] == pytest.approx(line["rewards"]["parity"]
                                                       + 0.5 * line["rewards"]["math"]
                                                       + 0.25 * line["rewards"]["exact_match"])


def test_every_token_is_within_max_off_policy_and_dropped_groups_had_one_reward(run, assets):
    dropped = 0
    for step in range(1, STEPS + 1):
        for line in _lines(run["root"], step):
            versions = token_versions(line["policy_versions"], len(line["input_ids"]), "line")
            lags = {step - 1 - v for v, label in zip(versions, line["labels"]) if label != -100}
            assert lags and all(0 <= lag <= K for lag in lags), (step, lags)
        for sample in _samples(run["root"], step):
            row = assets["rows"][PromptStream(24, seed=0).at(sample["prompt_position"])]
            ids = sample["completion_ids"]
            texts = [assets["processor"].tokenizer.decode(i, skip_special_tokens=True)
                     for i in ids]
            prompts = [row["messages"]] * GROUP
            completions = [[{"role": "assistant", "content": t}] for t in texts]
            recomputed = [p + 0.5 * m + 0.25 * e for p, m, e in zip(
                parity(prompts, completions, ids, [row["kind"]] * GROUP),
                math_reward(prompts, completions, answer=[row["answer"]] * GROUP),
                exact_match(prompts, completions, answer=[row["answer"]] * GROUP))]
            assert sample["reward"] == pytest.approx(recomputed)
            if sample["status"] == "dropped":
                dropped += 1
                assert len(set(recomputed)) == 1
            else:
                assert len(set(recomputed)) > 1
    assert dropped >= STEPS  # every step met "constant" rows


def test_the_metrics_rows_and_the_console_report_every_step_and_evaluation(run):
    rows = [json.loads(t) for t in
            (run["root"] / "out" / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for row in steps:
        assert row["groups_kept"] == PER_STEP and row["groups_dropped"] >= 1
        assert row["prompts"] == row["groups_kept"] + row["groups_dropped"]
        assert set(row) >= {"reward_mean", "reward_std", "reward/parity_mean", "reward/math_std",
                            "pass@1", f"pass@{GROUP}", "answer_tokens_mean",
                            "truncated_fraction", "gen_tokens_per_s", "engine_idle_fraction",
                            "staleness", "wait_weights_s"}
        assert all(0 <= int(lag) <= K for lag in row["staleness"])
    evals = [r for r in rows if "eval_step" in r]
    assert evals[0]["eval_step"] == 0 and evals[0]["policy_version"] == 0
    assert evals[-1]["eval_step"] == STEPS and evals[-1]["policy_version"] == STEPS
    console = run["resumed"].stdout
    assert f"step {STEPS}/{STEPS}: reward" in console and "eval after step 3 (policy 3)" in console


def test_a_multi_turn_verifiers_environment_runs_three_steps_its_replies_prompt_tokens(
        assets, server):
    """tests/helpers/vf_dialog.py: three model turns per episode, the environment's reply
    between them. Every line's targets are the engine's sampled tokens (its logprobs again when
    the engine scores the line), the environment's messages are prompt tokens, every line of an
    episode carries the episode's advantage, and the rubric's reward is the last sampled token's
    parity."""
    _reset(server, assets)
    job = _job(assets, "environment", server, prompts=None, rewards=[],
               environment={"id": str(REPO / "tests" / "helpers" / "vf_dialog.py")},
               prompts_per_step=2, max_new_tokens=4, temperature=1.0,
               max_prompts_per_step=None)
    result = run_vlmcp(["rl", str(job)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    root = job.parent
    reply_ids = assets["processor"].tokenizer(vf_dialog.REPLY, add_special_tokens=False)[
        "input_ids"]
    allowed = set(sampling_mask(assets["processor"]))
    for step in range(1, STEPS + 1):
        lines = _lines(root, step)
        samples = {s["prompt_position"]: s for s in _samples(root, step)}
        assert len({line["prompt_position"] for line in lines}) == 2
        turns = {len([t for t in line["input_ids"] if t == 1]) for line in lines}
        assert max(turns) >= 2 * vf_dialog.DialogEnvConfig().turns - 1  # the replies are there
        by_group: dict[int, list[dict]] = {}
        for line in lines:
            by_group.setdefault(line["prompt_position"], []).append(line)
        for position, group_lines in by_group.items():
            sample = samples[position]
            advantages = group_advantages(sample["reward"], "grpo")
            assert len(group_lines) == len(sample["owners"])  # every turn of every episode
            for line, owner, completion in zip(group_lines, sample["owners"],
                                               sample["completion_ids"]):
                ids, labels = line["input_ids"], line["labels"]
                assert [t for t in labels if t != -100] == completion
                found = [i for i in range(len(ids)) if ids[i:i + len(reply_ids)] == reply_ids]
                assert all(labels[i + k] == -100 for i in found for k in range(len(reply_ids)))
                last = [c for o, c in zip(sample["owners"], sample["completion_ids"])
                        if o == owner][-1]
                assert line["reward"] == float(last[-1] % 2) == sample["reward"][owner]
                (advantage,) = {a for a in line["advantages"] if a is not None}
                assert advantage == pytest.approx(advantages[owner], abs=1e-12)
    client = _reset(server, assets)  # policy 0: step 1's
    for line in _lines(root, 1)[:3]:
        written, rescored = _written_and_rescored(client, line, allowed, 1.0)
        first = line["labels"].index(next(t for t in line["labels"] if t != -100))
        ref64, ref_bf16 = reference_logprobs(assets["checkpoint"], Prompt(line["input_ids"][:first]),
                                             [line["input_ids"][first:]], 1.0, sorted(allowed))
        targets = [t - first for t, label in enumerate(line["labels"]) if label != -100]
        ref64, ref_bf16 = ref64[targets], ref_bf16[targets]
        allowance = bf16_allowance(ref_bf16, ref64)
        assert rel_err(written, ref64) <= allowance and rel_err(rescored, ref64) <= allowance


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_a_hanging_reward_stops_the_run_with_one_line_naming_the_prompt_and_function(
        assets, server):
    _reset(server, assets)
    rows = [{**row, "answer": "hang"} for row in assets["rows"][:8]]
    prompts = assets["root"] / "prompts_hang.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = _job(assets, "hang", server, prompts=str(prompts), reward_timeout_s=2.0,
               rewards=[{"function": f"{REWARDS}:hangs"}], max_prompts_per_step=None)
    started = time.monotonic()
    result = run_vlmcp(["rl", str(job)], timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - started < 240
    (line,) = _error_lines(result.stderr)
    assert f"{prompts}:" in line and "reward 'hangs' timed out after 2 s" in line, line
    assert "Traceback" not in result.stderr + result.stdout


def test_killing_the_engine_ends_the_run_with_one_line(assets, server):
    """The last test of the module: it kills the module's server."""
    _reset(server, assets)
    job = _job(assets, "engine_killed", server)
    root = job.parent
    log = root / "console.log"
    proc = subprocess.Popen([*_vlmcp(), "rl", str(job)], cwd=REPO, env=vlmcp_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not step_dir(root / "rollouts", 1).exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        server.process.kill()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.write_text(stdout + stderr)
    assert proc.returncode == 1, stderr[-3000:]
    (line,) = _error_lines(stderr)
    assert server.url in line, line
    assert "Traceback" not in stdout + stderr
