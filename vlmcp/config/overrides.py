"""``--set key.path=value`` overrides of a job's keys.

The value is parsed as JSON when it parses (``4``, ``true``, ``[0.9, 0.99]``, ``null``) and taken
as a plain string otherwise. Keys under ``deepspeed.`` edit the DeepSpeed config after it is loaded,
whether it is a path or an inline dict, so they are returned apart.
"""

from __future__ import annotations

import json
from typing import Any

from vlmcp.data import json_text
from vlmcp.errors import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.path=value``; the value is JSON when it parses, else a plain string."""
    if "=" not in text:
        raise ConfigError([f"--set {text!r}: expected key.path=value"])
    key, raw_value = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError([f"--set {text!r}: bad key path {key!r}"])
    try:
        value = json_text.loads(raw_value)
    except json.JSONDecodeError:
        value = raw_value
    return key, value


def _set_path(raw: dict[str, Any], parts: list[str], value: Any, full_key: str) -> None:
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[:depth + 1])
            raise ConfigError([f"--set {full_key}: config key '{where}' is not an object"])
        node = child
    node[parts[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides to the raw job dict (in place); returns the
    ``deepspeed.*`` overrides, which apply to the DeepSpeed config once it is loaded."""
    deepspeed_overrides: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        if parts[0] == "deepspeed" and len(parts) > 1:
            deepspeed_overrides[".".join(parts[1:])] = value
        else:
            _set_path(raw, parts, value, key)
    return deepspeed_overrides
