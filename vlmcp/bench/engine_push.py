"""`vlmcp bench --engine-push`: a published step into a running vLLM, pushed against reloaded.

For each model, the demo's (`DEMO_MODEL` with the head sizes vLLM's CPU kernels take) and a
widened one of at least 1 GB in bf16 (`LARGE`), one vLLM server from the engine venv (`make
engine`, with vlmcp's gloo backend) and one fresh world of 2 trainer ranks (gloo, ZeRO-3, SGD,
bf16, so that the files and the wire carry the same bytes) take turns, after one untimed round
that allocates what a run's first publish allocates, `--repeats` times. No training step runs
while a step goes out (on this machine the trainer, the engine and the transfer share the
cores; where they do not, the steps would not slow the engine down either):

    files        publish.dir, rank-parallel in the background (today's publish), then the engine
                 reloads WEIGHTS/step_N in place (`VllmHttpClient.serve`: pause, vLLM's reload
                 from the files, just written and so in the page cache, the disk's best case here,
                 the CPU expert repack of an MoE, both caches, the version, resume)
    push_<B>     publish.engines with publish.bucket_mb B, staged (the default): every rank's
                 publish thread sends its share over gloo into the engine's host memory while it
                 serves, then the engine pauses to load it (training/weights/engine_push.py); no
                 directory
    streamed_<B> the same with publish.push_staged false: the engine pauses first and loads each
                 bucket as it arrives (B: the bucket size of STREAMED_MB)

Then, per learning rate of `SPARSE_LRS` (the RL demo's, and an RL-typical 1e-6), one fresh
trainer rank trains the same model with AdamW at that rate (bf16, so the engine's dtype is the
trainer's) and pushes into the same engine with publish.dense_every past the run's end: an
untimed dense push (the anchor), then `--repeats` times one training step and its push, sparse:
only the elements one AdamW step changed in bf16 (`sparse_lr<rate>`, with `changed_fraction`,
`push_bytes` and the delivery check's `check_s`, which runs after the resume, outside the
downtime). One rank, not two: what is timed (the engine's downtime, the bytes) does not depend on
the trainer's world, and two ZeRO-3 ranks with AdamW's state of the 1.1 GB model, beside the
engine, ran this 24 GB machine out of memory (0.7 GB left when the bench was stopped), where one
rank holds one copy of each buffer.

Each sample: `downtime_s`, the engine's time not serving (pause to resume, measured by the client
that drives it), `critical_s`, what the training waited (the slowest rank's `publish_s`),
`total_s` (until the engine served the step: rank 0's publish total plus, for files, the
reload), and the bytes the trainer ranks and the engine process wrote to the disk meanwhile
(`/proc/PID/io` write_bytes; the push path writes none). Where the push's downtime goes is in
`phases_s`: stage (staged: the transfer, while the engine serves, outside the downtime), then the
engine's control plane: pause, start, update (vLLM's load of every bucket; streamed, also the
transfer), finish (vLLM's layerwise finalisation and the CPU expert repack), caches, resume.
Values are min / median / max over the repeats; `ratios` compare medians with the files way (a
sparse way's bytes with the dense staged push's), and `best_bucket_mb` is the bucket size of the
lowest median downtime. `--push-models` picks the models (default both: the large one needs about
20 GB of free memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmcp.bench.jobs import published_after, scratch_folder, short_job, started_run
from vlmcp.bench.procs import run_fresh
from vlmcp.demo.rl import RL_LR
from vlmcp.parallel import comm

#: The widened model: about 0.55 G parameters, 1.1 GB in bf16.
LARGE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
         "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_head_dim": 128}
#: Bucket sizes (MiB) the push is timed at.
BUCKETS_MB = (64, 256, 1024)
#: The bucket size (MiB) the streamed push (publish.push_staged false) is timed at.
STREAMED_MB = 256
#: The learning rates (AdamW) the sparse pushes are timed at: the RL demo's, and 1e-6.
SPARSE_LRS = (RL_LR, 1e-6)
#: The models `--push-models` chooses from.
PUSH_MODELS = ("demo", "large")
_SAMPLES, _SAMPLE_LEN = 4, 16


def _tokens_data(path: Path) -> Path:
    lines = [json.dumps({"input_ids": list(range(8, 8 + _SAMPLE_LEN)),
                         "labels": [-100] * (_SAMPLE_LEN // 2) + list(range(8 + _SAMPLE_LEN // 2,
                                                                            8 + _SAMPLE_LEN))})
             for _ in range(_SAMPLES)]
    path.write_text("\n".join(lines) + "\n")
    return path


def written_bytes(pid: int | str = "self") -> int:
    """Bytes process `pid` caused to be written to storage so far (/proc/PID/io write_bytes)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise OSError(f"/proc/{pid}/io has no write_bytes")


@dataclass(frozen=True)
class PushBenchTask:
    """One world of trainer ranks against one running engine at `url` (see the module
    docstring); returns rank 0's samples by way."""

    job: dict
    url: str
    engine_pid: int
    model_dir: str
    scratch: str
    repeats: int

    def run(self, device: torch.device) -> dict[str, Any]:
        from vlmcp.engine.vllm_http import VllmHttpClient
        from vlmcp.training.loop import train_step
        from vlmcp.training.weights.publish import Publisher

        run, step = started_run(self.job)
        job = run.job
        files_dir = Path(self.scratch, "files")
        # Two publishers (each keeps host buffers of its own for the run); the push's bucket
        # size changes between its ways.
        files = Publisher(dataclasses.replace(job, publish=dataclasses.replace(
            job.publish, dir=str(files_dir))), run.engine, run.module, start_step=step)
        push = Publisher(dataclasses.replace(job, publish=dataclasses.replace(
            job.publish, dir=None, engines=[self.url])), run.engine, run.module, start_step=step)
        ways = {"files": (files, None, True),
                **{f"push_{mb}": (push, mb, True) for mb in BUCKETS_MB},
                f"streamed_{STREAMED_MB}": (push, STREAMED_MB, False)}
        client = VllmHttpClient(self.url, files_dir, self.model_dir) if comm.rank() == 0 else None
        samples: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
        for repeat in range(self.repeats + 1):
            for way, (publisher, bucket_mb, staged) in ways.items():
                if bucket_mb is not None:
                    publisher.push.settings = dataclasses.replace(
                        publisher.push.settings, bucket_bytes=bucket_mb * 2**20, staged=staged)
                wrote = torch.tensor([float(-written_bytes())], dtype=torch.float64)
                engine_wrote = written_bytes(self.engine_pid) if comm.rank() == 0 else 0
                published = step
                rows, step = published_after(run, publisher, published, train_meanwhile=False)
                sample = self._sample(rows[0], client, published, way)
                wrote += written_bytes()
                comm.all_reduce_sum(wrote)
                if comm.rank() == 0 and repeat:
                    sample.update(trainer_disk_write_bytes=int(wrote[0]),
                                  engine_disk_write_bytes=written_bytes(self.engine_pid)
                                  - engine_wrote)
                    samples[way].append(sample)
                comm.barrier()
                train_step(run, step)  # the next publish is of other weights
                step += 1
        comm.shutdown()
        return {"ways": samples}

    @staticmethod
    def _sample(row: dict[str, Any], client: Any, step: int, way: str) -> dict[str, Any]:
        """The publish's measures (every rank joins the all-reduce; rank 0's are meaningful);
        for the files way rank 0 then has the engine reload the step."""
        slowest = torch.tensor([row["publish_s"]], dtype=torch.float64)
        comm.all_reduce_max(slowest)
        if comm.rank() != 0:
            return {}
        sample: dict[str, Any] = {"critical_s": float(slowest[0])}
        if way == "files":
            served = client.serve(step)
            sample.update(downtime_s=served.seconds,
                          total_s=row["publish_total_s"] + served.seconds)
            Path(row["published"]).rename(Path(row["published"]).with_name(f"done-{step}"))
        else:
            if row.get("push_failed"):
                raise RuntimeError(f"the push of step {step} failed: {row['push_failed']}")
            sample.update(downtime_s=row["push_downtime_s"], total_s=row["publish_total_s"],
                          phases_s=row["push_phases_s"], push_bytes=row["push_bytes"])
        return sample


@dataclass(frozen=True)
class SparsePushBenchTask:
    """One trainer rank training with AdamW at `job`'s rate and pushing into the engine of `job`'s
    publish.engines, sparse after an untimed dense anchor (see the module docstring); returns
    rank 0's samples."""

    job: dict
    repeats: int

    def run(self, device: torch.device) -> dict[str, Any]:
        from vlmcp.training.loop import train_step
        from vlmcp.training.weights.publish import Publisher

        run, step = started_run(self.job)
        publisher = Publisher(run.job, run.engine, run.module, start_step=step)
        samples = []
        for repeat in range(self.repeats + 1):
            if repeat:
                train_step(run, step)
                step += 1
            rows, step = published_after(run, publisher, step, train_meanwhile=False)
            row = rows[0]
            slowest = torch.tensor([row["publish_s"]], dtype=torch.float64)
            comm.all_reduce_max(slowest)
            if comm.rank() != 0:
                continue
            if row.get("push_failed") or not row.get("pushed"):
                raise RuntimeError(f"the push of step {step} failed: {row.get('push_failed')}")
            if repeat:
                if not row["push_sparse"]:
                    raise RuntimeError(f"the push of step {step} was not sparse: {row}")
                samples.append({"critical_s": float(slowest[0]),
                                "downtime_s": row["push_downtime_s"],
                                "total_s": row["publish_total_s"],
                                "push_bytes": row["push_bytes"],
                                "changed_fraction": row["push_changed_fraction"],
                                "check_s": row["push_check_s"],
                                "base_bytes": row["push_base_bytes"],
                                "phases_s": row["push_phases_s"]})
        publisher.close()
        comm.shutdown()
        return {"samples": samples}


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "max": round(max(values), 4)}


def _summary(ways: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for way, runs in ways.items():
        if not runs:
            continue
        summary[way] = {key: _spread([run[key] for run in runs]) for key in runs[0]
                        if isinstance(runs[0][key], (int, float))}
        if "phases_s" in runs[0]:
            summary[way]["phases_s"] = {phase: _spread([run["phases_s"][phase] for run in runs])
                                        for phase in runs[0]["phases_s"]}
    pushes = [way for way in ways if way.startswith("push_")]
    best = min(pushes, key=lambda way: summary[way]["downtime_s"]["median"])
    files = summary["files"]
    summary["best_bucket_mb"] = int(best.removeprefix("push_"))
    summary["ratios"] = {
        f"{way}_downtime_vs_files": round(summary[way]["downtime_s"]["median"]
                                          / files["downtime_s"]["median"], 3)
        for way in ways if way != "files" and way in summary}
    summary["ratios"]["best_push_critical_vs_files"] = round(
        summary[best]["critical_s"]["median"] / files["critical_s"]["median"], 3)
    dense = summary[best]["push_bytes"]["median"]  # every staged bucket size sends the same
    summary["ratios"].update({
        f"{way}_bytes_vs_dense": round(summary[way]["push_bytes"]["median"] / dense, 4)
        for way in ways if way.startswith("sparse_") and way in summary})
    return summary


def _bench_model(name: str, config: dict[str, Any], root: Path, args: argparse.Namespace
                 ) -> dict[str, Any]:
    from vlmcp.engine.venv import engine_python, missing_engine, named_engine_python
    from vlmcp.engine.vllm_http import CPU_ARGS, PUSH_ARGS, VllmServer
    from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint

    python = engine_python()
    if python is None:
        raise ValueError(f"--engine-push needs the engine venv: "
                         f"{missing_engine(named_engine_python())}")
    model_dir = build_tiny_checkpoint(root / name / "model", seed=0,
                                      **{**VLLM_CPU_HEADS, **config})
    server = VllmServer(python, model_dir, root / name / "engine.log",
                        args=(*CPU_ARGS, *PUSH_ARGS, "--max-model-len", "256"))
    start_s = server.start()
    try:
        job = short_job({"path": str(model_dir), "dtype": "bfloat16"},
                        {"train": str(_tokens_data(root / name / "train.jsonl")),
                         "max_seq_len": 2 * _SAMPLE_LEN, "num_workers": 0},
                        root / name / "out", 10_000, lr=1e-4, zero_stage=3,
                        publish={"dir": str(root / name / "unused")})
        row = run_fresh(PushBenchTask(job, server.url, server.process.pid, str(model_dir),
                                      str(root / name), args.repeats), 2, distributed=False)
        for lr in SPARSE_LRS:
            sparse = short_job({"path": str(model_dir), "dtype": "bfloat16"}, job["data"],
                               root / name / f"sparse-{lr:g}", 10_000,
                               publish={"engines": [server.url], "dense_every": 10**6})
            sparse["optimizer"] = {"type": "adamw", "lr": lr}
            row["ways"][f"sparse_lr{lr:g}"] = run_fresh(
                SparsePushBenchTask(sparse, args.repeats), 1, distributed=False)["samples"]
    finally:
        server.stop()
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return {"model": f"tiny dense Qwen3.5 {config}", "checkpoint_bytes": weights,
            "engine_start_s": round(start_s, 1), **_summary(row["ways"]), "runs": row["ways"]}


def run_engine_push_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The `--engine-push` report (see the module docstring)."""
    from vlmcp.demo.image import DEMO_MODEL

    configs = {"demo": DEMO_MODEL, "large": LARGE}
    with scratch_folder(args.scratch, "vlmcp-bench-push-") as root:
        models = {name: _bench_model(name, configs[name], root, args)
                  for name in push_models(args.push_models)}
    return {"mode": "engine_push", "world": 2, "zero_stage": 3, "dtype": "bfloat16",
            "buckets_mb": list(BUCKETS_MB), "streamed_mb": STREAMED_MB, "repeats": args.repeats,
            "sparse_lrs": list(SPARSE_LRS), "sparse_optimizer": "adamw",
            "cpus": os.cpu_count(), "models": models}


def push_models(given: str | None) -> list[str]:
    """The models of `--push-models` (None: every one), in `PUSH_MODELS` order; ValueError
    naming an unknown one."""
    names = [n.strip() for n in given.split(",") if n.strip()] if given else list(PUSH_MODELS)
    unknown = [n for n in names if n not in PUSH_MODELS]
    if unknown or not names:
        raise ValueError(f"--push-models: expected a comma-separated list of "
                         f"{', '.join(PUSH_MODELS)}, got {given!r}")
    return [n for n in PUSH_MODELS if n in names]
