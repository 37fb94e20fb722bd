"""`vlmcp demo --rl`: the digits demo as a policy-gradient job, offline on CPU ranks.

vlmcp has no generation loop of its own, so the rollouts are enumerated: every training prompt
(a digit image and "What digit is this?") gets `candidates` answers (default 4), the correct
digit and distinct wrong ones drawn at random. The reward is 1 for the correct digit and 0
otherwise; the advantage of each answer is group-relative, as in GRPO: (reward - the group's mean
reward) / the group's standard deviation, so with 4 candidates +1.73 for the correct answer and
-0.58 for each wrong one (with all 10, +3 and -1/3; but then a 512-token pack holds only ~2.5
prompts, and the same steps see a quarter of the prompts). Each answer becomes one tokens-format line whose per-token "advantages"
hold that value on the answer's tokens and null elsewhere, except its closing <|im_end|>, which
gets the advantage only when it is positive (0 after a wrong digit: ending the turn is not the
mistake, and with answers enumerated rather than sampled from the policy, each digit is wrong far
more often than right, so the end-of-turn after it would otherwise be pushed down as often as up)
(OUT/assets/digits/rl_train.jsonl, next to the images). The job trains with `loss.type`
policy_gradient (-A log pi per target token). Held-out accuracy is measured twice: the way the
CE demo measures it, by greedy generation on the held-out digits (`eval_accuracy`), and by
`vlmcp score` on the trained policy over all 10 answers of every held-out prompt, counting a
prompt as right when its highest-logprob answer is the correct digit.
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
from vlmcp.demo.assets import write_digits_dataset
from vlmcp.demo.image import DEMO_MODEL, demo_job
from vlmcp.model.tiny import build_tiny_checkpoint
from vlmcp.parallel import comm
from vlmcp.training.metrics import read_metrics

DIGITS = [str(d) for d in range(10)]


def group_advantages(rewards: list[float]) -> list[float]:
    """(reward - mean) / population std of one prompt's group; all zero when the std is 0."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


def write_rl_dataset(digits_jsonl: Path, checkpoint: Path, out_path: Path, candidates: int = 10,
                     seed: int = 0, shuffle: bool = True) -> list[tuple[int, str, str]]:
    """Write the tokens-format policy-gradient dataset of the digits prompts (see the module
    docstring) next to `digits_jsonl`; returns (prompt line, answer, correct answer) per line."""
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
            targets = [t for t, label in enumerate(sample.labels) if label != -100]
            per_token: list[float | None] = [None] * len(sample.labels)
            for t in targets:
                per_token[t] = advantage
            per_token[targets[-1]] = max(advantage, 0.0)
            line = {"input_ids": sample.input_ids, "labels": sample.labels,
                    "images": record["images"], "advantages": per_token}
            lines.append(((number, reply, correct), line))
    if shuffle:
        rng.shuffle(lines)
    out_path.write_text("".join(json.dumps(line) + "\n" for _, line in lines))
    return [meta for meta, _ in lines]


def choice_accuracy(meta: list[tuple[int, str, str]], scores: Path) -> float:
    """Fraction of prompts whose highest-logprob answer (the sum of its target tokens' logprobs,
    from `vlmcp score` over every candidate line) is the correct digit."""
    best: dict[int, tuple[float, bool]] = {}
    with scores.open() as handle:
        for text in handle:
            record = json.loads(text)
            prompt, answer, correct = meta[record["index"]]
            logprob = sum(record["logprobs"])
            if prompt not in best or logprob > best[prompt][0]:
                best[prompt] = (logprob, answer == correct)
    return sum(right for _, right in best.values()) / max(len(best), 1)


def rl_job(assets_dir: Path, out_dir: Path, sp_size: int) -> dict[str, Any]:
    """The demo job, trained on the RL dataset with policy_gradient (paths relative to out_dir)."""
    job = demo_job(assets_dir, out_dir, sp_size)
    job["data"]["train"] = os.path.relpath(assets_dir / "digits" / "rl_train.jsonl", out_dir)
    job["loss"] = {"type": "policy_gradient", "normalize": "token"}
    job["train"].update({"max_steps": 500, "eval_every": 250})
    return job


def _torchrun(nproc: int, args: list[str]) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(comm.free_local_port()),
               "-m", "vlmcp", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, env=env, check=False).returncode


def run_rl_demo(out_dir: str | Path = "runs/demo", nproc: int = 2, sp_size: int = 2,
                steps: int | None = None, overrides: list[str] | tuple[str, ...] = (),
                candidates: int = 4) -> int:
    """Build the assets and the RL dataset, train OUT/rl with policy_gradient, then measure the
    held-out accuracy twice: greedy generation (eval rows of OUT/rl/metrics.jsonl) and the
    choice of the highest-logprob digit answer by `vlmcp score` on the trained policy. Returns
    the exit code of the first launch that failed, else 0."""
    out = Path(out_dir).resolve()
    assets = out / "assets"
    started = time.perf_counter()
    checkpoint = build_tiny_checkpoint(assets / "checkpoint", moe=False, seed=0, **DEMO_MODEL)
    train_jsonl, eval_jsonl = write_digits_dataset(assets / "digits", seed=0)
    count = len(write_rl_dataset(train_jsonl, checkpoint, assets / "digits" / "rl_train.jsonl",
                                 candidates=candidates))
    choices = write_rl_dataset(eval_jsonl, checkpoint, assets / "digits" / "rl_eval_choices.jsonl",
                               shuffle=False)
    run_dir = out / "rl"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = rl_job(assets, run_dir, sp_size)
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2) + "\n")
    print(f"rl demo: {count} scored answers ({candidates} per prompt) in "
          f"{assets / 'digits' / 'rl_train.jsonl'} ({time.perf_counter() - started:.1f} s)",
          flush=True)
    sets = [*(["--set", f"train.max_steps={steps}"] if steps else []),
            *(arg for item in overrides for arg in ("--set", item))]
    train_started = time.perf_counter()
    returncode = _torchrun(nproc, ["train", str(job_path), *sets])
    if returncode:
        print(f"rl demo: training failed (exit {returncode})", file=sys.stderr)
        return returncode
    train_s = time.perf_counter() - train_started
    score_sets = ["--set", "model.path=final", "--set",
                  f"data.train={os.path.relpath(assets / 'digits' / 'rl_eval_choices.jsonl', run_dir)}",
                  "--set", "train.eval_every=0", "--set", "eval.generate=false",
                  "--set", "loss.type=ce"]
    scores = run_dir / "eval_choice_scores.jsonl"
    returncode = _torchrun(nproc, ["score", str(job_path), *score_sets, "--out", str(scores)])
    if returncode:
        print(f"rl demo: scoring failed (exit {returncode})", file=sys.stderr)
        return returncode
    rows = read_metrics(run_dir / "metrics.jsonl")
    accuracy = [(r["step"], round(r["eval_accuracy"], 4)) for r in rows if "eval_accuracy" in r]
    print(f"rl demo: held-out accuracy by greedy generation, by step: {accuracy}; by the "
          f"highest-logprob digit answer (vlmcp score): {choice_accuracy(choices, scores):.4f}; "
          f"training took {train_s:.0f} s on {nproc} ranks (sp_size {sp_size}); "
          f"metrics {run_dir / 'metrics.jsonl'}", flush=True)
    return 0
