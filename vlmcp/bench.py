"""`vlmcp bench`: step time, tokens/s and memory of the packed training module, per pack length.

Three modes, each writing one JSON report:
- step (default): forward+backward of `PackedVLM` on a synthetic pack of each length (optionally
  with `--images` images of mixed sizes); no optimizer step.
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
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.data.positions import mrope_positions
from vlmcp.device import compute_device
from vlmcp.model.loss import CE_BYTES_PER_LOGIT, DEFAULT_LOSS_CHUNK_MB, shard_loss_sum, vocab_chunk_rows
from vlmcp.parallel import comm

logger = logging.getLogger(__name__)

#: (h, w) patch grids the `--images` images cycle through: mixed sizes and aspect ratios, from 4 to
#: 192 image tokens each after the 2 x 2 merge.
IMAGE_GRIDS = [(16, 16), (32, 24), (8, 8), (24, 32), (16, 48), (8, 24), (32, 32), (12, 12)]

#: The tiny bench model's defaults (`--vocab-size`, `--hidden-size`).
DEFAULT_VOCAB = 512
DEFAULT_HIDDEN = 64

#: Text tokens before a sample's first image (after it, random text fills the sample).
_TEXT_BEFORE_IMAGES = 4


# --------------------------------------------------------------------------- synthetic inputs


def image_grids(count: int) -> list[tuple[int, int, int]]:
    """(t, h, w) patch grids of `count` images of mixed sizes, the same for every run."""
    return [(1, *IMAGE_GRIDS[i % len(IMAGE_GRIDS)]) for i in range(count)]


def synthetic_pack(seq_len: int, samples: int, config: Any, images: int = 0, seed: int = 0) -> PackedBatch:
    """A pack of `samples` near-equal random samples totalling `seq_len` tokens, identical on every
    rank for the same seed. `config`: the model's (VLM) config. Image i (grids from `image_grids`)
    goes into sample i % samples, after a few text tokens, framed by vision start/end tokens, with
    random pixels. Every token whose successor is text is a target (not a sample's last)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = config.get_text_config().vocab_size
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    base, extra = divmod(seq_len, samples)
    lens = [base + (1 if i < extra else 0) for i in range(samples)]
    grids = image_grids(images)
    per_sample: list[list[tuple[int, int, int]]] = [grids[s::samples] for s in range(samples)]
    ids, types, targets, positions = [], [], [], []
    for index, (length, sample_grids) in enumerate(zip(lens, per_sample)):
        sample = torch.randint(8, vocab, (length,), generator=generator)
        kind = torch.zeros(length, dtype=torch.long)
        at = _TEXT_BEFORE_IMAGES
        for t, h, w in sample_grids:
            n = t * h * w // merge**2
            if at + n + 3 > length:
                raise ValueError(f"--images {images} do not fit into sample {index} of {length} tokens "
                                 f"(--seq-lens {seq_len}, --samples-per-pack {samples}); use longer packs")
            sample[at] = config.vision_start_token_id
            sample[at + 1 : at + 1 + n] = config.image_token_id
            kind[at + 1 : at + 1 + n] = 1
            sample[at + 1 + n] = config.vision_end_token_id
            at += n + 2
        grid_rows = torch.tensor(sample_grids, dtype=torch.long).reshape(-1, 3) if sample_grids else None
        target = torch.cat([sample[1:], torch.tensor([IGNORE_INDEX])])
        target[torch.cat([kind[1:], torch.zeros(1, dtype=torch.long)]) == 1] = IGNORE_INDEX
        ids.append(sample)
        types.append(kind)
        targets.append(target)
        positions.append(mrope_positions(sample, kind, grid_rows, merge))
    pixel_values = image_grid_thw = None
    if grids:
        image_grid_thw = torch.tensor([g for sample_grids in per_sample for g in sample_grids])
        patches = int(image_grid_thw.prod(dim=1).sum())
        pixel_values = torch.randn(patches, patch_dim, generator=generator)
    return PackedBatch(input_ids=torch.cat(ids), targets=torch.cat(targets),
                       position_ids=torch.cat(positions, dim=1), mm_token_type_ids=torch.cat(types),
                       seq_lens=lens, pixel_values=pixel_values, image_grid_thw=image_grid_thw)


# --------------------------------------------------------------------------- memory


class Memory:
    """Memory of this process in MiB: CUDA allocated bytes of `device`, else the resident set."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_allocated" if device.type == "cuda" else "cpu_rss"

    def current_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20
        return _proc_status_mb("VmRSS")

    def reset_peak(self) -> bool:
        """Start a new peak from the current memory; False when the OS does not allow it."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            return _proc_status_mb("VmHWM")
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _proc_status_mb(field: str, pid: int | str = "self") -> float:
    """A memory line of /proc/PID/status (kB) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise OSError(f"/proc/{pid}/status has no {field}")


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
        batch = synthetic_pack(self.seq_len, self.samples, module.hf_model.config, self.images)
        return measure_steps(module, batch, self, memory)


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
        loss, _ = module(batch)
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
        shard_loss_sum(warm, torch.randint(0, 64, (8,), device=device), warm_head, 64 * 4 * 12 / 2**20)[0].backward()
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


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_entry(rank: int, world: int, port: int, threads: int, out_dir: str, task: Any, distributed: bool) -> None:
    """Body of one fresh rank process: join the world over gloo, run `task`, write rank 0's row."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)})
    torch.set_num_threads(threads)
    if distributed:
        comm.init_distributed(timeout_s=600)
    row = task.run(torch.device("cpu"))
    if rank == 0:
        Path(out_dir, "row.json").write_text(json.dumps(row))
    if distributed:
        comm.barrier()
        torch.distributed.destroy_process_group()


class MemoryLimitExceeded(RuntimeError):
    """A fresh-process run stopped because a rank's resident set passed the limit."""


def run_fresh(task: Any, world: int, *, distributed: bool = True, limit_mb: float | None = None) -> dict[str, Any]:
    """Run `task` on `world` new CPU processes (gloo when `distributed`); rank 0's row.

    Each rank gets `OMP_NUM_THREADS` = this process's threads / world (at least 1). With
    `limit_mb`, a rank whose resident set passes it is stopped with its peers, and
    MemoryLimitExceeded is raised. A failing rank stops the others and raises.
    """
    import torch.multiprocessing as mp

    threads = max(1, torch.get_num_threads() // world)
    with tempfile.TemporaryDirectory(prefix="vlmcp-bench-") as out_dir:
        context = mp.start_processes(_rank_entry, args=(world, _free_port(), threads, out_dir, task, distributed),
                                     nprocs=world, join=False, start_method="spawn")
        while not context.join(timeout=0.5):
            if limit_mb is not None and _over_limit(context.pids(), limit_mb):
                for process in context.processes:
                    process.kill()
                for process in context.processes:
                    process.join()
                raise MemoryLimitExceeded(f"a rank's resident set passed {limit_mb:.0f} MiB")
        return json.loads(Path(out_dir, "row.json").read_text())


def _over_limit(pids: list[int], limit_mb: float) -> bool:
    for pid in pids:
        try:
            if _proc_status_mb("VmRSS", pid) > limit_mb:
                return True
        except OSError:
            continue
    return False


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
    from vlmcp.demo_assets import build_tiny_checkpoint

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
               warmup: int) -> StepTask:
    return StepTask(model_dir=model_dir, dtype=args.dtype, sp_size=args.sp_size or 1,
                    deltanet_cp=args.deltanet_cp, vision=args.vision, loss_chunk_mb=args.loss_chunk_mb,
                    seq_len=seq_len,
                    samples=samples, images=args.images, steps=steps, warmup=warmup)


def _bench_steps(args: argparse.Namespace, model_dir: str, device: torch.device, sp: Any) -> list[dict[str, Any]]:
    rows = []
    for seq_len in _lengths(args.seq_lens):
        _check_pack(model_dir, seq_len, args.samples_per_pack, args.images)
        if device.type == "cpu" and not _launched():
            task = _step_task(args, model_dir, seq_len, args.samples_per_pack, args.steps, args.warmup)
            row = {**run_fresh(task, task.sp_size, distributed=task.sp_size > 1), "fresh_process": True}
        else:
            row = _in_process_step(args, model_dir, seq_len, device, sp)
        rows.append(row)
        if "error" not in row:
            logger.info("seq_len %d: %.3f s per forward+backward, %.0f tokens/s, model %.0f MiB, "
                        "peak %.0f MiB, activations %.0f MiB", seq_len, row["step_time_s"],
                        row["tokens_per_s"], row["model_memory_mb"], row["peak_memory_mb"],
                        row["activation_memory_mb"])
    return rows


def _check_pack(model_dir: str, seq_len: int, samples: int, images: int) -> None:
    """Raise the ValueError of a pack that cannot be built, before any rank starts."""
    if images:
        from vlmcp.model.load import load_config

        synthetic_pack(seq_len, samples, load_config(model_dir), images)


def _in_process_step(args: argparse.Namespace, model_dir: str, seq_len: int, device: torch.device, sp: Any,
                     samples: int | None = None, steps: int | None = None, warmup: int | None = None) -> dict[str, Any]:
    """One length on the current world (launcher ranks, or one CUDA process). A CUDA
    out-of-memory error becomes a row with `error`."""
    task = _step_task(args, model_dir, seq_len, samples or args.samples_per_pack,
                      args.steps if steps is None else steps, args.warmup if warmup is None else warmup)
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
    if device.type == "cpu" and _launched() and (args.find_max_len or args.loss_only):
        problems.append("--find-max-len and --loss-only start their own processes on CPU: run them "
                        "without a launcher")
    if device.type == "cuda" and not _launched() and (args.sp_size or 1) > 1:
        problems.append("--sp-size > 1 on CUDA: launch one process per GPU with torchrun")
    if problems:
        raise ValueError("; ".join(problems))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `vlmcp bench` arguments; rank 0 writes the JSON."""
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
                              "threads_per_rank": threads}
    if not args.find_max_len:
        return {**report, "mode": "step", "results": _bench_steps(args, model_dir, device, sp)}
    max_len, probes = find_max_len(args, model_dir, device, sp)
    failed = [probe["seq_len"] for probe in probes if not probe["fits"]]
    return {**report, "mode": "find_max_len", "memory_budget_gb": args.memory_budget_gb,
            "granularity": args.granularity, "max_len": max_len,
            "first_failing_len": min(failed) if failed else None, "probes": probes}
