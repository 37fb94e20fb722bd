"""`vlmcp bench --length-mix`: tokens/s of whole RL steps of mixed lengths, fixed SP against a
degree per micro-batch (`parallel.sp_dynamic`).

The steps are rollout steps (`rollouts.dir`), so each is one optimizer step over all its samples,
as an RL step is. `--warmup` + `--steps` steps are written once, each of `--mix-samples` chat
samples whose lengths are drawn from a seeded RL-like distribution (`mix_lengths`):

    `--mix-long` samples at the limit (`--mix-max-len`, data.max_seq_len), the others log-normal
    with median `--mix-median` tokens and sigma 0.75 (cut to [32, limit]); every other sample shows
    one image of 64, 128 or 256 pixels a side (4, 16 or 64 placeholder tokens). The prompt is
    short and the reply is the sample's bulk, as in a rollout.

The same rollout job (a tiny dense Qwen3.5 of width `--hidden-size`, default 64, its MLP 3 x
hidden; `--sp-size` ranks, default 2, SP over all of them; ZeRO-0, SGD) then trains every step
twice per repeat, once with `parallel.sp_dynamic` false and once true, in fresh processes each, `--repeats` times
interleaved. Per run, the timed steps (after the warmup steps) give `tokens_per_s` (their tokens
over their summed `step_time_s`, the training rows' own clock) and `mfu` (the rows' mfu weighted by
step time); the report gives min/median/max over the repeats and `tokens_per_s_ratio`, the
medians' ratio (dynamic over fixed). `plan` says how the dynamic runs split the timed steps'
packs and tokens between the degrees (`degree1_token_fraction`: the share of tokens in packs that
ran whole on one rank), and `first_step_loss` both ways (the same step, so the same loss to fp32
rounding). With `--mix-profile`, one more run each way goes under torch.profiler: `profile` gives
its steps' summed seconds and each rank's seconds in each kind of gloo collective (the attention
all-to-alls, the DeltaNet state all-gathers, the all-reduces of gradients and agreements,
broadcasts), which is where the SP degree's cost shows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlmcp.bench.jobs import scratch_folder, short_job, timed_training
from vlmcp.bench.procs import run_fresh
from vlmcp.data.rollouts import STABLE, step_dir

#: The sides (pixels) of the samples' square images: 4, 16 and 64 placeholder tokens.
IMAGE_SIDES = (64, 128, 256)
#: Width of the benched model unless --hidden-size says otherwise (the step benchmark's too).
DEFAULT_HIDDEN = 64
#: The ways compared: parallel.sp_dynamic of each.
WAYS = {"fixed": False, "dynamic": True}
_SHORTEST, _SIGMA, _PROMPT_DIGITS = 32, 0.75, 8
#: The mix's flags and their values when not given.
MIX_FLAGS = {"mix_samples": 64, "mix_median": 256, "mix_long": 1, "mix_max_len": 4096,
             "mix_profile": False}


def mix_lengths(samples: int, median: int, long: int, max_len: int, seed: int) -> list[int]:
    """The reply lengths (tokens) of one step: `long` at `max_len` less a margin for the chat
    template and the prompt, the others log-normal (median `median`, sigma 0.75) cut to
    [32, that limit]; in a seeded shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    limit = max_len - 4 * _PROMPT_DIGITS - IMAGE_SIDES[-1] // 4 - 32
    drawn = torch.exp(math.log(median) + _SIGMA * torch.randn(samples - long, generator=generator))
    lengths = [min(max(int(x), _SHORTEST), limit) for x in drawn.tolist()] + [limit] * long
    order = torch.randperm(samples, generator=generator).tolist()
    return [lengths[i] for i in order]


def _digits(count: int, generator: torch.Generator) -> str:
    """`count` random digits separated by spaces: 2 x count tokens of the tiny tokenizer."""
    return " ".join(str(d) for d in torch.randint(0, 10, (count,), generator=generator).tolist())


def write_mix_step(path: Path, lengths: list[int], seed: int) -> None:
    """A complete rollout step at `path`: one chat sample per reply length in `lengths`, every
    other one with an image (`IMAGE_SIDES` in turn)."""
    generator = torch.Generator().manual_seed(seed)
    (path / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, length in enumerate(lengths):
        record: dict[str, Any] = {"messages": [
            {"role": "user", "content": "Continue: " + _digits(_PROMPT_DIGITS, generator)},
            {"role": "assistant", "content": _digits(max(length // 2, 1), generator)}]}
        if i % 2 == 0:
            side = IMAGE_SIDES[(i // 2) % len(IMAGE_SIDES)]
            name = f"images/{i:04d}.png"
            colour = tuple(torch.randint(0, 256, (3,), generator=generator).tolist())
            Image.new("RGB", (side, side), colour).save(path / name)
            record["messages"][0]["content"] = "<image>" + record["messages"][0]["content"]
            record["images"] = [name]
        lines.append(json.dumps(record))
    (path / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    (path / STABLE).write_text("")


#: The collectives the profile sorts the ranks' time into (torch.profiler's gloo event names).
COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "broadcast")


@dataclass(frozen=True)
class LengthMixTask:
    """One run of the rollout job at `job_path` on every rank; rank 0 returns its training rows.

    With `profile`, the run goes under torch.profiler and the row adds `collective_s`: per
    collective kind (`COLLECTIVES`), each rank's seconds from the start of its gloo work to its
    end (the rank waits there for its peers), over the whole run."""

    job_path: str
    profile: bool = False

    def run(self, device: torch.device) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        from vlmcp.parallel import comm
        from vlmcp.training.metrics import read_metrics

        if self.profile:
            with profile(activities=[ProfilerActivity.CPU]) as profiled:
                run, _ = timed_training(self.job_path)
            seconds = torch.zeros(len(COLLECTIVES), comm.world_size(), dtype=torch.float64)
            for event in profiled.key_averages():
                kind = event.key.removeprefix("gloo:")
                if event.key.startswith("gloo:") and kind in COLLECTIVES:
                    seconds[COLLECTIVES.index(kind), comm.rank()] = event.cpu_time_total / 1e6
            comm.all_reduce_sum(seconds)
        else:
            run, _ = timed_training(self.job_path)
        rows = read_metrics(Path(run.job.output_dir, "metrics.jsonl")) if comm.rank() == 0 else []
        comm.shutdown()
        row: dict[str, Any] = {"rows": [row for row in rows if "tokens_per_s" in row]}
        if self.profile:
            row["collective_s"] = {kind: [round(s, 3) for s in per_rank]
                                   for kind, per_rank in zip(COLLECTIVES, seconds.tolist())}
        return row


def _timed(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One run's measure over its steps after `warmup`."""
    timed = [row for row in rows if row["step"] > warmup]
    tokens = sum(row["tokens"] for row in timed)
    seconds = sum(row["step_time_s"] for row in timed)
    mfu = [row.get("mfu") for row in timed]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mfu": None if None in mfu else sum(m * row["step_time_s"] for m, row in zip(mfu, timed))
            / seconds}


def _spread(values: list[float | None]) -> dict[str, float] | None:
    if not values or None in values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _plan(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """How the dynamic run's timed steps ran: packs and tokens at each degree."""
    packs: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for row in rows:
        if row["step"] > warmup:
            for degree, count in row["sp_degree_packs"].items():
                packs[degree] = packs.get(degree, 0) + count
            for degree, count in row["sp_degree_tokens"].items():
                tokens[degree] = tokens.get(degree, 0) + count
    return {"packs": packs, "tokens": tokens,
            "degree1_token_fraction": round(tokens.get("1", 0) / max(sum(tokens.values()), 1), 3)}


def _run(root: Path, args: argparse.Namespace, dynamic: bool, name: str,
         profile: bool = False) -> dict[str, Any]:
    """One fresh run of the rollout job over the steps under `root / "rollouts"` with the model
    at `root / "model"`, its job and output named `name`: `LengthMixTask`'s row."""
    out, job = root / f"out-{name}", root / f"job-{name}.json"
    job.write_text(json.dumps(short_job(
        {"path": str(root / "model"), "dtype": args.dtype},
        {"max_seq_len": args.mix_max_len, "num_workers": 1}, out, args.warmup + args.steps,
        parallel={"sp_size": args.sp_size, "deltanet_cp": args.deltanet_cp, "sp_dynamic": dynamic},
        rollouts={"dir": str(root / "rollouts"), "timeout_s": 60, "poll_s": 0.1})))
    return run_fresh(LengthMixTask(str(job), profile=profile), args.sp_size, distributed=False)


def _profiled(root: Path, args: argparse.Namespace, way: str, dynamic: bool) -> dict[str, Any]:
    """One more run of the job under torch.profiler: its steps' seconds and each rank's seconds
    in each kind of collective, over all its steps (the profiler slows the run: not a timing)."""
    row = _run(root, args, dynamic, f"profile-{way}", profile=True)
    return {"step_time_s": round(sum(r["step_time_s"] for r in row["rows"]), 3),
            "collective_s": row["collective_s"]}


def run_length_mix(args: argparse.Namespace) -> dict[str, Any]:
    """The `--length-mix` report (see the module docstring)."""
    from vlmcp.model.tiny import build_tiny_checkpoint

    for name, default in MIX_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.sp_size = args.sp_size or 2
    if args.sp_size < 2:
        raise ValueError("--length-mix compares SP degrees: give --sp-size >= 2")
    if args.mix_long >= args.mix_samples:
        raise ValueError("--mix-long must be below --mix-samples")
    hidden = args.hidden_size or DEFAULT_HIDDEN
    steps = args.warmup + args.steps
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    with scratch_folder(args.scratch, "vlmcp-length-mix-") as root:
        build_tiny_checkpoint(root / "model", seed=0, hidden_size=hidden,
                              intermediate_size=args.intermediate_size or 3 * hidden,
                              vocab_size=args.vocab_size or 512)
        lengths = [mix_lengths(args.mix_samples, args.mix_median, args.mix_long, args.mix_max_len,
                               seed=step) for step in range(1, steps + 1)]
        for step, step_lengths in enumerate(lengths, start=1):
            write_mix_step(step_dir(root / "rollouts", step), step_lengths, seed=step)
        for repeat in range(args.repeats):
            for way, dynamic in WAYS.items():
                rows = _run(root, args, dynamic, f"{way}-{repeat}")["rows"]
                runs[way].append({"rows": rows, **_timed(rows, args.warmup)})
                print(json.dumps({"way": way, "repeat": repeat,
                                  **{k: v for k, v in runs[way][-1].items() if k != "rows"}}),
                      flush=True)
        profiles = {way: _profiled(root, args, way, dynamic) for way, dynamic in WAYS.items()
                    if args.mix_profile}
    summary = {way: {"tokens_per_s": _spread([r["tokens_per_s"] for r in done]),
                     "mfu": _spread([r["mfu"] for r in done]),
                     "seconds": _spread([r["seconds"] for r in done])}
               for way, done in runs.items()}
    ratio = (summary["dynamic"]["tokens_per_s"]["median"]
             / summary["fixed"]["tokens_per_s"]["median"])
    reply_tokens = [n for step in lengths[args.warmup:] for n in step]
    return {"mode": "length_mix", "world": args.sp_size, "sp_size": args.sp_size,
            "model": f"tiny dense Qwen3.5, hidden {hidden}, 4 layers (random init)",
            "dtype": args.dtype, "deltanet_cp": args.deltanet_cp,
            "max_seq_len": args.mix_max_len, "samples_per_step": args.mix_samples,
            "median_reply_tokens": args.mix_median, "long_per_step": args.mix_long,
            "timed_steps": args.steps, "warmup_steps": args.warmup, "repeats": args.repeats,
            "timed_reply_tokens": {"total": sum(reply_tokens),
                                   "median": statistics.median(reply_tokens),
                                   "max": max(reply_tokens)},
            "plan": _plan(runs["dynamic"][0]["rows"], args.warmup),
            "first_step_loss": {way: done[0]["rows"][0]["loss"] for way, done in runs.items()},
            **summary, "tokens_per_s_ratio": round(ratio, 3),
            **({"profile": profiles} if profiles else {}),
            "runs": {way: [{k: v for k, v in r.items() if k != "rows"} for r in done]
                     for way, done in runs.items()}}
