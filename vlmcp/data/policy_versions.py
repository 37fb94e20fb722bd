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
step (PrimeRL's `max_off_policy_steps`), not from meta.json (`vlmcp.training.rollout_steps`).

This module reads JSON lines only; it imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= n_tokens):
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


@dataclass
class StepVersions:
    """The per-token versions of a rollout step's lines: the oldest and newest version of any
    target token (None when no line has the field), how many lines have it, and one problem line
    per malformed line."""

    oldest: int | None = None
    newest: int | None = None
    lines: int = 0
    problems: list[str] = field(default_factory=list)


def step_versions(files: Sequence[Path]) -> StepVersions:
    """Read `policy_versions` of every JSON-lines record in `files` that has it (a `.json` file
    holding a list of records counts its items); lines without the field are left out."""
    found = StepVersions()
    for path in files:
        for source, record in _records(path):
            if not isinstance(record, dict) or FIELD not in record:
                continue
            ids = record.get("input_ids")
            labels = record.get("labels")
            if not isinstance(ids, list) or not isinstance(labels, list):
                found.problems.append(f"{source}: {FIELD} needs the tokens format (input_ids and "
                                      "labels), which the line lacks")
                continue
            try:
                span = target_version_range(token_versions(record[FIELD], len(ids), source),
                                            labels, source)
            except DataError as exc:
                found.problems.append(str(exc))
                continue
            found.lines += 1
            if span is not None:
                found.oldest = span[0] if found.oldest is None else min(found.oldest, span[0])
                found.newest = span[1] if found.newest is None else max(found.newest, span[1])
    return found


def _records(path: Path) -> list[tuple[str, Any]]:
    """(source label, record) of a data file; lines that are not JSON are left to the index pass,
    which reports them."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except ValueError:
            return []
        return [(f"{path}[{i}]", item) for i, item in enumerate(items)] \
            if isinstance(items, list) else []
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            records.append((f"{path}:{number}", json.loads(line)))
        except ValueError:
            continue
    return records
