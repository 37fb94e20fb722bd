"""The DeepSpeed config of a job: load it (path or inline), apply overrides, fill "auto" values.

A stock DeepSpeed JSON works unchanged (HF Trainer's semantics). Where a value comes from:

- the launcher's settings first (accelerate's YAML, vlmcp/config/launch_env.py): `zero_optimization.stage`,
  the offload devices, `stage3_gather_16bit_weights_on_model_save`; they fill a missing or
  "auto" key, and a number that disagrees is an error naming both;
- `train_micro_batch_size_per_gpu`: 1 (a micro-batch is one packed sequence);
- `gradient_accumulation_steps`: `train.grad_accum`; `gradient_clipping`: `train.grad_clip`;
- `train_batch_size`: left for DeepSpeed to derive (micro x accumulation x data-parallel ranks);
- `bf16.enabled` / `fp16.enabled`: "auto" follows `model.dtype`. An explicit `true` (accelerate's
  templates say `fp16.enabled: true`) sets `model.dtype` when the job leaves it at its default,
  logged; where the job (or the launcher) sets another dtype it is an error naming both keys;
- `zero_optimization.stage`: "auto" is 2 (accelerate's default) unless the launcher says, and
  an offload `device: "auto"` is "none";
- `zero_optimization.reduce_bucket_size`, `stage3_prefetch_bucket_size`,
  `stage3_param_persistence_threshold`: from the text model's hidden size, as transformers does;
- `zero_optimization.stage3_gather_16bit_weights_on_model_save`: "auto" is true at stage 3
  (vlmcp's final export gathers the full weights anyway);
- an `optimizer` / `scheduler` block: DeepSpeed builds it, the job fills its "auto" params
  (training/ds/blocks.py);
- `expert_parallel`: from `parallel.ep_size` (DeepSpeed's AutoEP, training/ds/expert_parallel.py),
  and with it `comms_logger`, recording the expert all-to-all (training/ds/expert_comms.py).

Any other number that disagrees with the job (say `gradient_accumulation_steps: 4` with
`train.grad_accum: 1`) is an error naming both keys. Every key vlmcp changes is logged with its old
and new value (training/ds/edits.py). fp16 on a device that cannot run it (the CPU) and tensor
parallelism (`tensor_parallel.autotp_size` > 1) are errors naming the key.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from vlmcp import device
from vlmcp.config import JobConfig
from vlmcp.data import json_text
from vlmcp.errors import ConfigError
from vlmcp.training.ds.blocks import fill_optimizer_block, fill_scheduler_block, offloads_optimizer
from vlmcp.training.ds.edits import ABSENT, DeepSpeedEdits, get_path, shown
from vlmcp.training.ds.expert_comms import fill_comms_logger
from vlmcp.training.ds.expert_parallel import fill_expert_parallel

logger = logging.getLogger(__name__)

_DTYPE_FLAGS = {"bf16": "bfloat16", "fp16": "float16"}

#: What `zero_optimization.stage: "auto"` means without a launcher setting (accelerate's default).
DEFAULT_AUTO_STAGE = 2


def load_deepspeed_config(job: JobConfig) -> dict[str, Any]:
    """The raw DeepSpeed dict of a job (file or inline) with `--set deepspeed.*` applied."""
    if isinstance(job.deepspeed, dict):
        config = copy.deepcopy(job.deepspeed)
        source = "inline 'deepspeed'"
    else:
        path = job.resolve_input(job.deepspeed)
        try:
            config = json_text.loads(path.read_text())
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


def _apply_launcher(config: dict[str, Any], job: JobConfig, edits: DeepSpeedEdits) -> None:
    """The launcher's DeepSpeed settings fill missing or "auto" keys; others must agree."""
    for path, (value, source) in job.launcher_deepspeed.items():
        current = get_path(config, path)
        if path.endswith("offload_optimizer.device") or path.endswith("offload_param.device"):
            if value == "none" and current in (ABSENT, "none"):
                continue
        if current is ABSENT or _is_auto(current):
            edits.set(config, path, value, f"from {source}")
        elif current != value:
            edits.problem(f"{source} disagrees with the job's deepspeed config {path}="
                          f"{shown(current)}; make them equal or drop one")


def _fill_scalar(config: dict[str, Any], key: str, wanted: Any, job_key: str,
                 edits: DeepSpeedEdits) -> None:
    """`job_key` names where `wanted` comes from, value included (`JobConfig.shown_key`)."""
    value = config.get(key, "auto")
    if _is_auto(value):
        edits.set(config, key, wanted, f"from {job_key}")
    elif value != wanted:
        edits.problem(f"config key 'deepspeed.{key}': {json.dumps(value)} disagrees with "
                      f"{job_key}; set it to \"auto\" or make them equal")


def _dtype_is_fixed(job: JobConfig) -> bool:
    return "model.dtype" in job.explicit_keys or "model.dtype" in job.key_sources


def _fill_dtype(config: dict[str, Any], job: JobConfig, edits: DeepSpeedEdits) -> None:
    """bf16/fp16 blocks: "auto" follows model.dtype; an explicit true sets model.dtype when the
    job leaves it at its default (see module docstring)."""
    blocks = {flag: config.get(flag) for flag in _DTYPE_FLAGS}
    for flag, block in blocks.items():
        if block is not None and not isinstance(block, dict):
            edits.problem(f"config key 'deepspeed.{flag}': expected an object")
            return
    enabled = [flag for flag, block in blocks.items()
               if block is not None and block.get("enabled", "auto") is True]
    if len(enabled) > 1:
        edits.problem("config keys 'deepspeed.bf16.enabled' and 'deepspeed.fp16.enabled' are "
                      "both true; enable one")
        return
    if enabled and _DTYPE_FLAGS[enabled[0]] != job.model.dtype:
        wanted = _DTYPE_FLAGS[enabled[0]]
        if _dtype_is_fixed(job):
            edits.problem(f"config key 'deepspeed.{enabled[0]}.enabled': true disagrees with "
                          f"{job.shown_key('model.dtype', job.model.dtype)}; set it to "
                          "\"auto\" or make them equal")
            return
        logger.info("model.dtype: %r -> %r (from the deepspeed config's %s.enabled=true)",
                    job.model.dtype, wanted, enabled[0])
        job.model.dtype = wanted
    for flag, flag_dtype in _DTYPE_FLAGS.items():
        block, wanted = blocks[flag], job.model.dtype == flag_dtype
        if block is None:
            if wanted:
                edits.set(config, f"{flag}.enabled", True, f"model.dtype={job.model.dtype}")
            continue
        value = block.get("enabled", "auto")
        if _is_auto(value):
            edits.set(config, f"{flag}.enabled", wanted, f"\"auto\" from "
                      f"{job.shown_key('model.dtype', job.model.dtype)}")
        elif bool(value) != wanted:
            edits.problem(f"config key 'deepspeed.{flag}.enabled': {json.dumps(value)} "
                          f"disagrees with {job.shown_key('model.dtype', job.model.dtype)}")


def _fill_zero(config: dict[str, Any], hidden_size: int, edits: DeepSpeedEdits) -> None:
    zero = config.setdefault("zero_optimization", {"stage": 0})
    if not isinstance(zero, dict):
        edits.problem("config key 'deepspeed.zero_optimization': expected an object")
        return
    if _is_auto(zero.get("stage")):
        edits.set(config, "zero_optimization.stage", DEFAULT_AUTO_STAGE,
                  "\"auto\" without a launcher zero_stage: accelerate's default")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        edits.problem(f"config key 'deepspeed.zero_optimization.stage': {json.dumps(stage)} "
                      "is not one of 0, 1, 2, 3")
        return
    by_hidden = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in by_hidden.items():
        if _is_auto(zero.get(key)):
            edits.set(config, f"zero_optimization.{key}", value,
                      f"\"auto\" from the text hidden size {hidden_size}")
    for what in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(what), dict) and _is_auto(zero[what].get("device")):
            edits.set(config, f"zero_optimization.{what}.device", "none",
                      "\"auto\" without a launcher offload device: accelerate's default")
    gather = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    if _is_auto(zero.get("stage3_gather_16bit_weights_on_model_save")):
        edits.set(config, gather, stage == 3, f"\"auto\" at ZeRO stage {stage}")
    elif stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is False:
        logger.warning("deepspeed config %s is false: vlmcp's final export (output_dir/final) "
                       "gathers the full weights all the same", gather)


def _check_supported(config: dict[str, Any], job: JobConfig, edits: DeepSpeedEdits) -> None:
    """What DeepSpeed would accept but this run cannot do: fp16 off CUDA, tensor parallelism,
    skipping a non-finite step on an optimizer that cannot veto it."""
    from vlmcp.device import use_cuda

    if get_path(config, "fp16.enabled") is True and not use_cuda():
        edits.problem(f"config key 'deepspeed.fp16.enabled' is true "
                      f"({job.shown_key('model.dtype', job.model.dtype)}): fp16 does not run on "
                      "the CPU (DeepSpeed's CPU accelerator has no fp16); use bf16 there, or run "
                      "on CUDA")
    for key in ("autotp_size", "tp_size"):
        size = get_path(config, f"tensor_parallel.{key}")
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            edits.problem(f"config key 'deepspeed.tensor_parallel.{key}': {size}: vlmcp does not "
                          "run tensor parallelism (it runs sequence x data parallelism); "
                          "remove it or set it to 1")
    plain_fp32 = (get_path(config, "zero_optimization.stage") == 0
                  and get_path(config, "bf16.enabled") is not True
                  and get_path(config, "fp16.enabled") is not True)
    if "optimizer" in config and plain_fp32 and job.train.nonfinite == "skip":
        edits.problem("config key 'train.nonfinite' is 'skip', but the deepspeed config's "
                      "optimizer block at ZeRO stage 0 in fp32 gives an optimizer that cannot "
                      "skip a step; use ZeRO stage >= 1 or bf16, or drop the optimizer block")


def _leftover_autos(node: Any, prefix: str) -> list[str]:
    if isinstance(node, dict):
        found = []
        for key, value in node.items():
            found.extend(_leftover_autos(value, f"{prefix}.{key}"))
        return found
    return [f"config key '{prefix}': \"auto\" has no value to take from the job"] \
        if _is_auto(node) else []


def _torch_optimizer_keys(config: dict[str, Any], edits: DeepSpeedEdits) -> None:
    """The keys DeepSpeed needs to accept vlmcp's torch optimizer (no optimizer block)."""
    if "optimizer" in config:
        return
    edits.set(config, "zero_allow_untested_optimizer", True,
              "vlmcp passes its torch optimizer (no optimizer block)")
    if offloads_optimizer(config):
        edits.set(config, "zero_force_ds_cpu_optimizer", False,
                  "the job's torch optimizer steps on the CPU under offload_optimizer; add an "
                  "optimizer block, or set this to true, for DeepSpeed's CPU Adam")


def fill_deepspeed_config(raw: dict[str, Any], job: JobConfig, *, dp_size: int,
                          hidden_size: int, moe_top_k: int = 0) -> dict[str, Any]:
    """A copy of `raw` ready for `deepspeed.initialize` (see the module docstring).

    moe_top_k: the model's experts per token (0 for a dense model, where `parallel.ep_size` > 1
    is refused by the model's checks, not here).

    May set `job.model.dtype` from an explicit bf16/fp16 block (logged). Raises ConfigError
    with one line per problem.
    """
    config = copy.deepcopy(raw)
    edits = DeepSpeedEdits()
    _apply_launcher(config, job, edits)
    _fill_scalar(config, "train_micro_batch_size_per_gpu", 1, "1: one packed sequence per "
                 "micro-batch", edits)
    _fill_scalar(config, "gradient_accumulation_steps", job.train.grad_accum,
                 job.shown_key("train.grad_accum", job.train.grad_accum), edits)
    _fill_scalar(config, "gradient_clipping", job.train.grad_clip,
                 job.shown_key("train.grad_clip", job.train.grad_clip), edits)
    batch = config.get("train_batch_size", "auto")
    if _is_auto(batch):
        edits.remove(config, "train_batch_size", "DeepSpeed derives it: micro-batch x "
                     "accumulation x data-parallel ranks")
    elif batch != job.train.grad_accum * dp_size:
        edits.problem(f"config key 'deepspeed.train_batch_size': {json.dumps(batch)} != "
                      f"train.grad_accum ({job.train.grad_accum}) x data-parallel ranks "
                      f"({dp_size}); set it to \"auto\"")
    _fill_dtype(config, job, edits)
    _fill_zero(config, hidden_size, edits)
    fill_optimizer_block(config, job, edits)
    fill_scheduler_block(config, job, edits)
    _torch_optimizer_keys(config, edits)
    if moe_top_k or job.parallel.ep_size == 1:
        fill_expert_parallel(config, job.parallel.ep_size, moe_top_k, edits)
    fill_comms_logger(config, job.parallel.ep_size, edits, device.use_cuda())
    if job.parallel.ep_size > 1 and get_path(config, "hybrid_engine.enabled") is True:
        edits.problem(f"config key 'deepspeed.hybrid_engine.enabled' is true with "
                      f"parallel.ep_size={job.parallel.ep_size}: vlmcp builds the expert-parallel "
                      "engine itself (training/ds/initialize.py) and does not run DeepSpeed's "
                      "hybrid engine; remove the section")
    if job.parallel.ep_size > 1 and job.lora.r and get_path(config, "zero_optimization.stage") == 3:
        edits.problem(f"config key 'deepspeed.zero_optimization.stage' is 3 with "
                      f"parallel.ep_size={job.parallel.ep_size} and LoRA (lora.r={job.lora.r}): "
                      "DeepSpeed 0.19.8 cannot checkpoint AutoEP's frozen expert weights under "
                      "ZeRO-3 (\"AutoEP with ZeRO Stage 3 checkpointing does not support frozen "
                      "expert parameters yet\"); use ZeRO stage 1 or 2")
    if job.parallel.ep_size > 1 and "optimizer" in config:
        edits.problem("config key 'deepspeed.optimizer' with parallel.ep_size > 1: DeepSpeed "
                      "builds its optimizer without the expert parameters' own param groups, "
                      "which ZeRO needs under expert parallelism; drop the block (the job's "
                      "optimizer section builds it)")
    if "steps_per_print" not in config:
        edits.set(config, "steps_per_print", 10**9, "vlmcp writes its own metrics rows")
    if not edits.problems:
        _check_supported(config, job, edits)
    problems = edits.problems + _leftover_autos(config, "deepspeed")
    if problems:
        raise ConfigError(problems)
    return config


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage of a (filled) DeepSpeed config."""
    return int(config.get("zero_optimization", {}).get("stage", 0))
