"""`make demo` / `vlmcp demo`: the whole pipeline offline, on 2 CPU ranks, in a few minutes.

1. Build the assets (`vlmcp.demo.assets`): scikit-learn's bundled digits as 32x32 PNGs with a
   messages-format JSONL ("<image>What digit is this?" -> "7") and a held-out split, a tiny
   byte-level BPE tokenizer, and a tiny random-init Qwen3.5 checkpoint in the published layout.
2. Write OUT/job.json and train it with `torchrun --nproc_per_node 2 -m vlmcp train` (sequence
   parallel size 2 by default: every pack is split over both ranks).
3. Held-out accuracy by greedy generation is measured during training (eval rows of
   OUT/metrics.jsonl carry `eval_accuracy`); the loss and accuracy curves go to
   OUT/loss_accuracy.png.

Exits non-zero when training fails or the final held-out accuracy is below 90 %.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmcp.demo.assets import write_digits_dataset
from vlmcp.model.tiny import build_tiny_checkpoint
from vlmcp.parallel import comm
from vlmcp.training.metrics import read_metrics

logger = logging.getLogger(__name__)

TARGET_ACCURACY = 0.90

#: The demo model: the tiny Qwen3.5 layout (3 DeltaNet + 1 full-attention layer per 4), wider.
DEMO_MODEL = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32}


def demo_job(assets_dir: Path, out_dir: Path, sp_size: int, *, data: str = "digits",
             lr: float = 2e-3, max_steps: int = 300, eval_every: int = 50) -> dict[str, Any]:
    """The demo's job on `assets_dir/data/{train,eval}.jsonl`: paths relative to the job file,
    which lives in `out_dir`."""
    return {
        "model": {"path": os.path.relpath(assets_dir / "checkpoint", out_dir),
                  "dtype": "float32", "freeze_vision": True},
        "data": {"train": os.path.relpath(assets_dir / data / "train.jsonl", out_dir),
                 "eval": os.path.relpath(assets_dir / data / "eval.jsonl", out_dir),
                 "max_seq_len": 512, "shuffle": True},
        "parallel": {"sp_size": sp_size},
        "optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.0, "betas": [0.9, 0.98]},
        "scheduler": {"type": "cosine", "warmup_steps": 50, "min_lr_ratio": 0.05},
        "train": {"max_steps": max_steps, "seed": 0, "grad_clip": 1.0, "grad_accum": 1,
                  "save_every": 0, "eval_every": eval_every},
        "eval": {"generate": True, "max_new_tokens": 4},
        "deepspeed": {"zero_optimization": {"stage": 0}},
        "output_dir": str(out_dir),
    }


def plot_metrics(rows: Sequence[dict[str, Any]], path: Path,
                 title: str = "vlmcp demo: digits VQA, tiny Qwen3.5",
                 target: float = TARGET_ACCURACY) -> Path:
    """Training loss, held-out loss and held-out accuracy against the step, as a PNG, with the
    `target` accuracy marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    fig, loss_ax = plt.subplots(figsize=(8, 4.5))
    loss_ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows],
                 color="tab:blue", alpha=0.7, label="train loss")
    loss_ax.plot([r["step"] for r in eval_rows], [r["eval_loss"] for r in eval_rows],
                 color="tab:blue", marker="o", linestyle="--", label="held-out loss")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("cross-entropy per target token")
    loss_ax.set_yscale("log")
    acc_rows = [r for r in eval_rows if "eval_accuracy" in r]
    acc_ax = loss_ax.twinx()
    acc_ax.plot([r["step"] for r in acc_rows], [100 * r["eval_accuracy"] for r in acc_rows],
                color="tab:red", marker="s", label="held-out accuracy")
    acc_ax.axhline(100 * target, color="tab:red", alpha=0.3, linestyle=":")
    acc_ax.set_ylabel("held-out accuracy (%)")
    acc_ax.set_ylim(0, 100)
    handles = loss_ax.get_legend_handles_labels()[0] + acc_ax.get_legend_handles_labels()[0]
    loss_ax.legend(handles=handles, loc="center right")
    loss_ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def torchrun_command(nproc: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of `vlmcp ARGS` under torchrun on `nproc` local CPU ranks, one
    thread each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(comm.free_local_port()),
               "-m", "vlmcp", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    return command, env


def train_and_report(out: Path, job: dict[str, Any], nproc: int, sp_size: int,
                     steps: int | None, overrides: Sequence[str], build_s: float, *,
                     target: float, title: str) -> int:
    """Write `job` to OUT/job.json, train it with torchrun on `nproc` CPU ranks, plot the
    metrics and print the final held-out accuracy; the exit code (1 below `target`)."""
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job, indent=2) + "\n")
    sets = [*(["--set", f"train.max_steps={steps}"] if steps else []),
            *(arg for item in overrides for arg in ("--set", item))]
    command, env = torchrun_command(nproc, ["train", str(job_path), *sets])
    print(f"demo: assets in {out / 'assets'} ({build_s:.1f} s); training: {' '.join(command)}",
          flush=True)
    train_started = time.perf_counter()
    returncode = subprocess.run(command, env=env, check=False).returncode
    train_s = time.perf_counter() - train_started
    if returncode:
        print(f"demo: training failed (exit {returncode})", file=sys.stderr)
        return returncode
    rows = read_metrics(out / "metrics.jsonl")
    plot = plot_metrics(rows, out / "loss_accuracy.png", title=title, target=target)
    accuracy = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    final = accuracy[-1] if accuracy else 0.0
    print(f"demo: held-out accuracy {100 * final:.1f} % after {rows[-1]['step']} steps; "
          f"training took {train_s:.0f} s on {nproc} ranks (sp_size {sp_size}); "
          f"metrics {out / 'metrics.jsonl'}, plot {plot}, model {out / 'final'}", flush=True)
    if final < target:
        print(f"demo: accuracy below the {100 * target:.0f} % target", file=sys.stderr)
        return 1
    return 0


def run_demo(out_dir: str | Path = "runs/demo", nproc: int = 2, sp_size: int = 2,
             steps: int | None = None, overrides: Sequence[str] = ()) -> int:
    """Build, train, evaluate and plot; returns the process exit code."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build_tiny_checkpoint(out / "assets" / "checkpoint", moe=False, seed=0, **DEMO_MODEL)
    write_digits_dataset(out / "assets" / "digits", seed=0)
    return train_and_report(out, demo_job(out / "assets", out, sp_size), nproc, sp_size, steps,
                            overrides, time.perf_counter() - started, target=TARGET_ACCURACY,
                            title="vlmcp demo: digits VQA, tiny Qwen3.5")
