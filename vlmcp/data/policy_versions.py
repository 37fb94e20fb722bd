"""Per-token policy versions of rollout samples: which weights sampled each token.

With in-flight weight updates (vLLM's `pause(mode="keep")`: requests frozen during a reload go
on with the new weights) one sample's tokens come from several policy versions. A rollout line
may then say so in `policy_versions`, in either form:

    "policy_versions": [null, null, 3, 3, 4, null]     one entry per token of input_ids
                                                        (null where no version applies: the
                                                        prompt, the padding)
    "policy_versions": [{"version": 3, "start": 2, "end": 4},
                        {"version": 4, "start": 4, "end": 5}]
                                                        spans [start, end) of input_ids
                                                        positions (vLLM's `weight_versions`
                                                        spans are over output tokens: add the
                                                        prompt's length)

A version is the optimizer step of the weights (0: `model.path`, k: WEIGHTS/step_k), as
meta.json's `policy_step`. Every target token (label != -100) of a line that has the field must
have a version. The step's staleness is then counted from the OLDEST version of any token of the
step (PrimeRL's `max_off_policy_steps`), not from meta.json (`vlmcp.training.steps.rollout_steps`).
The length index pass reads them with each record (`vlmcp.data.index.build_index(versions=True)`),
so a malformed one is that sample's problem, as any other (`rollouts.on_bad_sample`).

This module imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlmcp.errors import DataError

FIELD = "policy_versions"
IGNORE_INDEX = -100


def _version(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(f"{where}: a policy version must be an integer >= 0 (an optimizer step), "
                        f"got {json.dumps(value)}")
    return value


def token_versions(value: Any, n_tokens: int, source: str) -> list[int | None]:
    """The per-token versions of one line's `policy_versions` (either form), one entry per token
    of its `n_tokens` input_ids. Raises DataError naming `source` and the entry."""
    where = f"{source}: {FIELD}"
    if not isinstance(value, list):
        raise DataError(f"{where} must be a list (one version per token, or spans), got "
                        f"{type(value).__name__}")
    if value and all(isinstance(v, dict) for v in value):
        versions: list[int | None] = [None] * n_tokens
        for i, span in enumerate(value):
            unknown = set(span) - {"version", "start", "end"}
            if unknown or not {"version", "start", "end"} <= set(span):
                raise DataError(f"{where}[{i}]: a span is {{\"version\", \"start\", \"end\"}}, "
                                f"got keys {sorted(span)}")
            start, end = span["start"], span["end"]
            if not (type(start) is int and type(end) is int and 0 <= start < end <= n_tokens):
                raise DataError(f"{where}[{i}]: span [{start}, {end}) is not within the line's "
                                f"{n_tokens} tokens (0 <= start < end <= {n_tokens})")
            version = _version(span["version"], f"{where}[{i}].version")
            if any(v is not None for v in versions[start:end]):
                raise DataError(f"{where}[{i}]: span [{start}, {end}) overlaps an earlier span")
            versions[start:end] = [version] * (end - start)
        return versions
    if len(value) != n_tokens:
        raise DataError(f"{where} has {len(value)} entries for {n_tokens} tokens (one per token, "
                        "null where none applies; or a list of spans)")
    return [None if v is None else _version(v, f"{where}[{t}]") for t, v in enumerate(value)]


def target_version_range(versions: Sequence[int | None], labels: Sequence[int], source: str
                         ) -> tuple[int, int] | None:
    """(oldest, newest) version of the line's target tokens (None without targets). Raises
    DataError when a target token has no version."""
    found = []
    for t, label in enumerate(labels):
        if label == IGNORE_INDEX:
            continue
        if t >= len(versions) or versions[t] is None:
            raise DataError(f"{source}: {FIELD} gives no version for target token {t}; every "
                            "target of a line with policy versions needs one")
        found.append(versions[t])
    return (min(found), max(found)) if found else None


def record_version_range(record: dict[str, Any], source: str, kept: int | None = None
                         ) -> tuple[int, int] | None:
    """(oldest, newest) version of the record's target tokens from its `policy_versions` (None:
    the record has no such field, or no target). `kept`: how many leading tokens training keeps
    (`data.truncate` cuts the rest, whose versions then count for nothing; None: all). The field
    is checked against the whole line. Raises DataError naming `source` when the field is
    malformed or the record is not in the tokens format."""
    if FIELD not in record:
        return None
    ids, labels = record.get("input_ids"), record.get("labels")
    if not isinstance(ids, list) or not isinstance(labels, list):
        raise DataError(f"{source}: {FIELD} needs the tokens format (input_ids and labels), "
                        "which the record lacks")
    versions = token_versions(record[FIELD], len(ids), source)
    return target_version_range(versions[:kept], labels[:kept], source)


@dataclass(frozen=True)
class StepVersions:
    """The policy versions that generated a rollout step's samples: the oldest and newest (None:
    unknown), and whether any sample gave its own per-token versions (else all came from
    meta.json's `policy_step`)."""

    oldest: int | None
    newest: int | None
    per_token: bool

    def lags(self, step: int) -> tuple[int | None, int | None]:
        """(largest, smallest) policy lag of optimizer step `step` (1-based): (step - 1) minus the
        oldest and the newest version."""
        return (None if self.oldest is None else step - 1 - self.oldest,
                None if self.newest is None else step - 1 - self.newest)


def step_versions(ranges: np.ndarray, policy_step: int | None) -> StepVersions:
    """The versions of a step from its samples' `ranges` ([N, 2] int64, (oldest, newest) of each
    sample's targets, -1 for a sample without per-token versions, which meta.json's
    `policy_step` then covers when given)."""
    known = ranges[ranges[:, 0] >= 0]
    oldest = [int(known[:, 0].min())] if len(known) else []
    newest = [int(known[:, 1].max())] if len(known) else []
    if policy_step is not None and len(known) < len(ranges):
        oldest.append(policy_step)
        newest.append(policy_step)
    return StepVersions(min(oldest, default=None), max(newest, default=None), bool(len(known)))
