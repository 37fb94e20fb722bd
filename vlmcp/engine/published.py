"""A published step as an engine client sees it: WEIGHTS/step_N, complete, and of which model.

The publishing side is `vlmcp.training.weights.publish` (docs/rl-loop.md): WEIGHTS/step_N appears
whole (written under a temporary name, STABLE last, renamed), and steps older than `publish.keep`
are removed again. A client therefore checks, before it asks an engine to load a step, that the
directory still exists and holds its STABLE marker (its content is not read: only its presence
counts), and that its config.json describes the model the engine serves, since an engine can
reload only weights of the architecture and shapes it was started with. The weights themselves
are left to the engine's loader, which reads any Hugging Face layout (one model.safetensors, or
model.safetensors.index.json with its shards).

Standard library only: this module also runs inside the engine's own environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data.rollouts import STABLE
from vlmcp.errors import EngineError

#: config.json keys that differ between a checkpoint and its trained steps without changing what
#: an engine loads (the dtype the trainer saved in, the library version, the load path).
_NOT_ARCHITECTURE = frozenset({"dtype", "torch_dtype", "transformers_version", "_name_or_path",
                               "use_cache"})


@dataclass(frozen=True)
class ModelConfig:
    """What config.json says of a model directory: its architectures, the rest of the file
    without the keys that do not change the architecture (`_NOT_ARCHITECTURE`, at any depth), and
    whether it routes over experts (an MoE)."""

    path: Path
    architectures: tuple[str, ...]
    shapes: dict[str, Any]
    moe: bool


def _without_ignored(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ignored(v) for k, v in value.items() if k not in _NOT_ARCHITECTURE}
    return value


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """config.json of `model_dir`; raises EngineError naming the file when it is missing or not
    a JSON object."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise EngineError(f"{path}: no config.json, so this is not a model directory") from exc
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise EngineError(f"{path}: expected a JSON object")
    text = raw.get("text_config", raw)
    moe = bool(isinstance(text, dict) and text.get("num_experts"))
    return ModelConfig(Path(model_dir), tuple(raw.get("architectures") or ()),
                       _without_ignored({k: v for k, v in raw.items() if k != "architectures"}),
                       moe)


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b))
                for d in _differences(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [f"{prefix.rstrip('.')}: {json.dumps(a)} -> {json.dumps(b)}"]


def check_same_architecture(served: ModelConfig, step: ModelConfig) -> None:
    """Raise EngineError when `step` (a published directory) is not the architecture and shapes
    of `served` (what the engine runs), naming the first differing keys."""
    problems = ([f"architectures: {list(served.architectures)} -> {list(step.architectures)}"]
                if served.architectures != step.architectures else [])
    problems += _differences(served.shapes, step.shapes)
    if problems:
        shown = "; ".join(problems[:4]) + (f"; {len(problems) - 4} more" if len(problems) > 4
                                           else "")
        raise EngineError(f"{step.path}: not the model the engine serves ({served.path}): {shown}; "
                          "an engine reloads only weights of the architecture it was started "
                          "with (start it on this checkpoint instead)")


def step_path(weights_dir: str | Path, step: int) -> Path:
    """WEIGHTS/step_`step`, checked complete: raises EngineError when it does not exist (not yet
    published, or removed again under publish.keep) or has no STABLE marker (still being
    written, or not written by a publisher that marks it)."""
    path = Path(weights_dir) / f"step_{step}"
    if not path.is_dir():
        newer = sorted(int(p.name[5:]) for p in Path(weights_dir).glob("step_*")
                       if p.name[5:].isdigit())
        raise EngineError(f"{path} does not exist (published steps there: {newer or 'none'}); a "
                          "step that was published once is removed again when it falls out of "
                          "publish.keep: serve a newer one")
    if not (path / STABLE).is_file():
        raise EngineError(f"{path} has no {STABLE} marker: it is not completely published (the "
                          f"publisher writes {STABLE} last); wait for it")
    return path
