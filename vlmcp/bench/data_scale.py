"""`vlmcp bench --data-scale N1,N2,...`: does a rank's memory grow with the dataset size?

For each N, a synthetic dataset of N chat samples with one 512x512 PNG each is written, and the
same short SP training job (tiny model, `--sp-size` ranks, default 2) runs on it twice, in fresh
processes (so every peak belongs to its run): the first run builds the length index, the second
must load it from the cache. Each row reports every rank's peak resident set (VmHWM of the rank
process; DataLoader workers are processes of their own), whether the index was built or loaded
and in how many seconds, and the train steps' wall time. `peak_rss_ratio` compares each N's peak
with the first N's.

The images are solid colours, 64 distinct PNG encodings, each file made distinct by a tEXt chunk
holding its number, so 20,000 files take about 40 MB and a few seconds to write.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
import zlib
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlmcp.bench.jobs import scratch_folder, short_job, timed_training
from vlmcp.bench.procs import Memory, run_fresh
from vlmcp.parallel import comm

#: Distinct pixel contents of the synthetic images.
_COLOURS = 64


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _solid_pngs(size: int) -> list[bytes]:
    """PNG encodings of `_COLOURS` solid-colour size x size RGB images."""
    blobs = []
    for k in range(_COLOURS):
        buffer = BytesIO()
        colour = (k * 37 % 256, k * 91 % 256, k * 53 % 256)
        Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
        blobs.append(buffer.getvalue())
    return blobs


def write_synthetic_dataset(out_dir: Path, samples: int, image_size: int = 512) -> Path:
    """A JSONL file of `samples` one-image chat samples and their PNGs (every file distinct);
    returns the JSONL path."""
    images = out_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    blobs = _solid_pngs(image_size)
    header_end = 8 + 25  # the PNG signature, then the IHDR chunk
    lines = []
    for i in range(samples):
        blob = blobs[i % _COLOURS]
        text = _png_chunk(b"tEXt", b"sample\x00" + str(i).encode())
        name = f"images/{i:06d}.png"
        (out_dir / name).write_bytes(blob[:header_end] + text + blob[header_end:])
        lines.append(json.dumps({
            "messages": [{"role": "user", "content": "<image>Which colour is this picture?"},
                         {"role": "assistant", "content": f"Colour number {i % _COLOURS}."}],
            "images": [name]}))
    path = out_dir / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True)
class DataScaleTask:
    """One training run of the job at `job_path` on every rank; returns the row (every rank)."""

    job_path: str
    samples: int
    attempt: int

    def run(self, device: torch.device) -> dict[str, Any]:
        run, seconds = timed_training(self.job_path)
        peaks = torch.zeros(comm.world_size(), dtype=torch.float64)
        peaks[comm.rank()] = Memory(device).peak_mb()
        comm.all_reduce_sum(peaks)
        result = run.preflight.train_index_result
        built = torch.tensor([float(result.built), result.seconds if result.built else 0.0],
                             dtype=torch.float64)
        comm.all_reduce_sum(built)
        comm.shutdown()
        return {"samples": self.samples, "run": self.attempt,
                "peak_rss_mb_per_rank": [round(p, 1) for p in peaks.tolist()],
                "index": "built" if built[0] else "loaded from cache",
                "index_build_s": round(float(built[1]), 2) if built[0] else None,
                "index_cache": str(result.path), "run_s": round(seconds, 1),
                "steps": run.job.train.max_steps}


def _job(model_dir: Path, data: Path, out: Path, cache: Path, args: argparse.Namespace) -> dict:
    return short_job({"path": str(model_dir)},
                     {"train": str(data), "max_seq_len": args.data_max_seq_len,
                      "cache_dir": str(cache), "num_workers": args.data_workers},
                     out, args.steps, parallel={"sp_size": args.sp_size})


def run_data_scale(args: argparse.Namespace) -> dict[str, Any]:
    """The `--data-scale` report: two runs per dataset size, in fresh processes."""
    from vlmcp.model.tiny import build_tiny_checkpoint

    sizes = [int(n) for n in args.data_scale.split(",")]
    args.sp_size = args.sp_size or 2
    rows = []
    with scratch_folder(args.scratch, "vlmcp-data-scale-") as root:
        model_dir = build_tiny_checkpoint(root / "model", moe=False, seed=0)
        for n in sizes:
            started = time.perf_counter()
            data = write_synthetic_dataset(root / f"data-{n}", n)
            written_s = time.perf_counter() - started
            for attempt in (1, 2):
                job = root / f"job-{n}-{attempt}.json"
                job.write_text(json.dumps(_job(model_dir, data, root / f"out-{n}-{attempt}",
                                               root / "index-cache", args)))
                row = run_fresh(DataScaleTask(str(job), n, attempt), args.sp_size,
                                distributed=False)
                rows.append({**row, "dataset_write_s": round(written_s, 1)})
                print(json.dumps(rows[-1]), flush=True)
    base = max(rows[0]["peak_rss_mb_per_rank"])
    for row in rows:
        row["peak_rss_ratio"] = round(max(row["peak_rss_mb_per_rank"]) / base, 3)
    return {"mode": "data_scale", "sp_size": args.sp_size, "image_size": 512,
            "max_seq_len": args.data_max_seq_len, "num_workers": args.data_workers,
            "results": rows}
