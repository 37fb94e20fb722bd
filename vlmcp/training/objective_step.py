"""The `loss` section in training: its checks on the data, the step's global normalisers and the
objectives' metrics.

The step's loss is sum_k coef_k (sum_t c_kt l_kt) / N_k (`model.loss_terms`): each N_k is a
global count of the optimizer step (targets, samples or pairs, over SP, DP and the accumulation
micro-batches) or a constant. Metrics are means over the step's global targets ("entropy"), over
each term's targets (its token metrics), or over its pairs (TRL's rewards/...), strict JSON.
When the step's data carries `inference_logprobs`, "mismatch_logprob_diff" and "mismatch_kl"
(`model.mismatch`) are means over the "mismatch_targets" tokens that have one, reported with
that count; a step without such tokens reports none of the three. Likewise a term with no target
in the step (its global count 0) reports "term{k}_loss" 0 and none of its token metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig, LossTerm
from vlmcp.config.loss_checks import loss_terms
from vlmcp.data.batch import PAIR_VALUES, TOKEN_ARRAYS, PackedBatch
from vlmcp.data.index import LengthIndex
from vlmcp.model.loss_terms import REPORTED_COUNTS, Loss
from vlmcp.model.mismatch import MISMATCH_COUNT
from vlmcp.model.objectives import required_arrays
from vlmcp.parallel import comm

#: At most this many samples are named per problem; the rest are counted.
_NAMED = 10

#: `loss.reference_logps`: score data.train with the initial policy before the first step.
INITIAL_REFERENCE = "initial"


def objective_of(job: JobConfig) -> Loss:
    """The job's `loss` section as the model's `Loss`."""
    return Loss(tuple(loss_terms(job.loss)))


def token_array_names(job: JobConfig) -> tuple[str, ...]:
    """The per-token arrays the data of `job` is read with: `TOKEN_ARRAYS`, then the weight
    arrays its loss terms name."""
    extra = [t.weights for t in loss_terms(job.loss) if t.weights and t.weights not in TOKEN_ARRAYS]
    return TOKEN_ARRAYS + tuple(sorted(set(extra)))


def _named(indices: Sequence[int], index: LengthIndex, why: str, key: str) -> list[str]:
    """One line per sample of `indices` (at most `_NAMED`, then a count) with `why`."""
    lines = [f"{index.source(int(i))}: {why}" for i in indices[:_NAMED]]
    if len(indices) > _NAMED:
        lines.append(f"config key '{key}': {len(indices) - _NAMED} more samples of data.train: "
                     f"{why}")
    return lines


def _because(term: LossTerm, name: str, prefix: str) -> str:
    """Which option of `term` makes it need the array `name` ("" when its type does)."""
    if name in required_arrays(LossTerm(type=term.type)):
        return ""
    if name == "ref_logprobs":
        return f" with {prefix}kl_coef > 0"
    if name == term.weights:
        return f" with {prefix}weights"
    if name == "inference_logprobs" and term.opd_form == "importance":
        return f" with {prefix}opd_form \"importance\""
    return f" with {prefix}mismatch {term.mismatch!r}"


def untrainable(job: JobConfig, index: LengthIndex) -> list[tuple[list[int], str, str]]:
    """The training samples the loss cannot train on, read from the length index (streaming
    data: no record is read), as (sample indices, why, config key) per reason: a per-token array
    a term needs missing, a single sample under a preference objective or a pair under another, a
    pair without reference sums when dpo or ipo has no other source for them."""
    loss = objective_of(job)
    found = []
    for k, term in enumerate(loss.terms):
        prefix = "loss." if len(loss.terms) == 1 else f"loss.terms[{k}]."
        for name in Loss((term,)).required_arrays:
            why = (f"{prefix}type {term.type!r}{_because(term, name, prefix)} needs a per-token "
                   f"{name!r} array (tokens format, one entry per label); this sample has none")
            found.append((index.lacking(name).tolist(), why, f"{prefix}type"))
    pairs = index.pairs()
    kind = loss.terms[0].type
    if loss.pairwise:
        found.append(((~pairs).nonzero()[0].tolist(),
                      f"loss.type {kind!r} trains on preference pairs (chosen and rejected); "
                      "this sample is not one", "loss.type"))
        if loss.needs_reference and job.loss.reference_logps is None:
            lacking = sorted(set(index.lacking(PAIR_VALUES[0]).tolist()) & set(pairs.nonzero()[0]))
            found.append((lacking,
                          f"loss.type {kind!r} needs the reference logprob sums of each pair: the "
                          f"record's {' and '.join(PAIR_VALUES)}, or loss.reference_logps "
                          "(\"initial\": scored with the initial policy; or a `vlmcp score` "
                          "output); this pair has none", "loss.reference_logps"))
    else:
        found.append((pairs.nonzero()[0].tolist(),
                      "a preference pair (chosen and rejected) trains with loss.type dpo, ipo or "
                      f"simpo, not {kind!r}", "loss.type"))
    return [(indices, why, key) for indices, why, key in found if indices]


def objective_problems(job: JobConfig, index: LengthIndex) -> list[str]:
    """One line per training sample ("file:line") that the loss cannot train on (`untrainable`),
    at most `_NAMED` per reason, then a count."""
    return [line for indices, why, key in untrainable(job, index)
            for line in _named(indices, index, why, key)]


@dataclass(frozen=True)
class StepCounts:
    """The step's global counts (`Loss.batch_counts` keys, summed) and its normalisers.

    targets: its target tokens; terms: N_k of every term; denominator: what the step's summed
    shard losses are divided by (N_0 for one term, whose sums come unnormalised; 1 for several,
    whose shards divide by their N_k themselves, `PackedVLM.forward(denominators=...)`).
    """

    counts: dict[str, float]
    terms: list[float]

    @property
    def targets(self) -> int:
        return int(self.counts["targets"])

    @property
    def denominator(self) -> float:
        return self.terms[0] if len(self.terms) == 1 else 1.0

    @property
    def shard_denominators(self) -> list[float] | None:
        """What `PackedVLM.forward` gets as `denominators` (None for one term)."""
        return self.terms if len(self.terms) > 1 else None


def weight_arrays(objective: Loss) -> tuple[str, ...]:
    """The weight arrays of the objective's terms, whose nonzero targets its counts need
    (`build_index(count_nonzero=...)`)."""
    return tuple(sorted({term.weights for term in objective.terms if term.weights}))


def pack_counts(objective: Loss, batches: Sequence[PackedBatch]) -> dict[str, float]:
    """`Loss.batch_counts` summed over loaded micro-batches (each checked, `Loss.check_batch`)."""
    total = dict.fromkeys(objective.count_keys(), 0.0)
    for batch in batches:
        for key, value in objective.batch_counts(batch).items():
            total[key] += value
    return total


def index_counts(objective: Loss, index: LengthIndex, rows: Sequence[int]) -> dict[str, float]:
    """What `pack_counts` gives for the packs of the index rows `rows` (a row once per pack that
    holds it), from the length index alone: no record is read. A sample's every target carries a
    finite inference logprob when it has the array (the data check), each of a pair's halves has
    a target, and the weighted counts come from `index.nonzero_targets` (an index built with
    `count_nonzero=weight_arrays(objective)`)."""
    rows = np.asarray(rows, dtype=np.int64)
    targets = index.targets[rows].astype(np.float64)
    pairs = index.pairs()[rows]
    with_mu = np.isin(rows, index.lacking("inference_logprobs"), invert=True)
    counts = {"targets": float(targets.sum()), "pairs": float(pairs.sum()),
              MISMATCH_COUNT: float(targets[with_mu].sum())}
    for k, term in enumerate(objective.terms):
        if term.weights is None:
            counts[f"tokens{k}"] = counts["targets"]
            counts[f"seqs{k}"] = float(np.where(pairs, 2, 1).sum())
        else:
            weighted = index.nonzero_targets[term.weights][rows]
            counts[f"tokens{k}"] = float(weighted.sum())
            counts[f"seqs{k}"] = float((weighted > 0).sum())
    return counts


def step_counts(local: dict[str, float], objective: Loss) -> StepCounts:
    """Global counts of one optimizer step (one all-reduce over the world; call on every rank)
    from this rank's `local` counts of the packs of weight 1 it owns (`pack_counts` or
    `index_counts`): each pack is owned by one rank, a pack spread over an SP group by its SP
    rank 0, a pack of SP degree 1 by the rank that runs it (`StepBatches.counts`)."""
    keys = objective.count_keys()
    total = torch.tensor([local[key] for key in keys], dtype=torch.float64)
    comm.all_reduce_sum(total)
    counts = dict(zip(keys, total.tolist()))
    return StepCounts(counts, objective.denominators(counts))


def objective_metrics(sums: torch.Tensor, counts: StepCounts, objective: Loss) -> dict[str, Any]:
    """Metrics row entries from the globally summed metric sums of a step (`Loss.stat_specs`
    order), each divided by its global count. A metric whose count is 0 in the step (a mean over
    no token) is left out of the row, except a term's "term{k}_loss", which is then 0 (the term
    contributes nothing, `model.loss_terms`); a count of `REPORTED_COUNTS` is reported itself
    (an int) when it is not 0."""
    counted = {**counts.counts, **{f"norm{k}": n for k, n in enumerate(counts.terms)}}
    row: dict[str, Any] = {}
    for i, (key, count) in enumerate(objective.stat_specs()):
        if counted[count]:
            row[key] = float(sums[i]) / counted[count]
        elif count.startswith("norm"):
            row[key] = 0.0
        if count in REPORTED_COUNTS and counted[count]:
            row[count] = int(counted[count])
    return row
