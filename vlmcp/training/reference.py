"""The reference logprob sums of preference pairs (`loss.reference_logps`, dpo and ipo): where
they come from, and reading them from a score file.

    null        every pair record carries ref_chosen_logp and ref_rejected_logp
    "initial"   vlmcp scores data.train with the initial policy before the first step (TRL's
                default reference: the model the run starts from; under LoRA, the base model
                with the adapters at their initialisation), through the training engine, and
                keeps the records in OUTPUT_DIR/reference_logps.jsonl, which a resumed run reads
                back (the policy has moved on by then; `score.score_initial_reference`)
    a path      a `vlmcp score` output of data.train by the reference model (its rows in data
                order, a pair's sums under "chosen"/"rejected" -> "logprob_sum")

The sums become a [N, 2] float64 array by index row, (chosen, rejected), NaN for rows that are no
pair; `vlmcp.data.stream.SampleReader` sets them on the halves it loads. A score file that does
not match data.train (a row missing, not a pair, another target count) is a config error naming
its line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from vlmcp.config import JobConfig
from vlmcp.data.index import LengthIndex
from vlmcp.training.objective_step import INITIAL_REFERENCE

#: Where a run keeps the sums it scored with its initial policy.
INITIAL_FILE = "reference_logps.jsonl"

_KEY = "config key 'loss.reference_logps'"


def reference_path(job: JobConfig) -> Path | None:
    """The score file the job's reference sums are read from (None: from the data)."""
    setting = job.loss.reference_logps
    if setting is None:
        return None
    if setting == INITIAL_REFERENCE:
        return Path(job.output_dir) / INITIAL_FILE
    return job.resolve_input(setting)


def _half_sum(record: dict[str, Any], half: str) -> tuple[float, int]:
    """(logprob sum, scored targets) of one half of a pair's score record."""
    part = record.get(half)
    if not isinstance(part, dict) or not isinstance(part.get("logprobs"), list):
        raise ValueError(f"no {half!r} scores (a pair's record has \"chosen\" and \"rejected\" "
                         "objects)")
    value = part.get("logprob_sum")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{half}.logprob_sum must be a finite number, got {value!r}")
    return float(value), len(part["logprobs"])


def _pair_sums(line: str, index: LengthIndex) -> tuple[int, float, float]:
    """(row, chosen sum, rejected sum) of one line of a score file; ValueError saying why not."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from exc
    row = record.get("index") if isinstance(record, dict) else None
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(index):
        raise ValueError(f"\"index\" {row!r} is not a row of data.train ({len(index)} rows)")
    if not index.pairs()[row]:
        raise ValueError(f"row {row} of data.train ({index.source(row)}) is not a preference pair")
    chosen, n_chosen = _half_sum(record, "chosen")
    rejected, n_rejected = _half_sum(record, "rejected")
    if n_chosen + n_rejected != int(index.targets[row]):
        raise ValueError(f"{n_chosen} + {n_rejected} scored targets, but {index.source(row)} has "
                         f"{int(index.targets[row])}: the scores are of other data")
    return row, chosen, rejected


def read_reference(path: Path, index: LengthIndex) -> tuple[np.ndarray | None, list[str]]:
    """([N, 2] float64 sums by index row, NaN off pairs; or None) and the problems, one line
    each, naming `path`:line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        return None, [f"{_KEY}: cannot read {path}: {exc.strerror or exc}"]
    sums = np.full((len(index), 2), np.nan)
    problems = []
    for number, line in enumerate(lines, start=1):
        try:
            row, chosen, rejected = _pair_sums(line, index)
        except ValueError as exc:
            problems.append(f"{_KEY}: {path}:{number}: {exc}")
            continue
        sums[row] = (chosen, rejected)
    missing = np.flatnonzero(index.pairs() & np.isnan(sums[:, 0]))
    problems += [f"{_KEY}: {path} has no scores of {index.source(int(i))}" for i in missing[:10]]
    if len(missing) > 10:
        problems.append(f"{_KEY}: {path} lacks the scores of {len(missing) - 10} more pairs")
    return (None if problems else sums), problems


def reference_problems(job: JobConfig, index: LengthIndex) -> tuple[np.ndarray | None, list[str]]:
    """The sums a job starts with (None: from the data, or still to be scored with the initial
    policy by a fresh run) and the problems of its score file, before any rank trains."""
    path = reference_path(job)
    if path is None or (job.loss.reference_logps == INITIAL_REFERENCE and not job.train.resume):
        return None, []
    if job.loss.reference_logps == INITIAL_REFERENCE and not path.is_file():
        return None, [f"{_KEY} is \"initial\" but the run to resume has no {path} (the initial "
                      "policy's scores, written before its first step)"]
    return read_reference(path, index)
