"""Settings a launcher hands the processes: what `accelerate launch --config_file X.yaml` exports.

vlmcp never builds an `accelerate.Accelerator`, so it reads the environment accelerate prepares
for its ranks (`accelerate.utils.launch.prepare_deepspeed_cmd_env` and
`prepare_extend_env_parallelism_config`) and applies it to the job once, when the job is loaded
for `train` or `validate`:

    YAML key                      exported as (ACCELERATE_ + ...)      sets
    zero_stage                    DEEPSPEED_ZERO_STAGE                 zero_optimization.stage
    offload_optimizer_device      DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE   ...offload_optimizer.device
    offload_param_device          DEEPSPEED_OFFLOAD_PARAM_DEVICE       ...offload_param.device
    zero3_save_16bit_model        DEEPSPEED_ZERO3_SAVE_16BIT_MODEL     ...stage3_gather_16bit_*
    zero3_init_flag               DEEPSPEED_ZERO3_INIT                 build ZeRO-3 partitioned
    gradient_accumulation_steps   GRADIENT_ACCUMULATION_STEPS          train.grad_accum
    gradient_clipping             GRADIENT_CLIPPING                    train.grad_clip
    deepspeed_config_file         DEEPSPEED_CONFIG_FILE                deepspeed (the JSON path)
    mixed_precision no/bf16/fp16  MIXED_PRECISION                      model.dtype fp32/bf16/fp16
    parallelism_config_sp_size    (PARALLELISM_CONFIG_SP_SIZE)         parallel.sp_size

A job-level value fills the job's default; where the job itself sets the key (file or `--set`)
to another value, that is one error naming both. The DeepSpeed-level values fill the DeepSpeed
config's missing or "auto" keys (training/ds/config.py), and a number there that disagrees is
an error naming both. `mixed_precision: 'no'` counts only when the YAML says it (accelerate
exports 'no' by default; ACCELERATE_CONFIG_DS_FIELDS names the keys the YAML gave).

`parallelism_config_tp_size` / `cp_size` above 1 are errors (vlmcp runs SP x DP only), and so
is a `dp_replicate_size x dp_shard_size` above 1 that is not world / sp (vlmcp's data-parallel
size is always world / sp, as DeepSpeed's own SP does). A distributed type vlmcp cannot run
(FSDP, Megatron-LM) is an error. Every other ACCELERATE_* / PARALLELISM_CONFIG_* variable is
either known to change nothing here (listed in `_INERT`) or logged as a warning: not honoured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vlmcp.config.schema import JobConfig
from vlmcp.errors import ConfigError

logger = logging.getLogger(__name__)

_PREFIXES = ("ACCELERATE_", "PARALLELISM_CONFIG_")
_ACC_DS = "ACCELERATE_DEEPSPEED_"
_PC = "PARALLELISM_CONFIG_"

#: accelerate mixed_precision -> model.dtype
_PRECISION_DTYPE = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: Variables that change nothing in a vlmcp run while they hold these values (None: any value).
_INERT: dict[str, set[str] | None] = {
    "ACCELERATE_USE_DEEPSPEED": None,
    "ACCELERATE_CONFIG_DS_FIELDS": None,
    "ACCELERATE_USE_PARALLELISM_CONFIG": None,
    "ACCELERATE_DEBUG_MODE": None,
    "ACCELERATE_USE_CPU": {"false", "False"},
    "ACCELERATE_DYNAMO_BACKEND": {"no", "NO"},
    "ACCELERATE_DYNAMO_MODE": None,
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": None,
    "ACCELERATE_DYNAMO_USE_DYNAMIC": None,
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": None,
    _PC + "SP_BACKEND": {"deepspeed"},
    _PC + "CP_BACKEND": None,
    _PC + "CP_COMM_STRATEGY": None,
    _PC + "SP_SEQ_LENGTH": {"None"},
    _PC + "SP_SEQ_LENGTH_IS_VARIABLE": None,
    _PC + "SP_ATTN_IMPLEMENTATION": {"sdpa"},
}

#: Distributed types vlmcp cannot run, by the variable accelerate sets for them.
_UNSUPPORTED = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM"}


def _source(env: str, yaml_key: str, environ: Mapping[str, str]) -> str:
    return f"accelerate config {yaml_key}={environ[env]} ({env})"


def _parse(env: str, yaml_key: str, environ: Mapping[str, str], convert: Callable[[str], Any],
           problems: list[str]) -> Any:
    try:
        return convert(environ[env])
    except ValueError:
        problems.append(f"{_source(env, yaml_key, environ)}: not a valid value")
        return None


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(text)
    return lowered in ("true", "1", "yes")


def _set_job_key(job: JobConfig, key: str, value: Any, source: str, problems: list[str]) -> None:
    """Give job key `key` the launcher's value, unless the job sets another one itself."""
    section, name = key.split(".")
    current = getattr(getattr(job, section), name)
    if key in job.explicit_keys:
        if current != value:
            problems.append(f"{source} disagrees with the job's {key}={current!r}; make them "
                            "equal or drop one")
        return
    if current != value:
        logger.info("%s: %r -> %r (from %s)", key, current, value, source)
    setattr(getattr(job, section), name, value)
    job.key_sources[key] = source


def _apply_deepspeed_file(job: JobConfig, environ: Mapping[str, str], problems: list[str]) -> None:
    env = _ACC_DS + "CONFIG_FILE"
    source = _source(env, "deepspeed_config_file", environ)
    path = Path(environ[env]).expanduser().resolve()
    if "deepspeed" in job.explicit_keys:
        mine = (job.resolve_input(job.deepspeed).resolve() if isinstance(job.deepspeed, str)
                else None)
        if mine != path:
            shown = job.deepspeed if isinstance(job.deepspeed, str) else "an inline object"
            problems.append(f"{source} disagrees with the job's deepspeed={shown!r}; give the "
                            "DeepSpeed config in one place")
        return
    logger.info("deepspeed: the job's default -> %s (from %s)", path, source)
    job.deepspeed = str(path)
    job.key_sources["deepspeed"] = source


def _apply_precision(job: JobConfig, environ: Mapping[str, str], problems: list[str]) -> None:
    env = "ACCELERATE_MIXED_PRECISION"
    value = environ[env].strip().lower()
    from_yaml = "mixed_precision" in environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
    if value == "no" and not from_yaml:
        return
    if value not in _PRECISION_DTYPE:
        problems.append(f"{_source(env, 'mixed_precision', environ)}: vlmcp runs 'no', 'bf16' or "
                        "'fp16' (model.dtype float32, bfloat16, float16)")
        return
    _set_job_key(job, "model.dtype", _PRECISION_DTYPE[value],
                 _source(env, "mixed_precision", environ), problems)


def _apply_parallelism(job: JobConfig, environ: Mapping[str, str], problems: list[str]) -> None:
    sizes = {}
    for dim in ("SP", "TP", "CP", "DP_REPLICATE", "DP_SHARD"):
        env = f"{_PC}{dim}_SIZE"
        if env in environ:
            sizes[dim] = _parse(env, f"parallelism_config_{dim.lower()}_size", environ, int,
                                problems)
    if sizes.get("SP") is not None:
        env = _PC + "SP_SIZE"
        _set_job_key(job, "parallel.sp_size", sizes["SP"],
                     _source(env, "parallelism_config_sp_size", environ), problems)
    for dim in ("TP", "CP"):
        if (sizes.get(dim) or 1) > 1:
            env = f"{_PC}{dim}_SIZE"
            problems.append(f"{_source(env, f'parallelism_config_{dim.lower()}_size', environ)}: "
                            f"vlmcp runs sequence x data parallelism only; set it to 1")
    dp = (sizes.get("DP_REPLICATE") or 1) * (sizes.get("DP_SHARD") or 1)
    world = int(environ.get("WORLD_SIZE", "0") or 0)
    if dp > 1 and world and dp * job.parallel.sp_size != world:
        problems.append(f"accelerate config parallelism_config_dp_replicate_size x "
                        f"parallelism_config_dp_shard_size = {dp} ({_PC}DP_REPLICATE_SIZE, "
                        f"{_PC}DP_SHARD_SIZE) is not world {world} / parallel.sp_size "
                        f"{job.parallel.sp_size}; vlmcp's data-parallel size is world / sp_size")


#: (variable, YAML key, converter, job key) for plain job keys.
_JOB_KEYS = [
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps", int,
     "train.grad_accum"),
    ("ACCELERATE_GRADIENT_CLIPPING", "gradient_clipping", float, "train.grad_clip"),
]

#: (variable, YAML key, converter, DeepSpeed key path) for DeepSpeed config keys.
_DEEPSPEED_KEYS = [
    (_ACC_DS + "ZERO_STAGE", "zero_stage", int, "zero_optimization.stage"),
    (_ACC_DS + "OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device", str.lower,
     "zero_optimization.offload_optimizer.device"),
    (_ACC_DS + "OFFLOAD_PARAM_DEVICE", "offload_param_device", str.lower,
     "zero_optimization.offload_param.device"),
    (_ACC_DS + "ZERO3_SAVE_16BIT_MODEL", "zero3_save_16bit_model", _bool,
     "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
]


def apply_launch_env(job: JobConfig, environ: Mapping[str, str]) -> None:
    """Apply the accelerate settings in `environ` to `job` (in place; see the module docstring).

    Raises ConfigError naming the YAML key, its variable and the job key it disagrees with.
    """
    launched = {k: v for k, v in environ.items() if k.startswith(_PREFIXES)}
    if not launched:
        return
    problems: list[str] = []
    handled: set[str] = set()
    for env, name in _UNSUPPORTED.items():
        if launched.get(env, "").lower() == "true":
            problems.append(f"{env}=true: accelerate's distributed_type {name} is not what vlmcp "
                            "runs; use distributed_type: DEEPSPEED")
        handled.add(env)
    for env, yaml_key, convert, key in _JOB_KEYS:
        if env in launched:
            value = _parse(env, yaml_key, environ, convert, problems)
            if value is not None:
                _set_job_key(job, key, value, _source(env, yaml_key, environ), problems)
            handled.add(env)
    if _ACC_DS + "CONFIG_FILE" in launched:
        _apply_deepspeed_file(job, environ, problems)
        handled.add(_ACC_DS + "CONFIG_FILE")
    if "ACCELERATE_MIXED_PRECISION" in launched:
        _apply_precision(job, environ, problems)
        handled.add("ACCELERATE_MIXED_PRECISION")
    _apply_parallelism(job, environ, problems)
    handled |= {f"{_PC}{dim}_SIZE" for dim in ("SP", "TP", "CP", "DP_REPLICATE", "DP_SHARD")}
    for env, yaml_key, convert, ds_key in _DEEPSPEED_KEYS:
        if env in launched:
            value = _parse(env, yaml_key, environ, convert, problems)
            if value is not None:
                job.launcher_deepspeed[ds_key] = (value, _source(env, yaml_key, environ))
            handled.add(env)
    if job.launcher_deepspeed and "deepspeed" not in job.explicit_keys \
            and "deepspeed" not in job.key_sources:
        # The job's default DeepSpeed config ({"zero_optimization": {"stage": 0}}) is no
        # setting of the user's: start from an empty one, which the launcher's keys fill.
        job.deepspeed = {}
    if _ACC_DS + "ZERO3_INIT" in launched:
        env = _ACC_DS + "ZERO3_INIT"
        job.zero3_init = _parse(env, "zero3_init_flag", environ, _bool, problems)
        job.key_sources["zero3_init"] = _source(env, "zero3_init_flag", environ)
        handled.add(env)
    if problems:
        raise ConfigError(problems)
    for env in sorted(set(launched) - handled):
        allowed = _INERT.get(env, set())
        if env in _INERT and (allowed is None or launched[env] in allowed):
            continue
        logger.warning("%s=%s: not honoured by vlmcp (it has no such setting); the run ignores "
                       "it", env, launched[env])
