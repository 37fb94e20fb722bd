"""`vlmcp bench`: tokens/s and peak memory of the packed training module's forward+backward.

Runs on the current world (one process, or every rank of a torchrun launch): the ranks form
sequence-parallel groups of `--sp-size` (default: the whole world), and every group processes the
same synthetic text pack of each length, split into `--samples-per-pack` equal samples. Reported
per length: seconds per forward+backward (slowest rank), tokens/s of one SP group, and peak
memory of the largest rank (CUDA: peak allocated bytes of the device for that length; CPU: the
process's peak resident set size so far, which only grows). No optimizer step is taken.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.data.positions import mrope_positions
from vlmcp.device import compute_device
from vlmcp.model.load import load_model
from vlmcp.model.packed import PackedVLM
from vlmcp.parallel import comm
from vlmcp.parallel.groups import SequenceParallel

logger = logging.getLogger(__name__)


def synthetic_pack(seq_len: int, samples: int, vocab_size: int, seed: int = 0) -> PackedBatch:
    """A text-only pack of `samples` near-equal random samples totalling `seq_len` tokens, every
    token (but each sample's last) a target. Identical on every rank for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    base, extra = divmod(seq_len, samples)
    lens = [base + (1 if i < extra else 0) for i in range(samples)]
    ids, targets, positions = [], [], []
    for length in lens:
        sample = torch.randint(8, vocab_size, (length,), generator=generator)
        ids.append(sample)
        targets.append(torch.cat([sample[1:], torch.tensor([IGNORE_INDEX])]))
        positions.append(mrope_positions(sample, torch.zeros(length, dtype=torch.long), None, 2))
    return PackedBatch(input_ids=torch.cat(ids), targets=torch.cat(targets),
                       position_ids=torch.cat(positions, dim=1),
                       mm_token_type_ids=torch.zeros(seq_len, dtype=torch.long), seq_lens=lens)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_one(module: PackedVLM, batch: PackedBatch) -> float:
    started = time.perf_counter()
    loss, _ = module(batch)
    loss.backward()
    module.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(module: PackedVLM, seq_len: int, samples: int, steps: int, warmup: int,
            device: torch.device) -> dict[str, Any]:
    """One row of the report for one pack length."""
    vocab = module.hf_model.config.get_text_config().vocab_size
    batch = synthetic_pack(seq_len, samples, vocab)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        _time_one(module, batch)
    times = torch.tensor([_time_one(module, batch) for _ in range(steps)], dtype=torch.float64)
    slowest = comm.all_reduce_max(times.clone())
    step_s = float(slowest.mean())
    peak = comm.all_reduce_max(torch.tensor([_peak_memory_mb(device)], dtype=torch.float64))
    return {"seq_len": seq_len, "samples_per_pack": samples, "step_time_s": step_s,
            "tokens_per_s": seq_len / step_s, "peak_memory_mb": float(peak[0]),
            "peak_memory_kind": "cuda_allocated" if device.type == "cuda" else "cpu_max_rss"}


def _model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from vlmcp.demo_assets import build_tiny_checkpoint

    return str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="vlmcp-bench-")), moe=args.moe))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `vlmcp bench` arguments; rank 0 writes the JSON."""
    model_dir = _model_dir(args)  # before the process group: save_pretrained writes on rank 0 only
    comm.init_distributed()
    sp = SequenceParallel.initialize(args.sp_size or comm.world_size())
    device = compute_device()
    module = PackedVLM(load_model(model_dir, args.dtype).to(device), sp=sp,
                       deltanet_cp=args.deltanet_cp)
    module.train()
    rows = []
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        row = measure(module, seq_len, args.samples_per_pack, args.steps, args.warmup, device)
        rows.append(row)
        logger.info("seq_len %d: %.0f tokens/s, %.3f s per forward+backward, peak %.0f MB",
                    seq_len, row["tokens_per_s"], row["step_time_s"], row["peak_memory_mb"])
    report = {"model": args.model or f"tiny {'moe' if args.moe else 'dense'} (random init)",
              "dtype": args.dtype, "world_size": comm.world_size(), "sp_size": sp.size,
              "deltanet_cp": args.deltanet_cp, "device": str(device), "results": rows}
    if comm.rank() == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        json.dump(report, sys.stdout, indent=2)
        print()
    return report
