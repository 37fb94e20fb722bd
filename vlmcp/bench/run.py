"""`vlmcp bench`: step time, tokens/s and memory of the packed training module, per pack length.

Five modes here, each writing one JSON report (and the end-to-end modes of their own modules:
`--data-scale`, `--rollout-rss`, `--publish`, `--length-mix`, `--engine-mismatch`, `--ep-size`,
`--engine-push`):
- step (default): forward+backward of `PackedVLM` on a synthetic pack of each length (optionally
  with `--images` images of mixed sizes and `--videos` videos of `--frames` frames); no optimizer
  step. With `--pairs` the packs hold preference pairs whose halves show the same prompt images,
  and every length runs twice: the images held and encoded once for both halves (`pair_images`
  "shared", as vlmcp trains pairs) and once per half (`pair_images` "twice", as a collator that
  encodes each half's images does); their `vision_s` differ by the encoding saved. With
  `--vision both` (the default with `--videos`) each length runs under split and under
  replicated vision, and the row compares them: `vision_s_ratio` is the slowest rank's split
  `vision_s` over the mean replicated `vision_s` (each rank's wall-clock seconds in the vision
  tower's forward per step), `vision_cpu_s_ratio` the same for the rank processes' CPU seconds
  there (`vision_cpu_s`: on a shared CPU, what the rank itself spent). With `--routes` (a MoE
  model) every length runs without and with routing replay (model.router_replay), in fresh
  processes each, and the row compares them: `replay_time_ratio` (step time with / without) and
  `replay_peak_memory_mb` (the peak's difference). The replayed routes are by default the model's
  own, recorded in a scoring pass on the same pack (R2; the experts each get the same tokens, so
  the ratio is the replay's own cost), or with `--routes random` random experts on every token
  (which also moves tokens between experts).
- `--loss-only`: the lm_head + cross-entropy alone (`shard_loss_sum`, forward+backward) on random
  hidden states of each length.
- `--find-max-len`: the longest single sample whose step's peak memory fits `--memory-budget-gb`.
- `--saved-bytes`: the bytes autograd saves for backward per token, per module, in one forward
  (`vlmcp.bench.saved_bytes`).
- `--compare-alst`: vlmcp's training step beside stock DeepSpeed ALST's on an all-attention tiny
  model, interleaved fresh processes (`vlmcp.bench.alst`).

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

from vlmcp.bench.inputs import recorded_routes, synthetic_pack, synthetic_pairs, synthetic_routes
from vlmcp.bench.length_mix import MIX_FLAGS, run_length_mix
from vlmcp.bench.procs import Memory, MemoryLimitExceeded, run_fresh
from vlmcp.bench.saved_bytes import SavedBytesTask
from vlmcp.data.batch import PackedBatch
from vlmcp.device import compute_device
from vlmcp.model.flops import Trains, batch_flops, gemm_shapes, lm_head_flops
from vlmcp.model.loss import CE_BYTES_PER_LOGIT, DEFAULT_LOSS_CHUNK_MB, shard_loss_sum, vocab_chunk_rows
from vlmcp.parallel import comm
from vlmcp.parallel.modes import DELTANET_KERNELS, DELTANET_MODES
from vlmcp.training.utilisation import Peak, device_peak, utilisation

logger = logging.getLogger(__name__)

#: The tiny bench model's defaults (`--vocab-size`, `--hidden-size`).
DEFAULT_VOCAB = 512
DEFAULT_HIDDEN = 64
#: `--seq-lens` of the step modes when not given.
DEFAULT_SEQ_LENS = "1024,4096"


# --------------------------------------------------------------------------- one rank's work


@dataclass(frozen=True)
class StepTask:
    """Forward+backward of the packed module on one synthetic pack length (every rank)."""

    model_dir: str
    dtype: str
    sp_size: int
    deltanet_cp: str
    deltanet_kernel: str
    vision: str
    loss_chunk_mb: float
    seq_len: int
    samples: int
    images: int
    steps: int
    warmup: int
    #: "" (plain samples), or the pairs' images "shared" or encoded "twice" (`synthetic_pairs`).
    pair_images: str = ""
    #: PackedVLM's memory switches: gradient_checkpointing, tiled_mlp, offload_activations.
    memory_options: tuple[tuple[str, bool], ...] = ()
    videos: int = 0
    frames: int = 0
    video_grid: tuple[int, int] = (16, 16)
    #: The device's peak in 10^12 FLOP/s (`vlmcp.training.utilisation`), for the row's mfu.
    peak_tflops: float | None = None
    #: Routing replay: "" none, "recorded" the model's own routes from a scoring pass on the same
    #: pack (`recorded_routes`), "random" random routes on every token (`synthetic_routes`).
    routes: str = ""

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
                           loss_chunk_mb=self.loss_chunk_mb, deltanet_kernel=self.deltanet_kernel,
                           **dict(self.memory_options))
        module.train()
        config = module.hf_model.config
        if self.pair_images:
            batch = synthetic_pairs(self.seq_len, self.samples // 2, config, self.images,
                                    shared=self.pair_images == "shared")
        else:
            batch = synthetic_pack(self.seq_len, self.samples, config, self.images,
                                   videos=self.videos, frames=self.frames,
                                   video_group_hw=self.video_grid)
        if self.routes == "random":
            batch.routes = synthetic_routes(batch.num_tokens, config.get_text_config())
        elif self.routes == "recorded":
            batch.routes = recorded_routes(module, batch)
        flops = batch_flops(config, batch, Trains(vision=module.vision_trainable)).total
        row = {**measure_steps(module, batch, self, memory), "deltanet_kernel_ran": module.deltanet_kernel,
               "routes": self.routes}
        if self.routes:
            replayed, agreed = module.router_replay.take_totals()
            row.update(router_replay_tokens=replayed,
                       router_replay_agreement=agreed / replayed if replayed else None)
        row.update(utilisation(flops, row["step_time_s"], comm.world_size(), self.peak_tflops))
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
        vision_timer.restart()
        started = time.perf_counter()
        with module.micro_batch(batch):
            loss, _, _ = module(batch)
            loss.backward()
        module.zero_grad(set_to_none=True)
        _synchronize(memory.device)
        if step >= task.warmup:
            times.append(time.perf_counter() - started)
            vision_timer.keep()
    vision_timer.remove()
    peak_mb = memory.peak_mb()
    steps = max(task.steps, 1)
    mine = [model_mb, peak_mb, vision_timer.wall / steps, vision_timer.cpu / steps, *times]
    table = torch.zeros(comm.world_size(), len(mine), dtype=torch.float64)
    table[comm.rank()] = torch.tensor(mine, dtype=torch.float64)
    table = comm.all_reduce_sum(table)
    per_rank = [{"rank": r, "model_memory_mb": float(row[0]), "peak_memory_mb": float(row[1]),
                 "activation_memory_mb": float(row[1] - row[0]), "vision_s": float(row[2]),
                 "vision_cpu_s": float(row[3]),
                 "step_time_s": float(row[4:].mean()) if task.steps else 0.0}
                for r, row in enumerate(table)]
    step_s = float(table[:, 4:].max(dim=0).values.mean()) if task.steps else 0.0
    image_tokens = int((batch.mm_token_type_ids == 1).sum())
    return {"seq_len": task.seq_len, "samples_per_pack": task.samples, "images": task.images,
            "image_tokens": image_tokens, "videos": task.videos, "frames": task.frames,
            "video_tokens": int((batch.mm_token_type_ids == 2).sum()),
            "vision": task.vision, "step_time_s": step_s,
            "tokens_per_s": task.seq_len / step_s if step_s else 0.0,
            "model_memory_mb": max(r["model_memory_mb"] for r in per_rank),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in per_rank),
            "activation_memory_mb": max(r["activation_memory_mb"] for r in per_rank),
            "vision_s": max(r["vision_s"] for r in per_rank),
            "vision_cpu_s": max(r["vision_cpu_s"] for r in per_rank), "per_rank": per_rank,
            "fragmentation_mb": memory.fragmentation_mb(),
            "memory_kind": memory.kind, "peak_is_cumulative": not peak_reset}


class _VisionTimer:
    """Seconds spent inside `vision`'s forward, from forward pre/post hooks (CUDA: synchronized):
    wall-clock, and this process's CPU time (on a shared CPU the CPU time is what the rank
    itself spent, whatever else the cores ran). `wall` and `cpu` sum the kept steps."""

    def __init__(self, vision: nn.Module, device: torch.device) -> None:
        self.device = device
        self.wall = self.cpu = 0.0
        self._step = [0.0, 0.0]
        self._started = (0.0, 0.0)
        self._hooks = [vision.register_forward_pre_hook(self._pre), vision.register_forward_hook(self._post)]

    def restart(self) -> None:
        """Start a step's count."""
        self._step = [0.0, 0.0]

    def keep(self) -> None:
        """Add the step's count to the totals."""
        self.wall += self._step[0]
        self.cpu += self._step[1]

    def _pre(self, *_: Any) -> None:
        _synchronize(self.device)
        self._started = (time.perf_counter(), time.process_time())

    def _post(self, *_: Any) -> None:
        _synchronize(self.device)
        self._step[0] += time.perf_counter() - self._started[0]
        self._step[1] += time.process_time() - self._started[1]

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

    sizes = {"intermediate_size": args.intermediate_size} if args.intermediate_size else {}
    return str(build_tiny_checkpoint(Path(scratch, "model"), moe=args.moe, tokenizer=False,
                                     vocab_size=args.vocab_size, hidden_size=args.hidden_size, **sizes))


def _is_moe(model_dir: str | None) -> bool:
    """Whether the checkpoint at `model_dir` (None: none given) is a mixture-of-experts model."""
    if model_dir is None:
        return False
    from vlmcp.model.load import load_config

    return getattr(load_config(model_dir).get_text_config(), "num_experts", None) is not None


def _model_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(vocab, hidden) of the benched model: `--model`'s config, else the tiny model's flags."""
    if not args.model:
        return args.vocab_size, args.hidden_size
    from vlmcp.model.load import load_config

    text = load_config(args.model).get_text_config()
    return int(text.vocab_size), int(text.hidden_size)


def _step_task(args: argparse.Namespace, model_dir: str, seq_len: int, samples: int, steps: int,
               warmup: int, vision: str | None = None, pair_images: str = "",
               routes: str = "") -> StepTask:
    return StepTask(model_dir=model_dir, dtype=args.dtype, sp_size=args.sp_size or 1,
                    deltanet_cp=args.deltanet_cp, deltanet_kernel=args.deltanet_kernel,
                    vision=vision or args.vision, loss_chunk_mb=args.loss_chunk_mb,
                    seq_len=seq_len, samples=samples, images=args.images, steps=steps,
                    warmup=warmup, pair_images=pair_images, memory_options=_memory_options(args),
                    videos=args.videos, frames=args.frames, video_grid=args.video_grid,
                    peak_tflops=args.peak.tflops, routes=routes)


def _memory_options(args: argparse.Namespace) -> tuple[tuple[str, bool], ...]:
    """PackedVLM's memory switches from the bench flags."""
    return (("gradient_checkpointing", args.gradient_checkpointing), ("tiled_mlp", args.tiled_mlp),
            ("offload_activations", args.offload_activations))


def _one_step_row(args: argparse.Namespace, model_dir: str, seq_len: int, device: torch.device,
                  sp: Any, vision: str, pair_images: str = "", routes: str = ""
                  ) -> dict[str, Any]:
    if device.type == "cpu" and not _launched():
        task = _step_task(args, model_dir, seq_len, args.samples_per_pack, args.steps,
                          args.warmup, vision, pair_images, routes)
        return {**run_fresh(task, task.sp_size, distributed=task.sp_size > 1),
                "fresh_process": True}
    return _in_process_step(args, model_dir, seq_len, device, sp, vision=vision,
                            pair_images=pair_images, routes=routes)


def _replay_compared(native: dict[str, Any], replayed: dict[str, Any]) -> dict[str, Any]:
    """One length without and with routing replay side by side: the step-time ratio and the
    peak and activation memory differences (MiB, largest rank)."""
    row = {"seq_len": native["seq_len"], "native": native, "replayed": replayed}
    if "error" in native or "error" in replayed:
        return row
    return {**row, "replay_time_ratio": replayed["step_time_s"] / native["step_time_s"],
            "replay_peak_memory_mb": replayed["peak_memory_mb"] - native["peak_memory_mb"],
            "replay_activation_memory_mb": (replayed["activation_memory_mb"]
                                            - native["activation_memory_mb"])}


def _compared(split: dict[str, Any], replicated: dict[str, Any]) -> dict[str, Any]:
    """One length's split and replicated rows side by side, with the vision time ratio."""
    row = {"seq_len": split["seq_len"], "split": split, "replicated": replicated}
    if "error" in split or "error" in replicated:
        return row
    for key in ("vision_s", "vision_cpu_s"):
        mean = sum(r[key] for r in replicated["per_rank"]) / len(replicated["per_rank"])
        row.update({f"split_{key}": [r[key] for r in split["per_rank"]],
                    f"replicated_{key}": [r[key] for r in replicated["per_rank"]],
                    f"{key}_ratio": split[key] / mean if mean else None})
    return row


def _bench_steps(args: argparse.Namespace, model_dir: str, device: torch.device, sp: Any) -> list[dict[str, Any]]:
    rows = []
    for seq_len in _lengths(args.seq_lens):
        _check_pack(args, model_dir, seq_len, args.samples_per_pack)
        modes = ["split", "replicated"] if args.vision == "both" else [args.vision]
        if args.routes:
            measured = [_one_step_row(args, model_dir, seq_len, device, sp, modes[0], routes=kind)
                        for kind in ("", args.routes)]
            rows.append(_replay_compared(*measured))
            if "replay_time_ratio" in rows[-1]:
                logger.info("seq_len %d: routing replay / native step time %.3f, peak memory "
                            "%+.0f MiB", seq_len, rows[-1]["replay_time_ratio"],
                            rows[-1]["replay_peak_memory_mb"])
            continue
        for pair_images in ("shared", "twice") if args.pairs else ("",):
            measured = [_one_step_row(args, model_dir, seq_len, device, sp, mode, pair_images)
                        for mode in modes]
            for row in measured:
                if "error" not in row:
                    logger.info("seq_len %d (%s vision%s): %.3f s per forward+backward, %.0f "
                                "tokens/s, %.3g model TFLOPs, mfu %s, model %.0f MiB, peak %.0f "
                                "MiB, activations %.0f MiB, vision %.3f s on the slowest rank",
                                seq_len, row["vision"],
                                f", pair images {pair_images}" if pair_images else "",
                                row["step_time_s"], row["tokens_per_s"], row["model_tflops"],
                                _percent(row["mfu"]), row["model_memory_mb"],
                                row["peak_memory_mb"], row["activation_memory_mb"],
                                row["vision_s"])
            rows.append(_compared(*measured) if len(measured) == 2 else measured[0])
            if rows[-1].get("vision_s_ratio") is not None:
                logger.info("seq_len %d: split / replicated vision time %.2f (wall), %.2f (CPU)",
                            seq_len, rows[-1]["vision_s_ratio"], rows[-1]["vision_cpu_s_ratio"])
    return rows


def _bench_saved_bytes(args: argparse.Namespace, model_dir: str, device: torch.device,
                       sp: Any) -> list[dict[str, Any]]:
    """Per length: the bytes autograd saves per token, per module (`vlmcp.bench.saved_bytes`)."""
    rows = []
    for seq_len in _lengths(args.seq_lens):
        task = SavedBytesTask(model_dir=model_dir, dtype=args.dtype, sp_size=args.sp_size or 1,
                              deltanet_cp=args.deltanet_cp, seq_len=seq_len,
                              samples=args.samples_per_pack,
                              module_options={"deltanet_kernel": args.deltanet_kernel,
                                              **dict(_memory_options(args))})
        if device.type == "cpu" and not _launched():
            row = run_fresh(task, task.sp_size, distributed=task.sp_size > 1)
        else:
            row = task.run(device, sp)
        rows.append(row)
        for kind in row["per_layer_kind"][:8]:
            logger.info("seq_len %d: %-40s %9.1f KB per token", seq_len, kind["module"],
                        kind["bytes_per_token"] / 1e3)
    return rows


def _check_pack(args: argparse.Namespace, model_dir: str, seq_len: int, samples: int) -> None:
    """Raise the ValueError of a pack that cannot be built, before any rank starts."""
    if args.pairs and (samples % 2 or not args.images):
        raise ValueError(f"--pairs needs an even --samples-per-pack (got {samples}) and --images "
                         "(the prompts' images the halves share)")
    if args.pairs and args.videos:
        raise ValueError("--pairs and --videos: the benched pairs share prompt images only")
    if args.images or args.videos:
        from vlmcp.model.load import load_config

        config = load_config(model_dir)
        if args.pairs:
            synthetic_pairs(seq_len, samples // 2, config, args.images)
        else:
            synthetic_pack(seq_len, samples, config, args.images, videos=args.videos,
                           frames=args.frames, video_group_hw=args.video_grid)


def _in_process_step(args: argparse.Namespace, model_dir: str, seq_len: int, device: torch.device, sp: Any,
                     samples: int | None = None, steps: int | None = None, warmup: int | None = None,
                     vision: str | None = None, pair_images: str = "", routes: str = ""
                     ) -> dict[str, Any]:
    """One length on the current world (launcher ranks, or one CUDA process). A CUDA
    out-of-memory error becomes a row with `error`."""
    task = _step_task(args, model_dir, seq_len, samples or args.samples_per_pack,
                      args.steps if steps is None else steps, args.warmup if warmup is None else warmup,
                      vision, pair_images, routes)
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
    peak = _bench_peak(args, "", device, torch.get_num_threads(), shapes=[(hidden, vocab)])
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
               "fresh_process": device.type == "cpu", "peak_tflops": peak.tflops,
               # the trained head's forward, and its backward for the hidden states and the weight
               **utilisation(3 * lm_head_flops(seq_len, hidden, vocab), trained["loss_time_s"], 1,
                             peak.tflops)}
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
    _check_pack(args, model_dir, args.granularity, 1)
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


#: The step benchmark's flags that a separate mode does not use: given with it, they are refused.
_IGNORED_BY_MODE = {
    "saved_bytes": ("images", "videos", "vision", "loss_chunk_mb", "routes"),
    "find_max_len": ("routes",),
    "compare_alst": ("moe", "hidden_size", "intermediate_size", "images", "videos", "vision", "routes",
                     "dtype", "deltanet_cp", "deltanet_kernel", "gradient_checkpointing",
                     "tiled_mlp", "offload_activations", "loss_chunk_mb"),
    "loss_only": ("model", "moe", "intermediate_size", "images", "videos", "vision", "sp_size", "routes",
                  "deltanet_cp", "deltanet_kernel", "gradient_checkpointing", "tiled_mlp",
                  "offload_activations"),
    "engine_mismatch": ("moe", "vocab_size", "hidden_size", "intermediate_size", "images",
                        "pairs", "videos", "vision", "dtype", "deltanet_cp", "deltanet_kernel",
                        "gradient_checkpointing", "tiled_mlp", "offload_activations",
                        "loss_chunk_mb", "loss_only", "saved_bytes", "compare_alst",
                        "find_max_len", "memory_budget_gb", "data_scale", "rollout_rss",
                        "routes", "publish", "push_models"),
    "length_mix": ("model", "moe", "images", "videos", "vision", "pairs", "deltanet_kernel",
                   "gradient_checkpointing", "tiled_mlp", "offload_activations", "loss_chunk_mb",
                   "loss_only", "find_max_len", "saved_bytes", "compare_alst", "data_scale",
                   "rollout_rss", "engine_mismatch", "routes", "publish", "push_models"),
    "ep_size": ("model", "moe", "images", "videos", "vision", "pairs", "sp_size", "dtype",
                "deltanet_cp", "deltanet_kernel", "gradient_checkpointing", "tiled_mlp",
                "offload_activations", "loss_chunk_mb", "loss_only", "find_max_len",
                "memory_budget_gb", "saved_bytes", "compare_alst", "data_scale", "rollout_rss",
                "engine_mismatch", "weights", "routes", "publish", "length_mix", "push_models"),
    "engine_push": ("model", "moe", "images", "videos", "vision", "pairs", "sp_size", "dtype",
                    "hidden_size", "intermediate_size", "vocab_size", "deltanet_cp",
                    "deltanet_kernel", "gradient_checkpointing", "tiled_mlp",
                    "offload_activations", "loss_chunk_mb", "loss_only", "find_max_len",
                    "saved_bytes", "compare_alst", "data_scale", "rollout_rss",
                    "engine_mismatch", "routes", "publish", "length_mix"),
    "rl": ("model", "moe", "images", "videos", "vision", "pairs", "sp_size", "dtype",
           "hidden_size", "intermediate_size", "vocab_size", "deltanet_cp", "deltanet_kernel",
           "gradient_checkpointing", "tiled_mlp", "offload_activations", "loss_chunk_mb",
           "loss_only", "find_max_len", "saved_bytes", "compare_alst", "data_scale",
           "rollout_rss", "engine_mismatch", "routes", "publish", "length_mix", "engine_push",
           "push_models"),
    "publish": ("model", "moe", "images", "videos", "vision", "pairs", "deltanet_cp",
                "deltanet_kernel", "gradient_checkpointing", "tiled_mlp", "offload_activations",
                "loss_chunk_mb", "loss_only", "find_max_len", "saved_bytes", "compare_alst",
                "data_scale", "rollout_rss", "engine_mismatch", "routes", "push_models"),
}
#: The values those flags have when not given (the others default to None, False or 0).
_FLAG_DEFAULTS = {"dtype": "float32", "deltanet_cp": DELTANET_MODES[0],
                  "deltanet_kernel": DELTANET_KERNELS[0]}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _ignored_flags(args: argparse.Namespace) -> list[str]:
    """One problem per mode given with flags it does not use (before defaults are filled)."""
    problems = []
    for mode, names in _IGNORED_BY_MODE.items():
        given = [name for name in names
                 if getattr(args, name) not in (_FLAG_DEFAULTS.get(name), None, False, 0)]
        if getattr(args, mode) and given:
            problems.append(f"{_flag(mode)} does not use {', '.join(map(_flag, given))}")
    return problems


def _resolve_args(args: argparse.Namespace, device: torch.device) -> None:
    """Fill the defaults that live in the model code; raise ValueError naming bad flag mixes."""
    problems = _ignored_flags(args)
    args.seq_lens = args.seq_lens or DEFAULT_SEQ_LENS
    if args.model and (args.vocab_size is not None or args.hidden_size is not None
                       or args.intermediate_size is not None):
        problems.append("--vocab-size, --hidden-size and --intermediate-size shape the built-in tiny "
                        "model; --model has its own")
    if args.offload_activations and not args.gradient_checkpointing:
        problems.append("--offload-activations moves the checkpointed layer inputs: it needs "
                        "--gradient-checkpointing")
    args.vocab_size = args.vocab_size or DEFAULT_VOCAB
    args.hidden_size = args.hidden_size or DEFAULT_HIDDEN
    args.loss_chunk_mb = args.loss_chunk_mb or DEFAULT_LOSS_CHUNK_MB
    args.vision = args.vision or ("both" if args.videos and not args.find_max_len else "split")
    if args.videos and args.frames < 2:
        problems.append("--videos needs --frames >= 2 (a temporal group is two frames)")
    if args.find_max_len and args.vision == "both":
        problems.append("--find-max-len measures one vision mode: give --vision split or replicated")
    if args.find_max_len and args.memory_budget_gb is None:
        problems.append("--find-max-len needs --memory-budget-gb")
    modes = [flag for flag, on in (("--find-max-len", args.find_max_len), ("--loss-only", args.loss_only),
                                   ("--saved-bytes", args.saved_bytes), ("--compare-alst", args.compare_alst))
             if on]
    if len(modes) > 1:
        problems.append(f"{' and '.join(modes)} are separate modes")
    if args.pairs and modes:
        problems.append(f"--pairs is a flag of the step benchmark, not of {modes[0]}")
    if args.routes and (args.pairs or args.vision == "both"):
        problems.append("--routes compares replay with native routing: give it without --pairs "
                        "and with one --vision mode")
    if args.routes and not (args.moe or _is_moe(args.model)):
        problems.append("--routes replays MoE routes: it needs --moe or a MoE --model")
    if device.type == "cpu" and _launched() and (args.find_max_len or args.loss_only or args.compare_alst):
        problems.append("--find-max-len, --loss-only and --compare-alst start their own processes on "
                        "CPU: run them without a launcher")
    if args.compare_alst and device.type == "cuda" and (args.sp_size or 1) > 1:
        problems.append("--compare-alst on CUDA runs one process (SP 1); SP > 1 runs on CPU over gloo")
    if device.type == "cuda" and not _launched() and (args.sp_size or 1) > 1:
        problems.append("--sp-size > 1 on CUDA: launch one process per GPU with torchrun")
    if problems:
        raise ValueError("; ".join(problems))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `vlmcp bench` arguments; rank 0 writes the JSON."""
    mix_flags = [_flag(name) for name in MIX_FLAGS if getattr(args, name) not in (None, False)]
    if mix_flags and not args.length_mix:
        raise ValueError(f"{', '.join(mix_flags)}: flags of --length-mix")
    if args.ep_world is not None and args.ep_size is None:
        raise ValueError("--ep-world: a flag of --ep-size")
    if args.ep_size is not None:
        from vlmcp.bench.expert_parallel import flag_problems, run_expert_parallel

        problems = [p for p in _ignored_flags(args) if p.startswith("--ep-size ")] + flag_problems(args)
        if problems:
            raise ValueError("; ".join(problems))
        return _write_report(args, run_expert_parallel(args))
    if args.engine_mismatch or args.weights or args.temperature != 1.0:
        from vlmcp.bench.engine_mismatch import run_engine_mismatch

        problems = _ignored_flags(args) if args.engine_mismatch else [
            "--weights and --temperature are flags of --engine-mismatch"]
        if problems:
            raise ValueError("; ".join(problems))
        return _write_report(args, run_engine_mismatch(args))
    if args.data_scale:
        from vlmcp.bench.data_scale import run_data_scale

        return _write_report(args, run_data_scale(args))
    if args.rollout_rss:
        from vlmcp.bench.rollout_rss import run_rollout_rss

        return _write_report(args, run_rollout_rss(args))
    if args.length_mix:
        problems = [p for p in _ignored_flags(args) if p.startswith("--length-mix ")]
        if problems:
            raise ValueError("; ".join(problems))
        return _write_report(args, run_length_mix(args))
    if args.rl:
        problems = [p for p in _ignored_flags(args) if p.startswith("--rl ")]
        if problems:
            raise ValueError("; ".join(problems))
        from vlmcp.bench.rl_loop import run_rl_loop_bench

        return _write_report(args, run_rl_loop_bench(args))
    if args.engine_push:
        problems = [p for p in _ignored_flags(args) if p.startswith("--engine-push ")]
        if problems:
            raise ValueError("; ".join(problems))
        from vlmcp.bench.engine_push import run_engine_push_bench

        return _write_report(args, run_engine_push_bench(args))
    if args.publish:
        from vlmcp.bench.publish import run_publish_bench

        problems = [p for p in _ignored_flags(args) if p.startswith("--publish ")]
        if problems:
            raise ValueError("; ".join(problems))
        return _write_report(args, run_publish_bench(args))
    device = compute_device()
    _resolve_args(args, device)
    vocab, hidden = _model_sizes(args)
    report: dict[str, Any] = {
        "model": args.model or f"tiny {'moe' if args.moe else 'dense'} (random init)",
        "dtype": args.dtype, "vocab_size": vocab, "hidden_size": hidden, "device": str(device),
        "loss_chunk_mb": args.loss_chunk_mb}
    if args.loss_only:
        report.update(mode="loss_only", results=_bench_loss(args, device))
    elif args.compare_alst:
        report.update(_compare_alst(args, device))
    else:
        with tempfile.TemporaryDirectory(prefix="vlmcp-bench-") as scratch:
            report.update(_bench_model(args, _model_dir(args, scratch), device))
    return _write_report(args, report)


def _compare_alst(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The report entries of --compare-alst (`vlmcp.bench.alst`), in fresh processes."""
    from vlmcp.bench.alst import ALST_MODEL, build_compare_model, compare_alst

    with tempfile.TemporaryDirectory(prefix="vlmcp-bench-") as scratch:
        model_dir = args.model or build_compare_model(scratch, args.vocab_size)
        peak = _bench_peak(args, model_dir, device, max(1, torch.get_num_threads() // (args.sp_size or 1)))
        rows = compare_alst(model_dir, _lengths(args.seq_lens), args.sp_size or 1, args.steps,
                            args.warmup, args.repeats, device.type, peak.tflops)
    for row in rows:
        logger.info("seq_len %d, SP %d: vlmcp / ALST step time %.3f (min %.3f, max %.3f), activation "
                    "memory %.3f; losses differ by %.1e", row["seq_len"], row["sp_size"],
                    row["step_time_ratio"]["median"], row["step_time_ratio"]["min"],
                    row["step_time_ratio"]["max"], row["activation_memory_ratio"]["median"],
                    row["loss_rel_diff"])
        logger.info("seq_len %d, SP %d: mfu vlmcp %s, ALST %s (%.3g model TFLOPs a step)",
                    row["seq_len"], row["sp_size"], _percent(row["mfu"]["vlmcp"]),
                    _percent(row["mfu"]["alst"]), row["model_tflops"])
        if "step_cpu_time_ratio" in row:
            logger.info("seq_len %d, SP %d: vlmcp / ALST step CPU time (all ranks) %.3f (min %.3f, max %.3f)",
                        row["seq_len"], row["sp_size"], row["step_cpu_time_ratio"]["median"],
                        row["step_cpu_time_ratio"]["min"], row["step_cpu_time_ratio"]["max"])
    return {"mode": "compare_alst", "alst_model": None if args.model else ALST_MODEL,
            "sp_size": args.sp_size or 1, "peak_tflops": peak.tflops, "peak_source": peak.source,
            "results": rows}


def _percent(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{100 * fraction:.2f} %"


def _bench_peak(args: argparse.Namespace, model_dir: str, device: torch.device, threads: int,
                shapes: list[tuple[int, int]] | None = None) -> Peak:
    """The device's peak for the run's mfu, once per bench run: on CPU measured on the GEMMs of
    the benched model (or `shapes`) at the longest length's rows per rank, on `threads` threads."""
    if shapes is None:
        from vlmcp.model.load import load_config

        shapes = gemm_shapes(load_config(model_dir))
    rows = max(_lengths(args.seq_lens)) // (args.sp_size or 1)
    peak = device_peak(device, getattr(torch, args.dtype), shapes, rows, threads)
    logger.info("peak for mfu: %s TFLOP/s per device (%s)",
                "unknown" if peak.tflops is None else f"{peak.tflops:.3g}", peak.source)
    return peak


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
                              "deltanet_cp": args.deltanet_cp, "deltanet_kernel": args.deltanet_kernel,
                              "vision": args.vision, "images": args.images, "pairs": args.pairs,
                              "videos": args.videos, "frames": args.frames,
                              "video_grid": list(args.video_grid), "threads_per_rank": threads,
                              "routes": args.routes,
                              **dict(_memory_options(args))}
    if args.saved_bytes:
        return {**report, "mode": "saved_bytes", "results": _bench_saved_bytes(args, model_dir, device, sp)}
    args.peak = _bench_peak(args, model_dir, device, threads)
    report.update(peak_tflops=args.peak.tflops, peak_source=args.peak.source)
    if not args.find_max_len:
        return {**report, "mode": "step", "results": _bench_steps(args, model_dir, device, sp)}
    max_len, probes = find_max_len(args, model_dir, device, sp)
    failed = [probe["seq_len"] for probe in probes if not probe["fits"]]
    return {**report, "mode": "find_max_len", "memory_budget_gb": args.memory_budget_gb,
            "granularity": args.granularity, "max_len": max_len,
            "first_failing_len": min(failed) if failed else None, "probes": probes}
