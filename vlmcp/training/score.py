"""`vlmcp score`: the policy's logprob of every target token of data.train, no backward.

Each sample's record is one JSON line, in data order: {"index": i, "logprobs": [...],
"logprob_sum": s} with the logprob of each target token in order (target t of a sample is label
t+1 in the HF convention, so the list has one entry per label != -100 after the first token) and
their sum (float64, the sequence logprob), plus "entropy": [...] (the policy's softmax entropy at
the same positions) with --entropy. A preference pair's record holds one such object per half:
{"index": i, "chosen": {"logprobs", "logprob_sum"[, "entropy"]}, "rejected": {...}}; its
logprob sums are what `loss.reference_logps` reads (training/reference.py). A sample with
per-token `temperatures` is scored at them: log_softmax(logits / tau), as the trainer computes it.
A sample with `routed_experts` is scored with its routes replayed, as the trainer trains it. With
--routes (a MoE model) each sample's (each half's) object also holds "routed_experts": the experts
every one of its tokens went to in every MoE layer during this pass (replayed where the data has
routes, the policy's own top-k elsewhere), in the compact form of `vlmcp.data.routes` (start 0,
one row per token): the R2 routes of the scored policy, which a data file or rollout step can carry
to replay them in training.

The forward is training's: packed (first-fit, `data.max_seq_len`), SP-sharded, through the
DeepSpeed engine (ZeRO-3 gathers as in training) under no_grad; under `parallel.sp_dynamic`
training's degree plan: packs that fit one rank's budget run whole, one per SP rank. The slots
are dealt round-robin over the DP groups, as in evaluation (a group short of slots repeats one and
drops its result).
Each round is a phase of the run's watchdog (`train.collective_timeout_s`, training/watchdog.py:
a rank stuck in it ends the job naming the collective, a collective that fails is one error line),
and rank 0 counts the rounds on a progress bar.
After each round every rank's shard of values goes to every rank (one all-gather of [3, width]
per round, `comm.all_gather_world`); global rank 0 cuts the shards of each group back into
samples and alone writes the file, sorted by sample index.

`score_initial_reference` runs the same scoring inside a training run, before its first step, for
`loss.reference_logps` "initial" (the initial policy's sums of every preference pair).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.data.pack import Slot, plan_slots
from vlmcp.data.routes import encode_routes
from vlmcp.data.stream import SampleReader
from vlmcp.errors import CheckpointError, ConfigError, PreflightError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together, run_together
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.reference import INITIAL_FILE, read_reference
from vlmcp.training.setup import build_engine, start_checked
from vlmcp.training.watchdog import Watchdog

logger = logging.getLogger(__name__)


@torch.no_grad()
def score_samples(engine: Any, lengths: Sequence[int], load: Callable[[list[int]], PackedBatch],
                  max_seq_len: int, sp: SequenceParallel, entropy: bool = False,
                  chosen_lengths: Sequence[int] | None = None, routes: bool = False,
                  dynamic: bool = False, watchdog: Watchdog | None = None,
                  desc: str = "score") -> list[dict[str, Any]]:
    """Every row's record (see the module docstring), sorted by index, on global rank 0; an
    empty list on the other ranks. Every rank must call it (collectives each round).

    lengths: the rows' token counts (packed first-fit into `max_seq_len`; a pair's both halves);
    chosen_lengths: a pair row's chosen-half tokens, 0 for a single sample (None: no pairs);
    load(pack): the `PackedBatch` of the rows `pack` (only the packs of this rank's DP group are
    loaded); routes: also each sample's routes (a MoE model; one more all-gather per round). A
    pack that fails to load on any rank, whatever it raised, raises PreflightError on every rank.
    dynamic (`parallel.sp_dynamic`, an SP group of 2 or more): the packs follow training's degree
    plan (`dynamic_slots`): a slot of short packs runs one whole pack on each SP rank (a rank
    short of packs repeats one and drops its result), a long pack is spread as before.
    watchdog: each round is one phase it watches (`train.collective_timeout_s`; a failed
    collective is one CollectiveError line); rank 0 shows the rounds done on a progress bar
    named `desc`.
    """
    from tqdm.auto import tqdm

    slots = plan_slots(list(lengths), max_seq_len, sp.size, dynamic)
    records: dict[int, dict[str, Any]] = {}
    rounds = max(1, math.ceil(len(slots) / sp.dp_size))
    with tqdm(total=rounds, desc=desc, unit="round", dynamic_ncols=True,
              disable=comm.rank() != 0) as progress:
        for round_ in range(rounds):
            with watchdog.watch(f"{desc} round {round_ + 1} of {rounds}") if watchdog \
                    else contextlib.nullcontext():
                records.update(_score_round(engine, slots, round_, lengths, load, sp, entropy,
                                            chosen_lengths, routes))
            progress.update()
    return [records[i] for i in sorted(records)]


def _score_round(engine: Any, slots: list[Slot], round_: int, lengths: Sequence[int],
                 load: Callable[[list[int]], PackedBatch], sp: SequenceParallel, entropy: bool,
                 chosen_lengths: Sequence[int] | None, routes: bool) -> dict[int, dict[str, Any]]:
    """Round `round_` of `score_samples`: the records of its samples on global rank 0, an empty
    dict on the other ranks (every rank runs the round's collectives)."""
    records: dict[int, dict[str, Any]] = {}
    slot = slots[(round_ * sp.dp_size + sp.dp_rank) % len(slots)]
    pack, _ = slot.pack_of(sp.rank)
    batch = run_together(lambda: load(pack), PreflightError, "scoring")
    batch.sp_degree = slot.degree
    logprobs, entropies, *recorded = engine(batch, scores=True, routes=routes)
    targets = engine.module.plan(batch).shard(batch.targets, dim=0, pad_value=IGNORE_INDEX)
    width = torch.tensor([logprobs.numel()], dtype=torch.float64)
    width = int(comm.all_reduce_max(width)[0])
    # rows: logprobs, entropy, target mask, and this shard's length in [3, 0]
    local = torch.full((4, width), float("nan"), dtype=torch.float64)
    local[0, :logprobs.numel()] = logprobs.double().cpu()
    local[1, :entropies.numel()] = entropies.double().cpu()
    local[2, :targets.numel()] = (targets != IGNORE_INDEX).double().cpu()
    local[3, 0] = logprobs.numel()
    gathered = comm.all_gather_world(local)
    gathered_routes = _gather_routes(recorded[0], width) if routes else None
    if comm.rank() == 0:
        for group, group_slot in enumerate(slots[round_ * sp.dp_size:(round_ + 1) * sp.dp_size]):
            first = group * sp.size
            # (the global ranks holding a pack, that pack): all of the group's for a spread
            # pack, each rank its own for degree-1 packs
            held = ([(slice(first, first + sp.size), group_slot.packs[0])]
                    if group_slot.degree is None else
                    [(slice(first + r, first + r + 1), pack_rows)
                     for r, pack_rows in enumerate(group_slot.packs)])
            for rows, pack_rows in held:
                records.update(_pack_records(
                    gathered[rows], [(i, int(lengths[i]),
                                      int(chosen_lengths[i]) if chosen_lengths is not None
                                      else 0) for i in pack_rows], entropy,
                    None if gathered_routes is None else gathered_routes[rows]))
    return records


def _gather_routes(recorded: torch.Tensor, width: int) -> torch.Tensor:
    """Every rank's recorded routes ([S_local, L_moe, K] long), padded to `width` rows:
    [W, width, L_moe, K] (one all-gather)."""
    local = torch.full((width, *recorded.shape[1:]), -1, dtype=torch.long)
    local[:recorded.shape[0]] = recorded.cpu()
    return comm.all_gather_world(local)


def _pack_records(shards: torch.Tensor, members: list[tuple[int, int, int]], entropy: bool,
                  route_shards: torch.Tensor | None = None) -> dict[int, dict[str, Any]]:
    """shards: [P, 4, width] one SP group's gathered rows; members: (row index, length, chosen
    length or 0) in pack order -> {row index: record}. route_shards: [P, width, L_moe, K] the
    group's recorded routes, or None."""
    whole = torch.cat([shard[:3, :int(shard[3, 0])] for shard in shards], dim=1)
    routes = None if route_shards is None else torch.cat(
        [rows[:int(shard[3, 0])] for rows, shard in zip(route_shards, shards)])
    records = {}
    offset = 0
    for index, length, chosen in members:
        halves = [chosen, length - chosen] if chosen else [length]
        parts = []
        for half in halves:
            parts.append(_sample_scores(whole[:, offset:offset + half], entropy))
            if routes is not None:
                parts[-1]["routed_experts"] = encode_routes(routes[offset:offset + half].numpy())
            offset += half
        records[index] = ({"index": index, **parts[0]} if not chosen else
                          {"index": index, "chosen": parts[0], "rejected": parts[1]})
    return records


def _sample_scores(part: torch.Tensor, entropy: bool) -> dict[str, Any]:
    """One sample's scores from its [3, length] rows (logprobs, entropy, target mask)."""
    mask = part[2] == 1
    logprobs = part[0][mask]
    scores: dict[str, Any] = {"logprobs": logprobs.tolist(), "logprob_sum": float(logprobs.sum())}
    if entropy:
        scores["entropy"] = part[1][mask].tolist()
    return scores


def write_scores(records: Sequence[dict[str, Any]], path: Path) -> None:
    """One JSON line per record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def score(job: JobConfig, out: str | None = None, entropy: bool = False,
          routes: bool = False) -> Path:
    """Score data.train with the job's model on every rank of the launcher's world; returns the
    output path (default OUTPUT_DIR/scores.jsonl), written by global rank 0. A LoRA job
    (lora.r > 0) is a ConfigError: its adapters are not at model.path; so is `routes` on a dense
    model."""
    if job.lora.r:
        raise ConfigError(["config key 'lora.r': vlmcp score runs the model at model.path without "
                           "trained adapters; score the merged model of `vlmcp export --merge` "
                           "with lora.r 0"])
    if not job.data.train:
        raise ConfigError(["config key 'data.train': vlmcp score scores the files of data.train "
                           "(a rollout job's steps too: --set data.train=ROLLOUTS/step_N/FILE)"])
    preflight = start_checked(job, training=False)
    if routes and preflight.processor.routes is None:
        raise ConfigError(["vlmcp score --routes: config key 'model.path' is a dense model (its "
                           "config.json has no num_experts): it has no routes to record"])
    sp = SequenceParallel.initialize(job.parallel.sp_size)
    engine, _, _ = build_engine(job, preflight, sp)
    engine.eval()
    if any(w != 1 for w in preflight.train_weights):
        logger.warning("data.train weights are not used by vlmcp score: it scores every record of "
                       "the files once, in file order (index i counts records across the files)")
    reader = SampleReader(preflight.train_index, preflight.processor, job.data.max_seq_len,
                          job.data.truncate)
    index = preflight.train_index
    path = Path(out) if out else Path(job.output_dir) / "scores.jsonl"
    with Watchdog(job.train.collective_timeout_s, rank=comm.rank()) as watchdog:
        records = score_samples(engine, index.tokens.tolist(), reader.pack, job.data.max_seq_len,
                                sp, entropy, index.chosen_tokens.tolist(), routes,
                                dynamic=job.parallel.sp_dynamic, watchdog=watchdog)
        with watchdog.watch(f"writing {path}"):
            run_together(lambda: write_scores(records, path) if comm.rank() == 0 else None,
                         CheckpointError, f"writing {path}")
    return path


def score_initial_reference(engine: Any, reader: SampleReader, job: JobConfig,
                            sp: SequenceParallel) -> np.ndarray:
    """`loss.reference_logps` "initial": score data.train with the engine's current (initial)
    policy, write the records to OUTPUT_DIR/reference_logps.jsonl (global rank 0, atomically)
    and return the pairs' sums ([N, 2], training/reference.py) on every rank (every rank takes
    part)."""
    path = Path(job.output_dir) / INITIAL_FILE
    index = reader.index
    engine.eval()
    records = score_samples(engine, index.tokens.tolist(), reader.pack, job.data.max_seq_len, sp,
                            chosen_lengths=index.chosen_tokens.tolist(),
                            dynamic=job.parallel.sp_dynamic, desc="reference logps")
    engine.train()
    problems = []
    if comm.rank() == 0:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            write_scores(records, tmp)
            tmp.replace(path)
        except OSError as exc:
            problems.append(f"config key 'output_dir': cannot write {path}: {exc.strerror or exc}")
    fail_together(problems, CheckpointError)
    sums, problems = read_reference(path, index)
    fail_together(problems, PreflightError)
    return sums
