"""`vlmcp bench`: step time, tokens/s and memory of the packed training module, per pack length.

Three modes, each writing one JSON report:
- step (default): forward+backward of `PackedVLM` on a synthetic pack of each length (optionally
  with `--images` images of mixed sizes); no optimizer step. With `--pairs` the packs hold
  preference pairs whose halves show the same prompt images, and every length runs twice: the
  images held and encoded once for both halves (`pair_images` "shared", as vlmcp trains pairs)
  and once per half (`pair_images` "twice", as a collator that encodes each half's images does);
  their `vision_s` differ by the encoding saved.
- `--loss-only`: the lm_head + cross-entropy alone (`shard_loss_sum`, forward+backward) on random
  hidden states of each length.
- `--find-max-len`: the longest single sample whose step's peak memory fits `--memory-budget-gb`.

Memory (MiB): on CPU, the process's resident set (current RSS, and its peak VmHWM); on CUDA,
`memory_allocated` and `max_memory_allocated`. `model_memory_mb` is the memory after the model is
built, before the first step; `peak_memory_mb` the peak over the length's steps;
`activation_memory_mb` their difference. Rows report the largest rank.

Processes: on CPU without a launcher, every length (every probe) runs in fresh processes that
this command starts itself, `--sp-size` ranks over gloo, so that a peak belongs to that length
alone. Under a launcher (torchrun, deepspeed) the ranks run in-process; the peak is then reset
per length where Linux allows it (`/proc/self/clear_refs`), and the row says when it could not
be (the max RSS is then cumulative). On CUDA one process runs every length and resets the peak
statistics per length.

The synthetic packs come from `vlmcp.bench.inputs`; memory readings and the fresh rank processes
from `vlmcp.bench.procs`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmcp.bench.inputs import synthetic_pack, synthetic_pairs
from vlmcp.bench.procs import Memory, MemoryLimitExceeded, run_fresh
from vlmcp.data.batch import PackedBatch
from vlmcp.device import compute_device
from vlmcp.model.loss import CE_BYTES_PER_LOGIT, DEFAULT_LOSS_CHUNK_MB, shard_loss_sum, vocab_chunk_rows
from vlmcp.parallel import comm

logger = logging.getLogger(__name__)

#: The tiny bench model's defaults (`--vocab-size`, `--hidden-size`).
DEFAULT_VOCAB = 512
DEFAULT_HIDDEN = 64


# --------------------------------------------------------------------------- one rank's work


@dataclass(frozen=True)
class StepTask:
    """Forward+backward of the packed module on one synthetic pack length (every rank)."""

    model_dir: str
    dtype: str
    sp_size: int
    deltanet_cp: str
    vision: str
    loss_chunk_mb: float
    seq_len: int
    samples: int
    images: int
    steps: int
    warmup: int
    #: "" (plain samples), or the pairs' images "shared" or encoded "twice" (`synthetic_pairs`).
    pair_images: str = ""

    def run(self, device: torch.device, sp: Any = None) -> dict[str, Any]:
        """This rank's numbers gathered over the world; returns the row (the same on every rank).
        `sp`: the SequenceParallel groups when the caller made them (else made here)."""
        from vlmcp.model.load import load_model
        from vlmcp.model.packed import PackedVLM
        from vlmcp.parallel.groups import SequenceParallel

        memory = Memory(device)
        sp = sp or SequenceParallel.initialize(self.sp_size)
        module = PackedVLM(load_model(self.model_dir, self.dtype).to(device), sp=sp,
                           deltanet_cp=self.deltanet_cp, vision_mode=self.vision,
                           loss_chunk_mb=self.loss_chunk_mb)
        module.train()
        config = module.hf_model.config
        if self.pair_images:
            batch = synthetic_pairs(self.seq_len, self.samples // 2, config, self.images,
                                    shared=self.pair_images == "shared")
        else:
            batch = synthetic_pack(self.seq_len, self.samples, config, self.images)
        row = measure_steps(module, batch, self, memory)
        return {**row, "pair_images": self.pair_images} if self.pair_images else row


def measure_steps(module: nn.Module, batch: PackedBatch, task: StepTask, memory: Memory) -> dict[str, Any]:
    """Time `task.warmup` + `task.steps` forward+backward passes of `module` on `batch` (every rank
    of the world calls this); the row holds the slowest rank's mean step time and each rank's
    memory and vision time."""
    vision_timer = _VisionTimer(module.vision, memory.device)
    gc.collect()
    model_mb = memory.current_mb()
    peak_reset = memory.reset_peak()
    times = []
    for step in range(task.warmup + task.steps):
        vision_timer.total = 0.0
        started = time.perf_counter()
        loss, _, _ = module(batch)
        loss.backward()
        module.zero_grad(set_to_none=True)
        _synchronize(memory.device)
        if step >= task.warmup:
            times.append(time.perf_counter() - started)
            vision_timer.timed += vision_timer.total
    vision_timer.remove()
    peak_mb = memory.peak_mb()
    mine = [model_mb, peak_mb, vision_timer.timed / max(task.steps, 1), *times]
    table = torch.zeros(comm.world_size(), len(mine), dtype=torch.float64)
    table[comm.rank()] = torch.tensor(mine, dtype=torch.float64)
    table = comm.all_reduce_sum(table)
    per_rank = [{"rank": r, "model_memory_mb": float(row[0]), "peak_memory_mb": float(row[1]),
                 "activation_memory_mb": float(row[1] - row[0]), "vision_s": float(row[2]),
                 "step_time_s": float(row[3:].mean()) if task.steps else 0.0}
                for r, row in enumerate(table)]
    step_s = float(table[:, 3:].max(dim=0).values.mean()) if task.steps else 0.0
    image_tokens = int((batch.mm_token_type_ids == 1).sum())
    return {"seq_len": task.seq_len, "samples_per_pack": task.samples, "images": task.images,
            "image_tokens": image_tokens, "step_time_s": step_s,
            "tokens_per_s": task.seq_len / step_s if step_s else 0.0,
            "model_memory_mb": max(r["model_memory_mb"] for r in per_rank),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in per_rank),
            "activation_memory_mb": max(r["activation_memory_mb"] for r in per_rank),
            "vision_s": max(r["vision_s"] for r in per_rank), "per_rank": per_rank,
            "memory_kind": memory.kind, "peak_is_cumulative": not peak_reset}


class _VisionTimer:
    """Seconds spent inside `vision`'s forward, from forward pre/post hooks (CUDA: synchronized)."""

    def __init__(self, vision: nn.Module, device: torch.device) -> None:
        self.device = device
        self.total = 0.0
        self.timed = 0.0
        self._started = 0.0
        self._hooks = [vision.register_forward_pre_hook(self._pre), vision.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        _synchronize(self.device)
        self._started = time.perf_counter()

    def _post(self, *_: Any) -> None:
        _synchronize(self.device)
        self.total += time.perf_counter() - self._started

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class LossTask:
    """lm_head + cross-entropy alone, forward+backward, on [seq_len, hidden] random hidden states
    (one process). `frozen_head`: the lm_head weight takes no gradient, so the peak holds only
    the chunks' logits transient."""

    seq_len: int
    vocab_size: int
    hidden_size: int
    dtype: str
    loss_chunk_mb: float
    steps: int
    warmup: int
    frozen_head: bool

    def run(self, device: torch.device) -> dict[str, Any]:
        dtype = getattr(torch, self.dtype)
        memory = Memory(device)
        generator = torch.Generator().manual_seed(0)
        # The kernels' first use maps code and scratch pages: do it before the baseline.
        warm_head = nn.Linear(self.hidden_size, 64, bias=False).to(device, dtype)
        warm = torch.randn(8, self.hidden_size, dtype=dtype, device=device, requires_grad=True)
        shard_loss_sum(warm, torch.randint(0, 64, (8,), device=device), warm_head, 4 * 64 * CE_BYTES_PER_LOGIT / 2**20)[0].backward()
        del warm_head, warm
        head = nn.Linear(self.hidden_size, self.vocab_size, bias=False).to(device, dtype)
        head.requires_grad_(not self.frozen_head)
        hidden = torch.randn(self.seq_len, self.hidden_size, generator=generator).to(device, dtype)
        hidden.requires_grad_(True)
        targets = torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator).to(device)
        gc.collect()
        base_mb = memory.current_mb()
        peak_reset = memory.reset_peak()
        times = []
        for step in range(self.warmup + self.steps):
            started = time.perf_counter()
            loss, _ = shard_loss_sum(hidden, targets, head, self.loss_chunk_mb)
            loss.backward()
            hidden.grad = None
            head.weight.grad = None
            _synchronize(device)
            if step >= self.warmup:
                times.append(time.perf_counter() - started)
        return {"loss_time_s": sum(times) / max(len(times), 1), "base_memory_mb": base_mb,
                "peak_transient_mb": memory.peak_mb() - base_mb, "memory_kind": memory.kind,
                "peak_is_cumulative": not peak_reset}


# --------------------------------------------------------------------------- modes


def _launched() -> bool:
    """Whether an external launcher (torchrun, deepspeed, accelerate) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _lengths(text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",") if x.strip()]
    if not lengths or min(lengths) < 2:
        raise ValueError(f"--seq-lens {text!r}: expected comma-separated lengths >= 2")
    return lengths


def _model_dir(args: argparse.Namespace, scratch: str) -> str:
    """`--model`, else a tiny random checkpoint written under `scratch`."""
    if args.model:
        return args.model
    from vlmcp.model.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(Path(scratch, "model"), moe=args.moe, tokenizer=False,
                                     vocab_size=args.vocab_size, hidden_size=args.hidden_size))


def _model_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(vocab, hidden) of the benched model: `--model`'s config, else the tiny model's flags."""
    if not args.model:
        return args.vocab_size, args.hidden_size
    from vlmcp.model.load import load_config

    text = load_config(args.model).get_text_config()
    return int(text.vocab_size), int(text.hidden_size)


def _step_task(args: argparse.Namespace, model_dir: str, seq_len: int, samples: int, steps: int,
               warmup: int, pair_images: str = "") -> StepTask:
    return StepTask(model_dir=model_dir, dtype=args.dtype, sp_size=args.sp_size or 1,
                    deltanet_cp=args.deltanet_cp, vision=args.vision, loss_chunk_mb=args.loss_chunk_mb,
                    seq_len=seq_len,
                    samples=samples, images=args.images, steps=steps, warmup=warmup,
                    pair_images=pair_images)


def _bench_steps(args: argparse.Namespace, model_dir: str, device: torch.device, sp: Any) -> list[dict[str, Any]]:
    rows = []
    for seq_len in _lengths(args.seq_lens):
        _check_pack(model_dir, seq_len, args.samples_per_pack, args.images, args.pairs)
        for pair_images in ("shared", "twice") if args.pairs else ("",):
            if device.type == "cpu" and not _launched():
                task = _step_task(args, model_dir, seq_len, args.samples_per_pack, args.steps,
                                  args.warmup, pair_images)
                row = {**run_fresh(task, task.sp_size, distributed=task.sp_size > 1),
                       "fresh_process": True}
            else:
                row = _in_process_step(args, model_dir, seq_len, device, sp,
                                       pair_images=pair_images)
            rows.append(row)
            if "error" not in row:
                logger.info("seq_len %d%s: %.3f s per forward+backward, %.0f tokens/s, model %.0f "
                            "MiB, peak %.0f MiB, activations %.0f MiB, vision %.3f s", seq_len,
                            f" (pair images {pair_images})" if pair_images else "",
                            row["step_time_s"], row["tokens_per_s"], row["model_memory_mb"],
                            row["peak_memory_mb"], row["activation_memory_mb"], row["vision_s"])
    return rows


def _check_pack(model_dir: str, seq_len: int, samples: int, images: int, pairs: bool = False
                ) -> None:
    """Raise the ValueError of a pack that cannot be built, before any rank starts."""
    if pairs and (samples % 2 or not images):
        raise ValueError(f"--pairs needs an even --samples-per-pack (got {samples}) and --images "
                         "(the prompts' images the halves share)")
    if images:
        from vlmcp.model.load import load_config

        if pairs:
            synthetic_pairs(seq_len, samples // 2, load_config(model_dir), images)
        else:
            synthetic_pack(seq_len, samples, load_config(model_dir), images)


def _in_process_step(args: argparse.Namespace, model_dir: str, seq_len: int, device: torch.device, sp: Any,
                     samples: int | None = None, steps: int | None = None, warmup: int | None = None,
                     pair_images: str = "") -> dict[str, Any]:
    """One length on the current world (launcher ranks, or one CUDA process). A CUDA
    out-of-memory error becomes a row with `error`."""
    task = _step_task(args, model_dir, seq_len, samples or args.samples_per_pack,
                      args.steps if steps is None else steps, args.warmup if warmup is None else warmup,
                      pair_images)
    try:
        row = {**task.run(device, sp), "fresh_process": False}
    except torch.OutOfMemoryError as exc:
        row = {"seq_len": seq_len, "error": f"out of memory: {str(exc).splitlines()[0]}"}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _bench_loss(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Per length: the loss with a trainable lm_head (the training case) and with a frozen one
    (only the logits transient), each in a fresh process on CPU."""
    vocab, hidden = _model_sizes(args)
    rows = []
    for seq_len in _lengths(args.seq_lens):
        measured = {}
        for frozen in (False, True):
            task = LossTask(seq_len=seq_len, vocab_size=vocab, hidden_size=hidden, dtype=args.dtype,
                            loss_chunk_mb=args.loss_chunk_mb, steps=args.steps, warmup=args.warmup,
                            frozen_head=frozen)
            measured[frozen] = (run_fresh(task, 1, distributed=False) if device.type == "cpu"
                                else task.run(device))
        trained, frozen_head = measured[False], measured[True]
        itemsize = getattr(torch, args.dtype).itemsize
        row = {"seq_len": seq_len, "vocab_size": vocab, "hidden_size": hidden, "dtype": args.dtype,
               "loss_chunk_mb": args.loss_chunk_mb,
               "chunk_rows": vocab_chunk_rows(args.loss_chunk_mb, vocab, CE_BYTES_PER_LOGIT),
               "loss_time_s": trained["loss_time_s"],
               "loss_peak_transient_mb": trained["peak_transient_mb"],
               "logits_peak_transient_mb": frozen_head["peak_transient_mb"],
               "lm_head_grad_mb": vocab * hidden * itemsize / 2**20,
               "base_memory_mb": trained["base_memory_mb"], "memory_kind": trained["memory_kind"],
               "peak_is_cumulative": trained["peak_is_cumulative"] or frozen_head["peak_is_cumulative"],
               "fresh_process": device.type == "cpu"}
        rows.append(row)
        logger.info("seq_len %d: loss %.2f s, transient %.0f MiB (logits alone %.0f MiB), %d rows "
                    "per chunk", seq_len, row["loss_time_s"], row["loss_peak_transient_mb"],
                    row["logits_peak_transient_mb"], row["chunk_rows"])
    return rows


def _probe(args: argparse.Namespace, model_dir: str, seq_len: int, budget_mb: float,
           device: torch.device, sp: Any) -> dict[str, Any]:
    """One forward+backward of a single `seq_len`-token sample; `fits` when its peak is within
    the budget (a CPU probe is stopped as soon as a rank passes it)."""
    if device.type == "cpu":
        task = _step_task(args, model_dir, seq_len, 1, steps=1, warmup=0)
        try:
            row = {**run_fresh(task, task.sp_size, distributed=task.sp_size > 1, limit_mb=budget_mb),
                   "fresh_process": True}
        except MemoryLimitExceeded as exc:
            row = {"seq_len": seq_len, "error": str(exc)}
    else:
        row = _in_process_step(args, model_dir, seq_len, device, sp, samples=1, steps=1, warmup=0)
    row["fits"] = "error" not in row and row["peak_memory_mb"] <= budget_mb
    logger.info("probe %d tokens: %s", seq_len, "fits" if row["fits"] else row.get("error", "over budget"))
    return row


def find_max_len(args: argparse.Namespace, model_dir: str, device: torch.device,
                 sp: Any) -> tuple[int | None, list[dict[str, Any]]]:
    """The longest single sample (a multiple of `--granularity`) whose step's peak fits
    `--memory-budget-gb`, probing at most `--max-probes` lengths (`search_max_len`). Returns
    (length or None, the probes' rows in order)."""
    budget_mb = args.memory_budget_gb * 1024
    _check_pack(model_dir, args.granularity, 1, args.images)
    probes: list[dict[str, Any]] = []

    def fits(seq_len: int) -> bool:
        probes.append(_probe(args, model_dir, seq_len, budget_mb, device, sp))
        return probes[-1]["fits"]

    return search_max_len(fits, args.granularity, args.max_probes), probes


def search_max_len(fits: Callable[[int], bool], unit: int, max_probes: int) -> int | None:
    """The largest multiple of `unit` for which `fits` holds, assuming it holds below some length
    and fails above: doubling from `unit` to the first failure, then bisection, calling `fits` at
    most `max_probes` times. None when `unit` itself does not fit."""
    low, high, probes = 0, 1, 0
    while probes < max_probes:
        probes += 1
        if not fits(high * unit):
            break
        low, high = high, high * 2
    else:
        return low * unit or None
    while high - low > 1 and probes < max_probes:
        probes += 1
        middle = (low + high) // 2
        if fits(middle * unit):
            low = middle
        else:
            high = middle
    return low * unit or None


def _resolve_args(args: argparse.Namespace, device: torch.device) -> None:
    """Fill the defaults that live in the model code; raise ValueError naming bad flag mixes."""
    problems = []
    if args.model and (args.vocab_size is not None or args.hidden_size is not None):
        problems.append("--vocab-size and --hidden-size shape the built-in tiny model; --model has its own")
    args.vocab_size = args.vocab_size or DEFAULT_VOCAB
    args.hidden_size = args.hidden_size or DEFAULT_HIDDEN
    args.loss_chunk_mb = args.loss_chunk_mb or DEFAULT_LOSS_CHUNK_MB
    if args.find_max_len and args.memory_budget_gb is None:
        problems.append("--find-max-len needs --memory-budget-gb")
    if args.find_max_len and args.loss_only:
        problems.append("--find-max-len and --loss-only are separate modes")
    if args.pairs and (args.find_max_len or args.loss_only):
        problems.append("--pairs is a flag of the step benchmark, not of --find-max-len or "
                        "--loss-only")
    if device.type == "cpu" and _launched() and (args.find_max_len or args.loss_only):
        problems.append("--find-max-len and --loss-only start their own processes on CPU: run them "
                        "without a launcher")
    if device.type == "cuda" and not _launched() and (args.sp_size or 1) > 1:
        problems.append("--sp-size > 1 on CUDA: launch one process per GPU with torchrun")
    if problems:
        raise ValueError("; ".join(problems))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `vlmcp bench` arguments; rank 0 writes the JSON."""
    if args.data_scale:
        from vlmcp.bench.data_scale import run_data_scale

        return _write_report(args, run_data_scale(args))
    device = compute_device()
    _resolve_args(args, device)
    vocab, hidden = _model_sizes(args)
    report: dict[str, Any] = {
        "model": args.model or f"tiny {'moe' if args.moe else 'dense'} (random init)",
        "dtype": args.dtype, "vocab_size": vocab, "hidden_size": hidden, "device": str(device),
        "loss_chunk_mb": args.loss_chunk_mb}
    if args.loss_only:
        report.update(mode="loss_only", results=_bench_loss(args, device))
    else:
        with tempfile.TemporaryDirectory(prefix="vlmcp-bench-") as scratch:
            report.update(_bench_model(args, _model_dir(args, scratch), device))
    return _write_report(args, report)


def _write_report(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 writes `report` to --out and prints it."""
    if comm.rank() == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        json.dump(report, sys.stdout, indent=2)
        print()
    return report


def _bench_model(args: argparse.Namespace, model_dir: str, device: torch.device) -> dict[str, Any]:
    """The report entries of the step and --find-max-len modes. The checkpoint is written before
    any process group starts (save_pretrained writes on rank 0 only)."""
    sp = None
    if _launched():
        from vlmcp.parallel.groups import SequenceParallel

        comm.init_distributed()
        args.sp_size = args.sp_size or comm.world_size()
        sp = SequenceParallel.initialize(args.sp_size)
    world = comm.world_size() if _launched() else args.sp_size or 1
    threads = torch.get_num_threads() if _launched() else max(1, torch.get_num_threads() // world)
    report: dict[str, Any] = {"world_size": world, "sp_size": args.sp_size or 1,
                              "deltanet_cp": args.deltanet_cp, "vision": args.vision, "images": args.images,
                              "pairs": args.pairs, "threads_per_rank": threads}
    if not args.find_max_len:
        return {**report, "mode": "step", "results": _bench_steps(args, model_dir, device, sp)}
    max_len, probes = find_max_len(args, model_dir, device, sp)
    failed = [probe["seq_len"] for probe in probes if not probe["fits"]]
    return {**report, "mode": "find_max_len", "memory_budget_gb": args.memory_budget_gb,
            "granularity": args.granularity, "max_len": max_len,
            "first_failing_len": min(failed) if failed else None, "probes": probes}
