"""`vlmcp bench --publish`: what publishing the weights costs the training, three ways.

One fresh world of `--sp-size` ranks (default 2) trains a tiny-architecture Qwen3.5 scaled up in
width (`--hidden-size`, default 2048, with `--intermediate-size`, default 4 x hidden: about
0.8 GB of fp32 weights at 4 layers) under ZeRO-3 (`--publish-zero`) with SGD on a few 64-token
samples, and after each step publishes its weights, in turn:

    serial       publish.sharded false: rank 0 gathers the whole model and writes it with
                 save_pretrained while the others wait (the publish before rank-parallel shards)
    parallel     publish.sharded, background false: every rank writes its own shard
    background   publish.sharded and background: each rank's publish thread copies its part
                 off the live model, gathers (ZeRO-3) and writes while the next steps train (they
                 run until the step is in place; the first one's optimizer step waits for the
                 copy)

For each, `--repeats` times (interleaved, after one untimed round, which allocates the background
way's staging buffers as a run's first publish does): `critical_s`, the time the training waited
(the slowest rank's `publish_s`: its time in `Publisher.publish` and, for the background way, in
the fences of the steps after it, where an optimizer step waits for the rank's copy off the live
model; what the steps grow by), `fence_wait_s` (the slowest rank's part of that in the fences; 0
for the synchronous ways), `total_s` (until step_N was in place, rank 0), and rank 0's resident
set: `rank0_peak_rss_mb` (VmHWM, reset right before the publish, read when `publish` returns for
the synchronous ways, and once the step is in place for the background way, so that one also
holds the training steps that ran meanwhile) and `rank0_rss_before_mb`, and their difference
`rank0_rss_increase_mb` (what the publish added; the allocator may reuse memory the training
already holds, so small publishes add little; the background way's host buffers, its share and
under ZeRO-3 its partitions of the other ranks' tensors, are resident before it starts, in
`rank0_rss_before_mb`; the three ways share one world, so every way's resident set holds the
background way's buffers from the first round on), `rank0_host_buffers_mb` (the host buffers the
way's publisher keeps for the run: none for the synchronous ways) and, for reference,
`rank0_step_rss_increase_mb` (what a training step adds with no publish in flight, measured on
the step after: the background way's window holds such a step). Each value is given as min /
median / max over the repeats; the ratios compare medians with the serial way's. The weights'
bytes are those of the published files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmcp.bench.jobs import published_after, scratch_folder, short_job, started_run
from vlmcp.bench.procs import Memory, run_fresh
from vlmcp.parallel import comm

#: The ways published, and the publish keys each sets.
WAYS = {"serial": {"sharded": False}, "parallel": {"sharded": True, "background": False},
        "background": {"sharded": True, "background": True}}
#: Width and vocabulary of the benched model unless --hidden-size, --vocab-size say otherwise.
DEFAULT_HIDDEN = 2048
DEFAULT_VOCAB = 512
_SAMPLES, _SAMPLE_LEN = 8, 32


def _tokens_data(path: Path) -> Path:
    """A few tokens-format samples of `_SAMPLE_LEN` tokens (half of each a target), of ids every
    tiny tokenizer has (its byte-level alphabet)."""
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(_SAMPLES):
        ids = torch.randint(8, 256, (_SAMPLE_LEN,), generator=generator).tolist()
        half = _SAMPLE_LEN // 2
        lines.append(json.dumps({"input_ids": ids, "labels": [-100] * half + ids[half:]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True)
class PublishTask:
    """One world: train and publish every way `repeats` times; returns rank 0's row."""

    job: dict
    scratch: str
    repeats: int

    def run(self, device: torch.device) -> dict[str, Any]:
        from vlmcp.training.loop import train_step
        from vlmcp.training.weights.publish import Publisher

        run, step = started_run(self.job)
        job = run.job
        memory = Memory(device)
        samples: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
        publishers = {way: Publisher(dataclasses.replace(job, publish=dataclasses.replace(
            job.publish, dir=str(Path(self.scratch, way)), **keys)), run.engine, run.module,
            start_step=step) for way, keys in WAYS.items()}
        weight_bytes = 0
        for repeat in range(self.repeats + 1):  # the first round warms the staging buffers
            for way, publisher in publishers.items():
                rss_before = memory.current_mb()
                memory.reset_peak()
                rows, after = published_after(run, publisher, step)
                steps_meanwhile, step = after - step, after
                peak = memory.peak_mb()
                slowest = torch.tensor([rows[0]["publish_s"],
                                        rows[0].get("publish_fence_wait_s", 0.0)],
                                       dtype=torch.float64)
                comm.all_reduce_max(slowest)
                if comm.rank() == 0:
                    weight_bytes = rows[0]["publish_bytes"]
                    shutil.rmtree(rows[0]["published"], ignore_errors=True)
                comm.barrier()
                step_before = memory.current_mb()
                memory.reset_peak()
                train_step(run, step)  # the next publish is of other weights
                step += 1
                if comm.rank() == 0 and repeat:
                    samples[way].append({
                        "critical_s": float(slowest[0]), "fence_wait_s": float(slowest[1]),
                        "total_s": rows[0]["publish_total_s"], "rank0_peak_rss_mb": peak,
                        "rank0_rss_before_mb": rss_before,
                        "rank0_rss_increase_mb": peak - rss_before,
                        "rank0_host_buffers_mb": publisher.host_buffer_bytes / 2**20,
                        "rank0_step_rss_increase_mb": memory.peak_mb() - step_before,
                        "steps_meanwhile": steps_meanwhile})
        comm.shutdown()
        return {"published_bytes": weight_bytes, "ways": samples}


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


def _summary(ways: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    summary = {way: {key: _spread([s[key] for s in runs]) for key in runs[0]}
               for way, runs in ways.items()}
    serial = summary["serial"]

    def ratio(way: str, key: str) -> float | None:
        # None where the serial way measured 0 (a tiny model's RSS rise can round to 0 MB)
        base = serial[key]["median"]
        return round(summary[way][key]["median"] / base, 3) if base else None

    summary["ratios"] = {
        "background_critical_vs_serial": ratio("background", "critical_s"),
        "parallel_total_vs_serial": ratio("parallel", "total_s"),
        "background_total_vs_serial": ratio("background", "total_s"),
        "parallel_rank0_peak_rss_vs_serial": ratio("parallel", "rank0_peak_rss_mb"),
        "background_rank0_peak_rss_vs_serial": ratio("background", "rank0_peak_rss_mb"),
        "parallel_rank0_rss_increase_vs_serial": ratio("parallel", "rank0_rss_increase_mb"),
        "background_rank0_rss_increase_vs_serial": ratio("background",
                                                         "rank0_rss_increase_mb")}
    return summary


def run_publish_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The `--publish` report (see the module docstring)."""
    from vlmcp.model.tiny import build_tiny_checkpoint

    world = args.sp_size or 2
    hidden = args.hidden_size or DEFAULT_HIDDEN
    intermediate = args.intermediate_size or 4 * hidden
    vocab = args.vocab_size or DEFAULT_VOCAB
    with scratch_folder(args.scratch, "vlmcp-bench-publish-") as root:
        model_dir = build_tiny_checkpoint(root / "model", vocab_size=vocab,
                                          hidden_size=hidden, intermediate_size=intermediate)
        job = short_job({"path": str(model_dir), "dtype": args.dtype},
                        {"train": str(_tokens_data(root / "train.jsonl")),
                         "max_seq_len": 2 * _SAMPLE_LEN, "num_workers": 0},
                        root / "out", 10_000, lr=1e-4, zero_stage=args.publish_zero,
                        publish={"dir": str(root / "unused")})
        row = run_fresh(PublishTask(job, str(root), args.repeats), world, distributed=False)
    return {"mode": "publish", "world": world, "zero_stage": args.publish_zero,
            "model": f"tiny dense Qwen3.5, hidden {hidden}, intermediate {intermediate}, "
                     f"4 layers, vocab {vocab} (random init)",
            "dtype": args.dtype, "published_bytes": row["published_bytes"],
            "repeats": args.repeats, **_summary(row["ways"]), "runs": row["ways"]}
