"""`vlmcp demo --rl`: an online RL loop on CPU, offline, in separate processes (docs/demo.md).

1. Assets: the digits dataset, and the tiny Qwen3.5 checkpoint of `vlmcp demo` with head sizes
   vLLM's CPU kernels accept (`VLLM_CPU_HEADS`), the same for both engines.
2. A short warm start (`vlmcp train`, CE on the digit answers for `SFT_STEPS` steps, SP 2): the
   policy learns the answer format and gets part of the way; RL starts from its OUT/rl/sft/final.
3. The loop. `vlmcp train` (SP 2 on 2 ranks, torchrun) trains ppo_clip (the inference logprobs
   as the old policy's) on rollouts.dir, one optimizer step per rollout step, and after every
   step pushes its weights into the vLLM server (publish.engines, the default with `--engine
   vllm`; the directory is written after the last step only) or publishes them to OUT/rl/weights
   (`--weights files`, and always with transformers). This process is the orchestrator
   (`vlmcp.demo.orchestrator`): it samples answers from the newest weights (with transformers in
   this process, or a vLLM server: `vlmcp.demo.vllm_policy`), rewards and group-relative advantages, and writes
   rollout step N+1 while the trainer trains step N (one step off-policy,
   `rollouts.max_staleness` 1). It measures the held-out greedy accuracy of every policy version
   it loads.
4. The report: accuracy by policy version, the policy lag of every step, and where the time went
   (generation and evaluation here; the trainer's step time, its wait for rollouts and its
   publishing), also in OUT/rl/summary.json. The exit code is non-zero when a launch failed or the
   final accuracy is below `TARGET_ACCURACY`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vlmcp.data.processor import load_processor
from vlmcp.demo.assets import write_digits_dataset
from vlmcp.demo.image import DEMO_MODEL, demo_job, torchrun_command
from vlmcp.demo.orchestrator import Orchestrator, Policy, load_prompts
from vlmcp.engine.venv import engine_python, missing_engine, named_engine_python
from vlmcp.errors import EngineError
from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint
from vlmcp.training.metrics import read_metrics

#: The demo fails below this final held-out accuracy (docs/demo.md: 91.6 % measured with the
#: earlier checkpoint of DeltaNet heads of 16 and a 25-step warm start from 43.8 %).
TARGET_ACCURACY = 0.80
#: CE warm-start steps. With the engine-compatible checkpoint (`VLLM_CPU_HEADS`) held-out
#: accuracy after 25 / 30 / 35 steps was 26.6 / 35.0 / 63.0 % (docs/demo.md): 30 starts RL about
#: where the earlier checkpoint's 25 did, short of what CE alone reaches soon after.
SFT_STEPS = 30
#: Tokens per warm-start pack: about 42 digit samples.
SFT_MAX_SEQ_LEN = 768
RL_STEPS = 60
PROMPTS_PER_STEP = 32
GROUP = 16
RL_LR = 5e-4
#: A fresh AdamW's first updates are lr-sized whatever the gradient: warm the rate up.
RL_WARMUP = 5


def _torchrun(nproc: int, args: list[str], log: Path) -> subprocess.Popen:
    command, env = torchrun_command(nproc, args)
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def sft_job(assets: Path, out_dir: Path, sp_size: int, steps: int) -> dict[str, Any]:
    """The warm start: the CE demo job, `steps` steps at a constant rate, no evaluation."""
    job = demo_job(assets, out_dir, sp_size)
    job["data"].pop("eval")
    job["scheduler"] = {"type": "constant", "warmup_steps": 0}
    job["data"]["max_seq_len"] = SFT_MAX_SEQ_LEN
    job["train"].update({"max_steps": steps, "eval_every": 0})
    job["eval"] = {"generate": False}
    return job


def rl_job(assets: Path, out_dir: Path, sp_size: int, steps: int, start: Path,
           engine_url: str | None = None) -> dict[str, Any]:
    """The RL trainer's job: rollouts in from OUT/rl/rollouts, weights out to OUT/rl/weights,
    or with `engine_url` pushed into that vLLM server after every step (bf16 on the wire, the
    server's dtype) and written to OUT/rl/weights after the last step only."""
    job = sft_job(assets, out_dir, sp_size, steps)
    job["model"]["path"] = os.path.relpath(start, out_dir)
    job["data"] = {"max_seq_len": 1024, "num_workers": 0}
    job["loss"] = {"type": "ppo_clip", "normalize": "token", "clip_low": 0.2, "clip_high": 0.2}
    job["optimizer"]["lr"] = RL_LR
    job["scheduler"] = {"type": "constant", "warmup_steps": RL_WARMUP}
    job["rollouts"] = {"dir": str(out_dir / "rollouts"), "timeout_s": 300.0, "poll_s": 0.05,
                       "max_staleness": 1}
    job["publish"] = {"dir": str(out_dir / "weights"), "every": 1, "keep": 3}
    if engine_url is not None:
        job["publish"].update(engines=[engine_url], dir_every=steps, push_dtype="bfloat16")
    return job


def _write(path: Path, job: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job, indent=2) + "\n")
    return path


def _time_split(trainer_rows: list[dict[str, Any]], reports: list[Any], eval_s: float,
                wall_s: float) -> dict[str, float]:
    train = [r for r in trainer_rows if "step_time_s" in r or "skipped_rollout" in r]
    return {"orchestrator_generate_s": sum(r.generate_s for r in reports),
            "orchestrator_reload_s": sum(r.reload_s for r in reports),
            "orchestrator_eval_s": eval_s,
            "orchestrator_wait_for_weights_s": sum(r.wait_s for r in reports),
            "trainer_train_s": sum(r.get("step_time_s", 0.0) for r in train),
            "trainer_wait_for_rollouts_s": sum(r.get("rollout_wait_s", 0.0) for r in train),
            "trainer_publish_s": sum(r["publish_s"] for r in trainer_rows if "publish_s" in r),
            "engine_push_downtime_s": sum(r.get("push_downtime_s", 0.0) for r in trainer_rows),
            "loop_wall_s": wall_s}


def choose_engine(engine: str) -> str:
    """"auto": vllm where the engine venv exists (`make engine`), else transformers."""
    if engine == "auto":
        return "vllm" if engine_python() is not None else "transformers"
    return engine


def _per_step(trainer_rows: list[dict[str, Any]], reports: list[Any]) -> dict[str, float]:
    """Mean seconds per RL step of each phase: generate, reload, trainer wait, train."""
    train = [r for r in trainer_rows if "step_time_s" in r]
    count = max(len(reports), 1)
    return {"generate": sum(r.generate_s for r in reports) / count,
            "reload": sum(r.reload_s for r in reports) / count,
            "trainer_wait": sum(r.get("rollout_wait_s", 0.0) for r in train) / max(len(train), 1),
            "train": sum(r["step_time_s"] for r in train) / max(len(train), 1)}


def run_rl_demo(out_dir: str | Path = "runs/demo", nproc: int = 2, sp_size: int = 2,
                steps: int | None = None, overrides: list[str] | tuple[str, ...] = (),
                engine: str = "auto", weights: str = "push") -> int:
    """Build the assets, warm-start, run the online loop (see the module docstring); returns the
    exit code. `steps`: RL steps (default RL_STEPS); `overrides` apply to the RL trainer's job;
    `engine`: "transformers", "vllm" (a vLLM server from the engine venv) or "auto"; `weights`:
    how a vLLM engine gets each step, "push" (the trainer pushes it, publish.engines) or "files"
    (published to OUT/rl/weights and reloaded from there; the transformers engine always)."""
    engine = choose_engine(engine)
    python = engine_python()
    if engine == "vllm" and python is None:
        print(f"rl demo: --engine vllm needs the engine venv: "
              f"{missing_engine(named_engine_python())}", file=sys.stderr)
        return 1
    out = Path(out_dir).resolve()
    assets, run_dir = out / "assets", out / "rl"
    started = time.perf_counter()
    # Head sizes vLLM's CPU kernels accept, for both engines (the same policy either way).
    checkpoint = build_tiny_checkpoint(assets / "checkpoint", moe=False, seed=0,
                                       **{**DEMO_MODEL, **VLLM_CPU_HEADS})
    train_jsonl, eval_jsonl = write_digits_dataset(assets / "digits", seed=0)
    sft_dir = run_dir / "sft"
    sft = _write(sft_dir / "job.json", sft_job(assets, sft_dir, sp_size, SFT_STEPS))
    print(f"rl demo: warm start, {SFT_STEPS} CE steps ({sft})", flush=True)
    returncode = _torchrun(nproc, ["train", str(sft)], sft_dir / "train.log").wait()
    if returncode:
        print(f"rl demo: the warm start failed (exit {returncode}, {sft_dir / 'train.log'})",
              file=sys.stderr)
        return returncode
    rl_steps = steps or RL_STEPS
    processor = load_processor(checkpoint)
    prompts, held_out = load_prompts(train_jsonl, processor), load_prompts(eval_jsonl, processor)
    pushed = engine == "vllm" and weights == "push"
    if engine == "vllm":
        from vlmcp.demo.vllm_policy import VllmPolicy

        policy = VllmPolicy(python, sft_dir / "final", run_dir / "weights", processor,
                            run_dir / "engine.log", pushed=pushed)
        print(f"rl demo: vLLM server on {sft_dir / 'final'} started in {policy.start_s:.0f} s "
              f"({run_dir / 'engine.log'})", flush=True)
    else:
        policy = Policy(sft_dir / "final", processor)
    job = _write(run_dir / "job.json", rl_job(assets, run_dir, sp_size, rl_steps,
                                              sft_dir / "final",
                                              policy.url if pushed else None))
    print(f"rl demo: engine {engine}, weights "
          f"{'pushed into it' if pushed else 'published to ' + str(run_dir / 'weights')}",
          flush=True)
    try:
        return _loop(policy, engine, job, run_dir, prompts, held_out, nproc, rl_steps, overrides,
                     started, pushed)
    finally:
        if engine == "vllm":
            policy.close()


def _loop(policy: Any, engine: str, job: Path, run_dir: Path, prompts: list, held_out: list,
          nproc: int, rl_steps: int, overrides: list[str] | tuple[str, ...], started: float,
          pushed: bool) -> int:
    """The online loop on a started policy, the report, the exit code."""
    accuracy: dict[int, float] = {}
    eval_s = 0.0

    def evaluate(current: Any) -> None:
        nonlocal eval_s
        t = time.perf_counter()
        accuracy[current.version] = current.accuracy(held_out)
        eval_s += time.perf_counter() - t
        print(f"rl demo: policy {current.version}: held-out accuracy "
              f"{100 * accuracy[current.version]:.1f} %", flush=True)

    evaluate(policy)
    loop_started = time.perf_counter()
    sets = [arg for item in overrides for arg in ("--set", item)]
    trainer = _torchrun(nproc, ["train", str(job), *sets], run_dir / "train.log")
    orchestrator = Orchestrator(policy, prompts, run_dir / "rollouts", run_dir / "weights",
                                prompts_per_step=PROMPTS_PER_STEP, group=GROUP)
    reports = []
    try:
        for number in range(1, rl_steps + 1):
            reports.append(orchestrator.step(number, lambda: trainer.poll() is None, evaluate))
            report = reports[-1]
            print(f"rl demo: wrote rollout step {number} from policy {report.policy_step} "
                  f"in {report.generate_s:.1f} s (mean reward {report.reward:.3f} over "
                  f"{report.prompts} prompts; "
                  f"{report.groups_kept} groups kept, {report.lines} distinct answers)",
                  flush=True)
        returncode = trainer.wait()
    except (RuntimeError, EngineError) as exc:
        returncode = trainer.wait()
        print(f"rl demo: {exc} (exit {returncode})", file=sys.stderr)
    finally:
        if trainer.poll() is None:  # this process failed or was interrupted: stop the trainer
            trainer.terminate()
            try:
                trainer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                trainer.kill()
    if returncode:
        print(f"rl demo: training failed (exit {returncode}, {run_dir / 'train.log'})",
              file=sys.stderr)
        return returncode or 1
    orchestrator.newest_policy(rl_steps, lambda: True)
    if policy.version not in accuracy:
        evaluate(policy)
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = {
        "accuracy_by_policy_step": {str(k): v for k, v in sorted(accuracy.items())},
        "engine": engine,
        "weights": "push" if pushed else "files",
        "policy_lag_by_step": {str(r["step"]): r.get("policy_lag") for r in rows
                               if "policy_lag" in r},
        "mismatch_kl_by_step": {str(r["step"]): r["mismatch_kl"] for r in rows
                                if "mismatch_kl" in r},
        "time_per_step_s": _per_step(rows, reports),
        "time_s": _time_split(rows, reports, eval_s, time.perf_counter() - loop_started),
        "total_s": time.perf_counter() - started,
        "target_accuracy": TARGET_ACCURACY,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    final = accuracy[policy.version]
    kl = list(summary["mismatch_kl_by_step"].values())
    if kl:
        print(f"rl demo: mismatch_kl per step (trainer against {engine}) mean {sum(kl) / len(kl):.2e}, "
              f"max {max(kl):.2e}", flush=True)
    print(f"rl demo: held-out accuracy {100 * accuracy[0]:.1f} % after the warm start, "
          f"{100 * final:.1f} % after {policy.version} RL steps; policy lag by step "
          f"{list(summary['policy_lag_by_step'].values())}; time "
          + ", ".join(f"{k} {v:.0f}" for k, v in summary["time_s"].items())
          + f"; {summary['total_s']:.0f} s in all; {run_dir / 'summary.json'}", flush=True)
    if final < TARGET_ACCURACY:
        print(f"rl demo: accuracy below the {100 * TARGET_ACCURACY:.0f} % target", file=sys.stderr)
        return 1
    return 0
