"""`vlmcp demo --rl`: the digits demo as a policy-gradient job, offline on CPU ranks.

vlmcp has no generation loop of its own, so the rollouts are enumerated: every training prompt
(a digit image and "What digit is this?") gets `candidates` answers, the correct digit and
distinct wrong ones drawn at random. The reward is 1 for the correct digit and 0 otherwise; the
advantage of each answer is group-relative, as in GRPO: (reward - the group's mean reward) / the
group's standard deviation, so with 4 candidates +1.73 for the correct answer and -0.58 for each
wrong one. Each answer becomes one tokens-format line whose per-token "advantages" hold that
value on the answer's target tokens (the digit and <|im_end|>) and null elsewhere
(OUT/assets/digits/rl_train.jsonl, next to the images). The job trains with `loss.type`
policy_gradient (-A log pi per target token), and held-out accuracy is measured the way the CE
demo measures it, by greedy generation on the held-out digits (`eval_accuracy`).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vlmcp.data.formats import parse_record
from vlmcp.data.processor import load_processor
from vlmcp.demo import DEMO_MODEL, demo_job
from vlmcp.demo_assets import build_tiny_checkpoint, write_digits_dataset
from vlmcp.parallel import comm
from vlmcp.training.metrics import read_metrics

DIGITS = [str(d) for d in range(10)]


def group_advantages(rewards: list[float]) -> list[float]:
    """(reward - mean) / population std of one prompt's group; all zero when the std is 0."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


def write_rl_dataset(digits_jsonl: Path, checkpoint: Path, out_path: Path, candidates: int = 4,
                     seed: int = 0) -> int:
    """Write the tokens-format policy-gradient dataset of the digits prompts (see the module
    docstring) next to `digits_jsonl`; returns its number of lines."""
    if not 2 <= candidates <= len(DIGITS):
        raise ValueError(f"candidates must be in [2, 10], got {candidates}")
    processor = load_processor(checkpoint)
    rng = random.Random(seed)
    lines = []
    for number, text in enumerate(digits_jsonl.read_text().splitlines(), start=1):
        record = json.loads(text)
        user, answer = record["messages"]
        correct = answer["content"]
        answers = [correct] + rng.sample([d for d in DIGITS if d != correct], candidates - 1)
        advantages = group_advantages([float(a == correct) for a in answers])
        for reply, advantage in zip(answers, advantages):
            chat = {"messages": [user, {"role": "assistant", "content": reply}],
                    "images": record["images"]}
            sample = parse_record(chat, f"{digits_jsonl}:{number}", digits_jsonl.parent,
                                  processor, max_seq_len=10**6)
            lines.append({"input_ids": sample.input_ids, "labels": sample.labels,
                          "images": record["images"],
                          "advantages": [None if label == -100 else advantage
                                         for label in sample.labels]})
    rng.shuffle(lines)
    out_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def rl_job(assets_dir: Path, out_dir: Path, sp_size: int) -> dict[str, Any]:
    """The demo job, trained on the RL dataset with policy_gradient (paths relative to out_dir)."""
    job = demo_job(assets_dir, out_dir, sp_size)
    job["data"]["train"] = os.path.relpath(assets_dir / "digits" / "rl_train.jsonl", out_dir)
    job["loss"] = {"type": "policy_gradient", "normalize": "token"}
    job["train"].update({"max_steps": 200, "eval_every": 50})
    job["scheduler"]["warmup_steps"] = 20
    return job


def run_rl_demo(out_dir: str | Path = "runs/demo", nproc: int = 2, sp_size: int = 2,
                steps: int | None = None, overrides: list[str] | tuple[str, ...] = (),
                candidates: int = 4) -> int:
    """Build the assets and the RL dataset, train OUT/rl with policy_gradient, print the held-out
    accuracy; returns the process exit code (training's, else 0)."""
    out = Path(out_dir).resolve()
    assets = out / "assets"
    started = time.perf_counter()
    checkpoint = build_tiny_checkpoint(assets / "checkpoint", moe=False, seed=0, **DEMO_MODEL)
    train_jsonl, _ = write_digits_dataset(assets / "digits", seed=0)
    count = write_rl_dataset(train_jsonl, checkpoint, assets / "digits" / "rl_train.jsonl",
                             candidates=candidates)
    run_dir = out / "rl"
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps(rl_job(assets, run_dir, sp_size), indent=2) + "\n")
    print(f"rl demo: {count} scored answers ({candidates} per prompt) in "
          f"{assets / 'digits' / 'rl_train.jsonl'} ({time.perf_counter() - started:.1f} s)",
          flush=True)
    sets = [*(["--set", f"train.max_steps={steps}"] if steps else []),
            *(arg for item in overrides for arg in ("--set", item))]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(comm.free_local_port()),
               "-m", "vlmcp", "train", str(job_path), *sets]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    train_started = time.perf_counter()
    returncode = subprocess.run(command, env=env, check=False).returncode
    if returncode:
        print(f"rl demo: training failed (exit {returncode})", file=sys.stderr)
        return returncode
    rows = read_metrics(run_dir / "metrics.jsonl")
    accuracy = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    print(f"rl demo: held-out accuracy by step {accuracy}; training took "
          f"{time.perf_counter() - train_started:.0f} s on {nproc} ranks (sp_size {sp_size}); "
          f"metrics {run_dir / 'metrics.jsonl'}", flush=True)
    return 0
