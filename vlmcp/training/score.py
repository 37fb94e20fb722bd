"""`vlmcp score`: the policy's logprob of every target token of data.train, no backward.

Each sample's record is one JSON line, in data order: {"index": i, "logprobs": [...]} with the
logprob of each target token in order (target t of a sample is label t+1 in the HF convention,
so the list has one entry per label != -100 after the first token), plus "entropy": [...] (the
policy's softmax entropy at the same positions) with --entropy. A sample with per-token
`temperatures` is scored at them: log_softmax(logits / tau), as the trainer computes it.

The forward is training's: packed (first-fit, `data.max_seq_len`), SP-sharded, through the
DeepSpeed engine (ZeRO-3 gathers as in training) under no_grad. The packs are dealt round-robin
over the DP groups, as in evaluation (a group short of packs repeats one and drops its result).
After each round every rank's shard of values goes to every rank (one all-gather of [3, width]
per round, `comm.all_gather_world`); global rank 0 cuts the shards of each group back into
samples and alone writes the file, sorted by sample index.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vlmcp.config import JobConfig
from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
from vlmcp.data.pack import first_fit
from vlmcp.data.stream import SampleReader
from vlmcp.errors import ConfigError
from vlmcp.parallel import comm
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.setup import build_engine, start_checked

logger = logging.getLogger(__name__)


@torch.no_grad()
def score_samples(engine: Any, lengths: Sequence[int], load: Callable[[list[int]], PackedBatch],
                  max_seq_len: int, sp: SequenceParallel, entropy: bool = False
                  ) -> list[dict[str, Any]]:
    """Every sample's record (see the module docstring), sorted by index, on global rank 0; an
    empty list on the other ranks. Every rank must call it (collectives each round).

    lengths: the samples' token counts (packed first-fit into `max_seq_len`); load(pack): the
    `PackedBatch` of the sample indices `pack` (only the packs of this rank's DP group are loaded).
    """
    packs = first_fit(list(lengths), max_seq_len)
    records: dict[int, dict[str, Any]] = {}
    for round_ in range(max(1, math.ceil(len(packs) / sp.dp_size))):
        index = round_ * sp.dp_size + sp.dp_rank
        batch = load(packs[index % len(packs)])
        logprobs, entropies = engine(batch, scores=True)
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
        if comm.rank() == 0:
            for group in range(sp.dp_size):
                pack = round_ * sp.dp_size + group
                if pack < len(packs):
                    shards = gathered[group * sp.size:(group + 1) * sp.size]
                    records.update(_pack_records(
                        shards, [(i, int(lengths[i])) for i in packs[pack]], entropy))
    return [records[i] for i in sorted(records)]


def _pack_records(shards: torch.Tensor, members: list[tuple[int, int]], entropy: bool
                  ) -> dict[int, dict[str, Any]]:
    """shards: [P, 4, width] one SP group's gathered rows; members: (sample index, length) in
    pack order -> {sample index: record}."""
    whole = torch.cat([shard[:3, :int(shard[3, 0])] for shard in shards], dim=1)
    records = {}
    offset = 0
    for index, length in members:
        part = whole[:, offset:offset + length]
        offset += length
        mask = part[2] == 1
        record: dict[str, Any] = {"index": index, "logprobs": part[0][mask].tolist()}
        if entropy:
            record["entropy"] = part[1][mask].tolist()
        records[index] = record
    return records


def write_scores(records: Sequence[dict[str, Any]], path: Path) -> None:
    """One JSON line per record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def score(job: JobConfig, out: str | None = None, entropy: bool = False) -> Path:
    """Score data.train with the job's model on every rank of the launcher's world; returns the
    output path (default OUTPUT_DIR/scores.jsonl), written by global rank 0. A LoRA job
    (lora.r > 0) is a ConfigError: its adapters are not at model.path."""
    if job.lora.r:
        raise ConfigError(["config key 'lora.r': vlmcp score runs the model at model.path without "
                           "trained adapters; score the merged model of `vlmcp export --merge` "
                           "with lora.r 0"])
    if not job.data.train:
        raise ConfigError(["config key 'data.train': vlmcp score scores the files of data.train "
                           "(a rollout job's steps too: --set data.train=ROLLOUTS/step_N/FILE)"])
    preflight = start_checked(job, training=False)
    sp = SequenceParallel.initialize(job.parallel.sp_size)
    engine, _, _ = build_engine(job, preflight, sp)
    engine.eval()
    if any(w != 1 for w in preflight.train_weights):
        logger.warning("data.train weights are not used by vlmcp score: it scores every record of "
                       "the files once, in file order (index i counts records across the files)")
    reader = SampleReader(preflight.train_index, preflight.processor, job.data.max_seq_len,
                          job.data.truncate)
    records = score_samples(engine, preflight.train_index.tokens.tolist(), reader.pack,
                            job.data.max_seq_len, sp, entropy)
    path = Path(out) if out else Path(job.output_dir) / "scores.jsonl"
    if comm.rank() == 0:
        write_scores(records, path)
    comm.barrier()
    return path
