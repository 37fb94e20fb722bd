"""One record of every change vlmcp makes to a DeepSpeed config, each logged with old and new.

`DeepSpeedEdits.set(config, "zero_optimization.stage", 3, "why")` writes the value (creating
missing objects on the way) and logs ``deepspeed config zero_optimization.stage: "auto" -> 3
(why)``; an unchanged value logs nothing. Problems (one line each, naming the key) are
collected for one ConfigError at the end.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

#: Marks a key that the config does not have.
ABSENT = object()


def get_path(config: dict[str, Any], path: str) -> Any:
    """The value at dotted `path`, or ABSENT (also when an object on the way is missing)."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def shown(value: Any) -> str:
    """A value as a message shows it: JSON, or "(absent)"."""
    return "(absent)" if value is ABSENT else json.dumps(value)


class DeepSpeedEdits:
    """Writes into one DeepSpeed config, logging each change; collects problems."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.changes: list[str] = []

    def set(self, config: dict[str, Any], path: str, value: Any, why: str) -> None:
        """Set dotted `path` to `value` and log the old and new value (nothing when equal)."""
        old = get_path(config, path)
        if old is not ABSENT and old == value and type(old) is type(value):
            return
        parts = path.split(".")
        node = config
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        self._log(f"deepspeed config {path}: {shown(old)} -> {shown(value)} ({why})")

    def remove(self, config: dict[str, Any], path: str, why: str) -> None:
        """Delete dotted `path` (when present) and log it."""
        old = get_path(config, path)
        if old is ABSENT:
            return
        parts = path.split(".")
        node = config
        for part in parts[:-1]:
            node = node[part]
        del node[parts[-1]]
        self._log(f"deepspeed config {path}: {shown(old)} -> (removed) ({why})")

    def problem(self, line: str) -> None:
        self.problems.append(line)

    def _log(self, line: str) -> None:
        self.changes.append(line)
        logger.info("%s", line)
