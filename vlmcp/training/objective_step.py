"""The `loss` section in training: its checks on the data, the step's global normaliser and the
objective's metrics.

The step's loss is sum_t c_t l_t / D (`model.objectives`): D is the global number of target
tokens (`loss.normalize` "token") or of samples ("sequence") of the optimizer step, over SP, DP
and the accumulation micro-batches. Metrics are means over the step's global target tokens:
"entropy" always; "clip_fraction", "ratio", "approx_kl" for ppo_clip, and "ref_kl" with kl_coef.
When the step's data carries `inference_logprobs`, "mismatch_logprob_diff" and "mismatch_kl"
(`model.mismatch`) are means over the "mismatch_targets" tokens that have one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmcp.config import JobConfig
from vlmcp.data.batch import PackedBatch
from vlmcp.data.index import LengthIndex
from vlmcp.model.mismatch import MISMATCH_KEYS
from vlmcp.model.objectives import STAT_KEYS, Objective
from vlmcp.parallel import comm

#: At most this many samples are named per missing array; the rest are counted.
_NAMED = 10


def objective_of(job: JobConfig) -> Objective:
    """The job's `loss` section as the model's `Objective`."""
    loss = job.loss
    return Objective(type=loss.type, normalize=loss.normalize, clip_low=loss.clip_low,
                     clip_high=loss.clip_high, kl_coef=loss.kl_coef)


def objective_problems(job: JobConfig, index: LengthIndex) -> list[str]:
    """One line per training sample ("file:line") lacking a per-token array that `loss.type`
    needs (at most `_NAMED` per array, then a count); read from the length index."""
    objective = objective_of(job)
    problems = []
    for name in objective.required_arrays:
        lacking = index.lacking(name)
        why = (f"loss.type {objective.type!r}"
               + (" with loss.kl_coef > 0" if name == "ref_logprobs" else ""))
        problems += [f"{index.source(int(i))}: {why} needs a per-token {name!r} array (tokens "
                     "format, one entry per label); this sample has none"
                     for i in lacking[:_NAMED]]
        if len(lacking) > _NAMED:
            problems.append(f"config key 'loss.type': {len(lacking) - _NAMED} more samples of "
                            f"data.train lack {name!r}")
    return problems


@dataclass(frozen=True)
class StepCounts:
    """The step's global target tokens and its loss normaliser D."""

    targets: int
    denominator: int


def step_counts(module: Any, batches: Sequence[PackedBatch], objective: Objective) -> StepCounts:
    """Global counts of one optimizer step's micro-batches (one all-reduce over the world; call
    on every rank). `module` is the `PackedVLM` (`shard_counts`)."""
    local = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        targets, samples = module.shard_counts(batch)
        local += torch.tensor([targets, samples], dtype=torch.float64)
    comm.all_reduce_sum(local)
    targets, samples = int(local[0]), int(local[1])
    return StepCounts(targets, samples if objective.normalize == "sequence" else targets)


def objective_metrics(sums: torch.Tensor, targets: int, objective: Objective) -> dict[str, Any]:
    """Metrics row entries from the globally summed `STAT_KEYS` sums of a step."""
    row: dict[str, Any] = {key: float(sums[STAT_KEYS.index(key)]) / max(targets, 1)
                           for key in objective.metric_keys()}
    diff, kl, count = (float(sums[STAT_KEYS.index(key)]) for key in MISMATCH_KEYS)
    if count:
        row.update({"mismatch_logprob_diff": diff / count, "mismatch_kl": kl / count,
                    "mismatch_targets": int(count)})
    return row
