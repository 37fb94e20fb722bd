"""`vlmcp bench --rl`: the whole loop's step time, split, synchronous against asynchronous.

For each model, the demo's (`DEMO_MODEL` with the head sizes vLLM's CPU kernels take) and the
widened one of about 1.1 GB in bf16 (`vlmcp.bench.engine_push.LARGE`), both random-init, one vLLM
server from the engine venv (with vlmcp's push backend) serves every run. Each run is a fresh
`vlmcp rl` (its own trainer on one rank, SGD, the weights pushed after every step, the engine
reset to the base weights first) of `--steps` steps on digit image prompts (per step `SHAPES`
prompts of answers each, up to `NEW_TOKENS` tokens: fewer on the large model, whose CPU
training step is otherwise minutes; the exact-match reward, no dynamic sampling, no evaluation), at rl.max_off_policy 0 (sync: every step waits for the weights of the one before)
and 1 (async: sampling step N overlaps training step N-1), `--repeats` times each, alternating.

Per run, the medians over its steps after the first (the first pays the trainer's start; at
least `MIN_STEPS` steps, since one step off-policy the first two run ahead of the trainer):

    step_s          the loop's period: the orchestrator's time from the start of its wait for a
                    step's weights to the step written (steps run back to back)
    generate_s      sampling the step's groups (the engine's requests, their rewards overlapping)
    score_s         the groups' reward time, summed over the groups
    train_s         the trainer's optimizer step (its row's step_time_s)
    push_s          the push of the step's weights into the engine (rank 0's publish thread)
    push_downtime_s the engine's pause for it
    wait_weights_s  the orchestrator's wait for the policy it may sample from (pacing)
    wait_rollouts_s the trainer's wait for the step's rollouts

The report gives min / median / max of each over the repeats, per model and mode, and the ratio
of the async median step time to the sync one.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from vlmcp.bench.engine_push import LARGE
from vlmcp.bench.jobs import scratch_folder
from vlmcp.demo.assets import write_digits_dataset
from vlmcp.demo.image import DEMO_MODEL
from vlmcp.engine.venv import engine_python, missing_engine, named_engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmHttpClient, VllmServer
from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint

logger = logging.getLogger(__name__)

NEW_TOKENS = 4
#: Per model: (prompts per step, answers per prompt).
SHAPES = {"demo": (16, 8), "large": (4, 4)}
#: The split's keys, in report order.
PARTS = ("step_s", "generate_s", "score_s", "train_s", "push_s", "push_downtime_s",
         "wait_weights_s", "wait_rollouts_s")
MODES = {"sync": 0, "async": 1}
#: The fewest steps a run takes: one step off-policy, the orchestrator runs ahead for its first
#: two steps, so the steps after them show the loop's steady period.
MIN_STEPS = 5


def _job(checkpoint: Path, prompts: Path, out: Path, url: str, steps: int,
         max_off_policy: int, shape: tuple[int, int]) -> dict[str, Any]:
    return {"model": {"path": str(checkpoint)},
            "data": {"max_seq_len": 256, "num_workers": 0},
            "loss": {"type": "policy_gradient"},
            "optimizer": {"type": "sgd", "lr": 1e-3},
            "train": {"max_steps": steps, "seed": 0},
            "rollouts": {"dir": str(out / "rollouts"), "timeout_s": 1800, "poll_s": 0.05},
            "publish": {"push_dtype": "bfloat16"},
            "rl": {"engines": [url], "prompts": str(prompts), "prompts_per_step": shape[0],
                   "group_size": shape[1], "max_new_tokens": NEW_TOKENS,
                   "dynamic_sampling": False, "rewards": [{"function": "exact_match"}],
                   "max_off_policy": max_off_policy},
            "output_dir": str(out / "out")}


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(t) for t in path.read_text().splitlines() if t.strip()]


def _run(checkpoint: Path, prompts: Path, out: Path, server: VllmServer, steps: int,
         max_off_policy: int, shape: tuple[int, int]) -> dict[str, float]:
    """One fresh `vlmcp rl` run; the medians of its steps after the first."""
    versions = out.parent / "versions"
    if not versions.exists():
        versions.mkdir(parents=True)
        (versions / "step_0").symlink_to(checkpoint)
        (checkpoint / "STABLE").write_text("")
    client = VllmHttpClient(server.url, versions, checkpoint, version=1)
    client.serve(0)  # the base weights, labelled 0, for a fresh run
    job = out / "job.json"
    out.mkdir(parents=True)
    job.write_text(json.dumps(_job(checkpoint, prompts, out, server.url, steps,
                                   max_off_policy, shape), indent=1))
    with (out / "console.log").open("w") as log:
        code = subprocess.run([sys.executable, "-m", "vlmcp", "rl", str(job)], stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code:
        said = [line for line in (out / "console.log").read_text(errors="replace").splitlines()
                if line.startswith("error: ")]
        raise ValueError(f"--rl: vlmcp rl {job} failed (exit {code}): "
                         + (" | ".join(said) or "see its console, kept in --scratch"))
    orchestrator = {r["step"]: r for r in _rows(out / "out" / "rl" / "metrics.jsonl")
                    if "step" in r}
    trainer = {r["step"]: r for r in _rows(out / "out" / "metrics.jsonl")
               if "step_time_s" in r}
    pushes = {r["step"]: r for r in _rows(out / "out" / "metrics.jsonl") if "push_s" in r}
    later = range(2, steps + 1)
    values = {"step_s": [orchestrator[s]["step_s"] for s in later],
              "generate_s": [orchestrator[s]["fill_s"] for s in later],
              "score_s": [orchestrator[s]["reward_s"] for s in later],
              "train_s": [trainer[s]["step_time_s"] for s in later],
              "push_s": [pushes[s]["push_s"] for s in later if s in pushes],
              "push_downtime_s": [pushes[s].get("push_downtime_s", 0.0) for s in later
                                  if s in pushes],
              "wait_weights_s": [orchestrator[s]["wait_weights_s"] for s in later],
              "wait_rollouts_s": [trainer[s].get("rollout_wait_s", 0.0) for s in later]}
    return {part: statistics.median(v) if v else 0.0 for part, v in values.items()}


def _spread(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {part: {"min": min(r[part] for r in runs),
                   "median": statistics.median(r[part] for r in runs),
                   "max": max(r[part] for r in runs)} for part in PARTS}


def run_rl_loop_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The `--rl` report (see the module docstring)."""
    python = engine_python()
    if python is None:
        raise ValueError(f"--rl needs the engine venv: {missing_engine(named_engine_python())}")
    steps, repeats = max(args.steps, MIN_STEPS), args.repeats
    report: dict[str, Any] = {"mode": "rl_loop", "steps": steps, "repeats": repeats,
                              "max_new_tokens": NEW_TOKENS, "models": []}
    with scratch_folder(args.scratch, "vlmcp-bench-rl-") as scratch:
        _, eval_jsonl = write_digits_dataset(scratch / "digits", n_train=1, n_eval=64, seed=0)
        for name, shape in (("demo", {**DEMO_MODEL, **VLLM_CPU_HEADS}), ("large", LARGE)):
            checkpoint = build_tiny_checkpoint(scratch / name / "checkpoint", seed=0, **shape)
            size_gb = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")) / 2**30
            server = VllmServer(python, checkpoint, scratch / name / "engine.log",
                                args=(*CPU_ARGS, *PUSH_ARGS, "--max-model-len", "256", "--seed",
                                      "0"))
            start_s = server.start()
            runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            try:
                for repeat in range(repeats):
                    for mode, k in MODES.items():
                        out = scratch / name / f"{mode}_{repeat}"
                        runs[mode].append(_run(checkpoint, eval_jsonl, out, server, steps, k,
                                               SHAPES[name]))
                        logger.info("--rl %s, %s, run %d: %s", name, mode, repeat,
                                    json.dumps(runs[mode][-1]))
            finally:
                server.stop()
            entry = {"model": name, "checkpoint_gb_fp32": round(size_gb, 2),
                     "prompts_per_step": SHAPES[name][0], "group_size": SHAPES[name][1],
                     "engine_start_s": round(start_s, 1),
                     **{mode: _spread(runs[mode]) for mode in MODES}}
            entry["async_over_sync_step_s"] = (entry["async"]["step_s"]["median"]
                                               / entry["sync"]["step_s"]["median"])
            report["models"].append(entry)
            logger.info("--rl %s: step %.2f s sync, %.2f s async (%.2fx)", name,
                        entry["sync"]["step_s"]["median"], entry["async"]["step_s"]["median"],
                        entry["async_over_sync_step_s"])
    return report
