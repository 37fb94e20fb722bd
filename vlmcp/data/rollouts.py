"""A rollout directory: the training data an RL producer writes for the trainer, one step at a time.

    ROLLOUTS/                   rollouts.dir
        step_1/                 the samples of optimizer step 1
            meta.json           optional: {"policy_step": 0, ...}, the policy that generated them
            rollouts.jsonl      the data: every *.jsonl and *.json file at the top of the step
                                (meta.json aside), read in name order, in any format vlmcp reads
            images/...          images the data names (relative to its file, or data.image_root)
            STABLE              written last: the step is complete
        step_2/ ...

A step is complete, and vlmcp reads it, only once `STABLE` exists in it. A producer writes every
other file of the step first (closed, and on a network filesystem flushed), then `STABLE`; or it
writes the whole step, `STABLE` included, under another name in ROLLOUTS and renames it to
`step_N` (a rename within one filesystem is atomic). The files of a complete step must not change.
vlmcp never writes, renames or deletes anything under ROLLOUTS.

`policy_step` in meta.json is the number of optimizer steps of the weights the samples were
generated with (0: `model.path`; N: the weights published after step N). The policy lag of step
N is `(N - 1) - policy_step`: how many optimizer steps the trainer's weights at the start of step
N are ahead of the generating ones (0: on-policy). A negative lag (policy_step >= N) names weights
that do not exist yet when step N trains; the trainer refuses it (training/steps/rollout_steps.py).

This module reads the layout; it imports no torch and talks to no other rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmcp.data import json_text
from vlmcp.errors import DataError

#: The file whose presence makes a step (or a published weights directory) complete.
STABLE = "STABLE"
META = "meta.json"
#: What a step's data files end with.
DATA_SUFFIXES = (".jsonl", ".json")
#: The writer a published weights step names in its STABLE (`{"written_by": ...}`, written by
#: vlmcp.training.weights.publish); a rollout step's STABLE is its producer's and never says this.
PUBLISHED_BY = "vlmcp publish"


def step_dir(root: str | Path, step: int) -> Path:
    """ROLLOUTS/step_N of optimizer step `step` (1-based)."""
    return Path(root) / f"step_{step}"


def is_complete(path: str | Path) -> bool:
    """Whether the directory holds its STABLE marker; also True where `path` is there but is not
    a directory (a producer's error, which `read_meta` then names, rather than a wait that
    never ends)."""
    path = Path(path)
    return (path / STABLE).is_file() or (path.exists() and not path.is_dir())


def written_by_publish(path: str | Path) -> bool:
    """Whether the directory's STABLE says vlmcp's publish wrote it: a step of published weights,
    never a rollout step (only the marker's first 4 KiB are read)."""
    try:
        with (Path(path) / STABLE).open("rb") as handle:
            raw = json.loads(handle.read(4096))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("written_by") == PUBLISHED_BY


@dataclass(frozen=True)
class RolloutMeta:
    """A step's meta.json: the generating policy's step (None when not given) and every field."""

    policy_step: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def lag(self, step: int) -> int | None:
        """The policy lag of optimizer step `step` (1-based): (step - 1) - policy_step."""
        return None if self.policy_step is None else step - 1 - self.policy_step


def read_meta(path: str | Path) -> RolloutMeta:
    """The meta.json of the step directory `path` (empty when there is none). Raises DataError
    naming the step when it is not a directory, or naming the file when it is not a JSON object
    or its policy_step is not an integer >= 0."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: not a directory (a rollout step is a directory of data files "
                        f"and its {STABLE} marker)")
    meta_path = path / META
    if not meta_path.exists():
        return RolloutMeta()
    try:
        raw = json_text.loads(meta_path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise DataError(f"{meta_path}: cannot read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"{meta_path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                        f"byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{meta_path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from exc
    if not isinstance(raw, dict):
        raise DataError(f"{meta_path}: expected a JSON object, got {json_text.kind(raw)}")
    policy_step = raw.get("policy_step")
    if policy_step is not None and (isinstance(policy_step, bool) or not isinstance(policy_step, int)
                                    or policy_step < 0):
        raise DataError(f"{meta_path}: \"policy_step\" must be an integer >= 0 (the optimizer "
                        f"steps of the generating weights), got {json_text.brief(policy_step)}")
    return RolloutMeta(policy_step, raw)


def step_files(path: str | Path) -> list[Path]:
    """The data files of the step directory `path`, in name order. Raises DataError when it holds
    none, cannot be listed, or holds a data file name that is not a file."""
    path = Path(path)
    if written_by_publish(path):
        raise DataError(f"{path}: a step of published weights (its {STABLE} says "
                        f"{PUBLISHED_BY!r} wrote it), not a rollout step: is rollouts.dir "
                        "another run's publish.dir?")
    try:
        named = sorted(p for p in path.iterdir()
                       if p.name != META and p.name.endswith(DATA_SUFFIXES))
        files = [p for p in named if p.is_file()]
    except OSError as exc:
        raise DataError(f"{path}: cannot list the step's files ({exc.strerror or exc})") from exc
    others = [p for p in named if p not in files]
    if others:
        raise DataError(f"{others[0]}: not a file (every *.jsonl and *.json of a step is a data "
                        "file)")
    if not files:
        raise DataError(f"{path}: no data file (*.jsonl or *.json besides {META}) in a step "
                        f"marked {STABLE}")
    return files
