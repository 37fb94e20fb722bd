"""`vlmcp bench --rollout-rss P1,P2,...`: does a rank's memory grow with a rollout step's size?

For each P, a rollout directory of `--steps` steps (default 3) is written, each of P chat samples
with one `--rollout-image-size` PNG (default 512x512: 1,024 vision patches, 6 MiB of fp32
pixels per sample), and `data.max_seq_len` is set so that every sample is a pack of its own: P
image packs per step. The same rollout job (tiny model, DP 1, one rank, ZeRO-0, SGD, `ce`) trains
every step in a fresh process, so that each peak belongs to its P. A rank that held a step's packs
whole would peak about P x `pack_pixel_mb` above the model (twice that while the next step
loads); one that streams them holds about (`--data-workers` x `data.prefetch_factor` + 1) packs
whatever P (`window_packs`). Each row reports the rank's peak resident set (VmHWM; the loader
workers are processes of their own), the train wall time, and `peak_rss_ratio` against the first
P's peak.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmcp.bench.data_scale import write_synthetic_dataset
from vlmcp.bench.jobs import scratch_folder, short_job, timed_training
from vlmcp.bench.procs import Memory, run_fresh
from vlmcp.data.rollouts import STABLE, step_dir

#: fp32 bytes of one vision patch (3 channels x 2 frames x 16 x 16).
_PATCH_BYTES = 3 * 2 * 16 * 16 * 4
#: data.prefetch_factor of the job (vlmcp's default).
_PREFETCH = 2


@dataclass(frozen=True)
class RolloutRssTask:
    """One training run of the rollout job at `job_path` (one rank); returns its row."""

    job_path: str
    packs: int

    def run(self, device: torch.device) -> dict[str, Any]:
        from vlmcp.parallel import comm

        run, seconds = timed_training(self.job_path)
        peak = Memory(device).peak_mb()
        comm.shutdown()
        return {"packs_per_step": self.packs, "steps": run.job.train.max_steps,
                "peak_rss_mb": round(peak, 1), "run_s": round(seconds, 1)}


def _write_steps(rollouts: Path, steps: int, packs: int, image_size: int) -> None:
    """`steps` complete rollout steps of `packs` one-image samples each."""
    for number in range(1, steps + 1):
        path = step_dir(rollouts, number)
        write_synthetic_dataset(path, packs, image_size)
        (path / STABLE).write_text("")


def _sample_shape(model_dir: Path, rollouts: Path) -> tuple[int, int]:
    """(tokens, vision patches) of the first sample of step_1 (all samples are alike)."""
    from vlmcp.data.index import build_index
    from vlmcp.data.processor import load_processor
    from vlmcp.data.rollouts import step_files

    index, problems = build_index(step_files(step_dir(rollouts, 1)), load_processor(model_dir),
                                  max_seq_len=10**6)
    if problems:
        raise ValueError(f"--rollout-rss: the synthetic samples do not index: {problems[0]}")
    return int(index.tokens[0]), int(index.patches[0])


def _job(model_dir: Path, rollouts: Path, out: Path, max_seq_len: int, steps: int,
         workers: int) -> dict:
    return short_job({"path": str(model_dir)},
                     {"max_seq_len": max_seq_len, "num_workers": workers,
                      "prefetch_factor": _PREFETCH},
                     out, steps, rollouts={"dir": str(rollouts), "timeout_s": 60, "poll_s": 0.1})


def run_rollout_rss(args: argparse.Namespace) -> dict[str, Any]:
    """The `--rollout-rss` report: one run per step size, each in a fresh process."""
    from vlmcp.model.tiny import build_tiny_checkpoint

    sizes = [int(n) for n in args.rollout_rss.split(",")]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--rollout-rss: pack counts must be >= 1, got {args.rollout_rss}")
    steps = args.steps
    rows = []
    with scratch_folder(args.scratch, "vlmcp-rollout-rss-") as root:
        model_dir = build_tiny_checkpoint(root / "model", moe=False, seed=0)
        shape = None
        for packs in sizes:
            rollouts = root / f"rollouts-{packs}"
            _write_steps(rollouts, steps, packs, args.rollout_image_size)
            shape = shape or _sample_shape(model_dir, rollouts)
            job = root / f"job-{packs}.json"
            job.write_text(json.dumps(_job(model_dir, rollouts, root / f"out-{packs}",
                                           shape[0] + 1, steps, args.data_workers)))
            rows.append(run_fresh(RolloutRssTask(str(job), packs), 1, distributed=False))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["peak_rss_mb"]
    for row in rows:
        row["peak_rss_ratio"] = round(row["peak_rss_mb"] / base, 3)
    pack_mb = shape[1] * _PATCH_BYTES / 2**20
    return {"mode": "rollout_rss", "dp_size": 1, "image_size": args.rollout_image_size,
            "sample_tokens": shape[0], "sample_patches": shape[1],
            "pack_pixel_mb": round(pack_mb, 2), "num_workers": args.data_workers,
            "prefetch_factor": _PREFETCH,
            "window_packs": max(args.data_workers, 1) * _PREFETCH + 1,
            "results": rows}
