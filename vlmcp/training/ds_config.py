"""The DeepSpeed config of a job: load it (path or inline), apply overrides, fill "auto" values.

A stock DeepSpeed JSON works unchanged. The job decides what "auto" means:

- `train_micro_batch_size_per_gpu`: 1 (a micro-batch is one packed sequence);
- `gradient_accumulation_steps`: `train.grad_accum`;
- `gradient_clipping`: `train.grad_clip`;
- `train_batch_size`: left for DeepSpeed to derive (micro x accumulation x data-parallel ranks);
- `bf16.enabled` / `fp16.enabled`: from `model.dtype`;
- `zero_optimization.reduce_bucket_size`, `stage3_prefetch_bucket_size`,
  `stage3_param_persistence_threshold`: from the text model's hidden size, as transformers does.

A number that disagrees with the job (say `gradient_accumulation_steps: 4` with
`train.grad_accum: 1`) is an error naming both keys. An `optimizer` or `scheduler` block is removed
with a warning: the job's torch optimizer and LR schedule are used, so that no DeepSpeed op is
ever JIT-compiled.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from vlmcp.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)

_DTYPE_FLAGS = {"bf16": "bfloat16", "fp16": "float16"}


def load_deepspeed_config(job: JobConfig) -> dict[str, Any]:
    """The raw DeepSpeed dict of a job (file or inline) with `--set deepspeed.*` applied."""
    if isinstance(job.deepspeed, dict):
        config = copy.deepcopy(job.deepspeed)
        source = "inline 'deepspeed'"
    else:
        path = job.resolve_input(job.deepspeed)
        try:
            config = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError([f"config key 'deepspeed': cannot read {path}: {exc.strerror}"]) from exc
        except json.JSONDecodeError as exc:
            raise ConfigError([f"config key 'deepspeed': {path}:{exc.lineno}: invalid JSON: "
                               f"{exc.msg}"]) from exc
        source = str(path)
    if not isinstance(config, dict):
        raise ConfigError([f"config key 'deepspeed': {source} is not a JSON object"])
    for dotted, value in job.deepspeed_overrides.items():
        node = config
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set deepspeed.{dotted}: 'deepspeed.{part}' is not an object"])
        node[parts[-1]] = value
    return config


def _is_auto(value: Any) -> bool:
    return value == "auto"


def _fill_scalar(config: dict[str, Any], key: str, wanted: Any, job_key: str,
                 problems: list[str]) -> None:
    value = config.get(key, "auto")
    if _is_auto(value):
        config[key] = wanted
    elif value != wanted:
        problems.append(f"config key 'deepspeed.{key}': {json.dumps(value)} disagrees with "
                        f"{job_key}={json.dumps(wanted)}; set it to \"auto\" or make them equal")


def _fill_dtype(config: dict[str, Any], dtype: str, problems: list[str]) -> None:
    for flag, flag_dtype in _DTYPE_FLAGS.items():
        block = config.get(flag)
        wanted = dtype == flag_dtype
        if block is None:
            if wanted:
                config[flag] = {"enabled": True}
            continue
        if not isinstance(block, dict):
            problems.append(f"config key 'deepspeed.{flag}': expected an object")
            continue
        enabled = block.get("enabled", "auto")
        if _is_auto(enabled):
            block["enabled"] = wanted
        elif bool(enabled) != wanted:
            problems.append(f"config key 'deepspeed.{flag}.enabled': {json.dumps(enabled)} "
                            f"disagrees with model.dtype={json.dumps(dtype)}")


def _fill_zero(config: dict[str, Any], hidden_size: int, problems: list[str]) -> None:
    zero = config.setdefault("zero_optimization", {"stage": 0})
    if not isinstance(zero, dict):
        problems.append("config key 'deepspeed.zero_optimization': expected an object")
        return
    by_hidden = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in by_hidden.items():
        if _is_auto(zero.get(key)):
            zero[key] = value
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        problems.append(f"config key 'deepspeed.zero_optimization.stage': {json.dumps(stage)} "
                        "is not one of 0, 1, 2, 3")


def _leftover_autos(node: Any, prefix: str) -> list[str]:
    if isinstance(node, dict):
        found = []
        for key, value in node.items():
            found.extend(_leftover_autos(value, f"{prefix}.{key}"))
        return found
    return [f"config key '{prefix}': \"auto\" has no value to take from the job"] \
        if _is_auto(node) else []


def fill_deepspeed_config(raw: dict[str, Any], job: JobConfig, *, dp_size: int,
                          hidden_size: int) -> dict[str, Any]:
    """A copy of `raw` ready for `deepspeed.initialize`: "auto" values filled from the job,
    optimizer/scheduler blocks dropped, torch optimizers allowed under ZeRO."""
    config = copy.deepcopy(raw)
    problems: list[str] = []
    for block in ("optimizer", "scheduler"):
        if block in config:
            del config[block]
            logger.warning("deepspeed config: ignoring its %r block; the job's %r section is "
                           "used (a torch optimizer and LambdaLR)", block, block)
    _fill_scalar(config, "train_micro_batch_size_per_gpu", 1, "one packed sequence per "
                 "micro-batch", problems)
    _fill_scalar(config, "gradient_accumulation_steps", job.train.grad_accum, "train.grad_accum",
                 problems)
    _fill_scalar(config, "gradient_clipping", job.train.grad_clip, "train.grad_clip", problems)
    batch = config.get("train_batch_size", "auto")
    if _is_auto(batch):
        config.pop("train_batch_size", None)
    elif batch != job.train.grad_accum * dp_size:
        problems.append(f"config key 'deepspeed.train_batch_size': {json.dumps(batch)} != "
                        f"train.grad_accum ({job.train.grad_accum}) x data-parallel ranks "
                        f"({dp_size}); set it to \"auto\"")
    _fill_dtype(config, job.model.dtype, problems)
    _fill_zero(config, hidden_size, problems)
    problems.extend(_leftover_autos(config, "deepspeed"))
    if problems:
        raise ConfigError(problems)
    config["zero_allow_untested_optimizer"] = True
    config["zero_force_ds_cpu_optimizer"] = False
    config.setdefault("steps_per_print", 10**9)
    return config


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage of a (filled) DeepSpeed config."""
    return int(config.get("zero_optimization", {}).get("stage", 0))
