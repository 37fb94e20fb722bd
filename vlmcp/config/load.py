"""Loading a job: the JSON file, its ``--set`` overrides, the schema checks, the launcher's
settings."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmcp.config.checks import build_section, cross_key_problems, training_data_problems
from vlmcp.config.launch_env import apply_launch_env
from vlmcp.config.loss_checks import loss_problems, loss_warnings
from vlmcp.config.overrides import apply_overrides
from vlmcp.config.schema import JobConfig
from vlmcp.data import json_text
from vlmcp.errors import ConfigError

logger = logging.getLogger(__name__)


def _leaf_keys(raw: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the values a raw job dict gives (objects are walked, except the inline
    `deepspeed` dict, which is one value)."""
    if not isinstance(raw, dict) or prefix == "deepspeed.":
        return {prefix.rstrip(".")} if prefix else set()
    keys: set[str] = set()
    for name, value in raw.items():
        keys |= _leaf_keys(value, f"{prefix}{name}.")
    return keys


def job_from_dict(raw: Any, job_dir: str | Path = ".",
                  deepspeed_overrides: dict[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> JobConfig:
    """Validate a raw job dict against the schema; raises ConfigError listing every problem.

    With `environ`, the settings a launcher exported (accelerate's, see vlmcp/config/launch_env.py)
    apply on top of the job's defaults; a value the job sets that disagrees is an error.
    """
    problems: list[str] = []
    job = build_section(JobConfig, raw, "", problems)
    problems.extend(training_data_problems(job))
    job.explicit_keys = frozenset(_leaf_keys(raw))
    if not problems:
        problems.extend(cross_key_problems(job))
        problems.extend(loss_problems(job.loss, job.explicit_keys))
    if problems:
        raise ConfigError(problems)
    for line in loss_warnings(job.loss, job.explicit_keys):
        logger.warning("%s", line)
    job.job_dir = str(job_dir)
    job.deepspeed_overrides = dict(deepspeed_overrides or {})
    if environ is not None:
        apply_launch_env(job, environ)
    return job


def load_job(path: str | Path, overrides: list[str] | None = None,
             environ: Mapping[str, str] | None = None) -> JobConfig:
    """Read a job JSON file, apply ``--set`` overrides and validate it (with a launcher's
    exported settings from `environ`, see `job_from_dict`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read job file {path}: {exc.strerror}"]) from exc
    try:
        raw = json_text.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"]) from exc
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: a job must be a JSON object"])
    deepspeed_overrides = apply_overrides(raw, overrides or [])
    return job_from_dict(raw, path.resolve().parent, deepspeed_overrides, environ)
