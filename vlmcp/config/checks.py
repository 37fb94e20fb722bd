"""Checking a raw job dict against the schema: types, ranges, and the rules across keys.

Every problem is one line naming the full key path (``unknown config key 'train.max_stepz'``,
``config key 'data.max_seq_len': must be >= 2, got 1``); all of them are collected, so one run of
`vlmcp validate` lists every problem of a job.
"""

from __future__ import annotations

import json
import math
import os
import types
import typing
import urllib.parse
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from vlmcp.config.rl_checks import rl_problems
from vlmcp.config.schema import (JobConfig, LoraSection, ModelSection, PublishSection, RolloutsSection,
                                 VideoSection)
from vlmcp.data.sources import data_files
from vlmcp.errors import DataSpecError


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             dict: "an object", type(None): "null"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).split(' ', 1)[-1]}s"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return str(tp)


def _matches(value: Any, tp: Any) -> tuple[bool, Any]:
    """Whether `value` fits type `tp`; returns (ok, the value converted, e.g. int -> float)."""
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            return False, value
        try:
            return True, float(value)
        except OverflowError:  # an integer beyond the float range: not finite, as 1e400 is not
            return True, math.inf if value > 0 else -math.inf
    if tp is str or tp is dict or tp is list:
        return isinstance(value, tp), value
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            return False, value
        item_type = typing.get_args(tp)[0]
        converted = []
        for item in value:
            ok, item = _matches(item, item_type)
            if not ok:
                return False, value
            converted.append(item)
        return True, converted
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            ok, converted = _matches(value, option)
            if ok:
                return True, converted
        return False, value
    raise TypeError(f"unsupported schema type {tp!r}")


def _check_range(value: Any, meta: dict[str, Any], key: str) -> str | None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        shown = ", ".join(json.dumps(c) for c in choices)
        return f"config key '{key}': {json.dumps(value)} is not one of {shown}"
    if value is None or isinstance(value, (bool, str, dict)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"config key '{key}': must be a finite number, got {value}"
    if isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v)
                                       for v in value):
        return f"config key '{key}': every value must be a finite number, got {value}"
    if "length" in meta and len(value) != meta["length"]:
        return f"config key '{key}': expected {meta['length']} values, got {len(value)}"
    if "min" in meta and value < meta["min"]:
        return f"config key '{key}': must be >= {meta['min']}, got {json.dumps(value)}"
    if "max" in meta and value > meta["max"]:
        return f"config key '{key}': must be <= {meta['max']}, got {json.dumps(value)}"
    return None


def build_section(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from `raw`, appending one line per problem to `problems`."""
    section = prefix.rstrip(".") or "the job"
    if not isinstance(raw, dict):
        problems.append(f"config key '{section}': expected an object, got {json.dumps(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls) if not f.metadata.get("internal")}
    for name in raw:
        if name not in known:
            problems.append(f"unknown config key '{prefix}{name}'")
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if is_dataclass(tp):
            values[f.name] = build_section(tp, raw.get(f.name, {}), key + ".", problems)
            continue
        if f.name not in raw:
            if f.metadata.get("required"):
                problems.append(f"missing required config key '{key}'")
            continue
        if f.metadata.get("files") and raw[f.name] is not None:
            problems.extend(_file_list_problems(raw[f.name], key, f.metadata["files"]))
            values[f.name] = raw[f.name]
            continue
        ok, value = _matches(raw[f.name], tp)
        if not ok:
            problems.append(f"config key '{key}': expected {_type_name(tp)}, "
                            f"got {json.dumps(raw[f.name])}")
            continue
        if f.metadata.get("required") and value == "":
            problems.append(f"config key '{key}': must not be empty")
            continue
        problem = _check_range(value, f.metadata, key)
        if problem:
            problems.append(problem)
            continue
        values[f.name] = value
    return cls(**values)


def _file_list_problems(value: Any, key: str, kind: str) -> list[str]:
    """Problems of a data file key: a path, or a list of paths / {"path", "weight"} objects."""
    try:
        data_files(value, key, weighted=kind == "weighted")
    except DataSpecError as exc:
        return exc.problems
    return []


#: apply_chat_template arguments vlmcp sets itself, or that only act when it tokenizes (it renders
#: text): not accepted in data.chat_template_kwargs.
_RENDERING_ARGUMENTS = ("conversation", "tokenize", "add_generation_prompt",
                        "continue_final_message", "return_dict", "return_tensors",
                        "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                        "tokenizer_kwargs")


def cross_key_problems(job: JobConfig) -> list[str]:
    """Rules that involve more than one key."""
    problems = [f"config key 'data.chat_template_kwargs': '{name}' is set by vlmcp when it "
                "renders a sample and cannot be given"
                for name in _RENDERING_ARGUMENTS if name in job.data.chat_template_kwargs]
    if job.train.eval_every and not job.data.eval:
        problems.append("config key 'train.eval_every' is set but 'data.eval' is not")
    if job.eval.generate and not job.data.eval:
        problems.append("config key 'eval.generate' is true but 'data.eval' is not set")
    if job.eval.generate and not job.train.eval_every:
        problems.append("config key 'eval.generate' is true but 'train.eval_every' is 0, so no "
                        "evaluation runs")
    problems.extend(_sp_dynamic_checks(job))
    problems.extend(_expert_parallel_checks(job))
    problems.extend(_lora_checks(job.lora, job.model))
    problems.extend(_memory_feature_checks(job))
    problems.extend(_video_checks(job.data.video))
    problems.extend(_rollout_checks(job))
    problems.extend(_publish_target_checks(job.publish, _pushed_by_rl(job)))
    problems.extend(_publish_writer_checks(job))
    problems.extend(_engine_push_checks(job))
    problems.extend(rl_problems(job))
    problems.extend(_overlapping_dirs(job))
    return problems


def _sp_dynamic_checks(job: JobConfig) -> list[str]:
    """parallel.sp_dynamic needs an SP group to choose a degree in."""
    if job.parallel.sp_dynamic and job.parallel.sp_size == 1:
        return ["config key 'parallel.sp_dynamic' is true but 'parallel.sp_size' is 1: every "
                "pack already runs whole on one rank"]
    return []


def _expert_parallel_checks(job: JobConfig) -> list[str]:
    """What `parallel.ep_size` > 1 does not run (docs/expert-parallelism.md says why)."""
    if job.parallel.ep_size == 1:
        return []
    refused = [
        (job.lora.r and not job.lora.target_parameters, "'lora.target_parameters' is empty",
         "under expert parallelism LoRA trains the routed experts' adapters (name "
         "mlp.experts.gate_up_proj and/or mlp.experts.down_proj there): DeepSpeed's ZeRO refuses "
         "an EP run with no trainable expert parameter (\"The model has moe layers, but None of "
         "the param groups are marked as MoE\")"),
        (job.publish.dir and not job.publish.sharded and not job.lora.r,
         "'publish.sharded' is false",
         "rank 0 would gather every expert; keep it true (each rank writes the experts it holds)"),
    ]
    return [f"config key {what} with parallel.ep_size={job.parallel.ep_size}: {why}"
            for applies, what, why in refused if applies]


def _publish_writer_checks(job: JobConfig) -> list[str]:
    """publish.sharded and publish.background against each other and LoRA (explicit values)."""
    given = {key for key in ("publish.sharded", "publish.background")
             if key in job.explicit_keys}
    if job.lora.r:
        return [f"config key '{key}' does not apply under LoRA (lora.r > 0): the adapter is small "
                "and rank 0 writes it" for key in sorted(given)]
    if "publish.background" in given and job.publish.background and not job.publish.sharded:
        return ["config key 'publish.background' is true but 'publish.sharded' is false: the "
                "background write is the rank-parallel one; set publish.sharded to true"]
    return []


#: The publish keys that only the push into engines reads, and those only publish.dir reads.
_PUSH_KEYS = ("dir_every", "bucket_mb", "engine_timeout_s", "engine_pause", "on_engine_error",
              "push_dtype", "push_staged", "push_host", "dense_every", "verify_push")
_DIR_KEYS = ("keep", "dir_every")


def _pushed_by_rl(job: JobConfig) -> bool:
    """Whether `vlmcp rl` fills publish.engines in (rl.weights "push", `trainer_job`)."""
    return job.rl.enabled and job.rl.weights == "push"


def _publish_target_checks(publish: PublishSection, pushed_by_rl: bool = False) -> list[str]:
    """Publishing is on with publish.dir, publish.engines or both; each one's own keys need it
    (`pushed_by_rl`: publish.engines is filled in from the rl section)."""
    engines = publish.engines or pushed_by_rl
    if not publish.dir and not engines:
        return [problem.replace("'publish.dir' is not", "neither 'publish.dir' nor "
                                "'publish.engines' is")
                for problem in _keys_set_without(publish, "publish", "dir")]
    default = PublishSection()
    problems = [f"config key 'publish.{key}' is set but 'publish.{switch}' is {empty}"
                for keys, switch, on, empty in ((_PUSH_KEYS, "engines", engines, "empty"),
                                                (_DIR_KEYS, "dir", publish.dir, "not"))
                if not on
                for key in keys if getattr(publish, key) != getattr(default, key)]
    seen: set[str] = set()
    for url in publish.engines:
        parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
            problems.append(f"config key 'publish.engines': {url!r} is not an engine's base URL "
                            "(http://HOST:PORT)")
        elif url.rstrip("/") in seen:
            problems.append(f"config key 'publish.engines' names {url!r} twice")
        seen.add(str(url).rstrip("/"))
    if publish.dir and publish.engines and publish.dir_every \
            and publish.dir_every % publish.every:
        # else steps would go to the disk that no engine was pushed, and the durable record
        # would hold versions the engines never served
        problems.append(f"config key 'publish.dir_every' is {publish.dir_every}, not a multiple "
                        f"of 'publish.every' ({publish.every}): publish.dir records pushed steps; "
                        f"use {publish.every * max(1, round(publish.dir_every / publish.every))} "
                        "or another multiple")
    return sorted(set(problems), key=problems.index)


def _engine_push_checks(job: JobConfig) -> list[str]:
    """What the push into engines does not do: a LoRA run's merged experts under expert
    parallelism, a rank-0 gather."""
    if not job.publish.engines:
        return []
    if job.lora.r and job.parallel.ep_size > 1:
        return [f"config key 'publish.engines' with lora.r={job.lora.r} and 'parallel.ep_size' "
                f"{job.parallel.ep_size}: a LoRA run pushes its merged weights, which vlmcp does "
                "not compute under expert parallelism; train at ep_size 1, or publish the "
                "adapter to publish.dir and export it merged (vlmcp export --merge)"]
    if not job.publish.sharded:
        return ["config key 'publish.sharded' is false with 'publish.engines': every rank pushes "
                "its own share; keep it true"]
    return []


def _real_dir(path: str) -> Path:
    """`path` as the filesystem means it: absolute, `~` expanded, symbolic links resolved (also
    of its parts that exist, when the rest does not exist yet)."""
    return Path(os.path.realpath(Path(path).expanduser().absolute()))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _overlapping_dirs(job: JobConfig) -> list[str]:
    """Directories that vlmcp writes or deletes in, placed where that would destroy another's.

    rollouts.dir is only read (its producer owns it), publish.dir holds step_N directories that
    vlmcp writes, replaces and prunes, and the final export replaces OUTPUT_DIR/final whole; so
    publish.dir and rollouts.dir may not overlap at all (equal, or one inside the other), output_dir
    may not lie in rollouts.dir, and neither rollouts.dir nor publish.dir may lie in the
    directories vlmcp replaces or prunes under output_dir (checkpoints/, final/).
    """
    named = {key: _real_dir(value) for key, value in (
        ("rollouts.dir", job.rollouts.dir), ("publish.dir", job.publish.dir),
        ("output_dir", job.output_dir)) if value}
    rollouts, publish, output = (named.get(k) for k in ("rollouts.dir", "publish.dir",
                                                         "output_dir"))
    problems = []

    def refuse(inner_key: str, inner: Path, outer_key: str, outer: Path, why: str) -> None:
        where = "is" if inner == outer else "lies inside"
        problems.append(f"config keys '{inner_key}' and '{outer_key}' overlap: {inner} {where} "
                        f"{outer}; {why}; give them separate directories")

    if rollouts and publish:
        for (a_key, a), (b_key, b) in ((("publish.dir", publish), ("rollouts.dir", rollouts)),
                                       (("rollouts.dir", rollouts), ("publish.dir", publish))):
            if _within(a, b):
                refuse(a_key, a, b_key, b, "vlmcp writes, replaces and deletes step_N "
                       "directories in publish.dir and never writes in rollouts.dir")
                break
    if rollouts and output and _within(output, rollouts):
        refuse("output_dir", output, "rollouts.dir", rollouts,
               "vlmcp never writes in rollouts.dir")
    for key, path in (("rollouts.dir", rollouts), ("publish.dir", publish)):
        for sub in ("checkpoints", "final"):
            if path and output and _within(path, output / sub):
                refuse(key, path, "output_dir", output / sub,
                       f"vlmcp replaces and prunes OUTPUT_DIR/{sub}")
    return problems


def _memory_feature_checks(job: JobConfig) -> list[str]:
    """train.tiled_mlp and train.offload_activations against the keys they cannot run with."""
    problems = []
    if job.train.offload_activations and not job.train.gradient_checkpointing:
        problems.append("config key 'train.offload_activations' is true but "
                        "'train.gradient_checkpointing' is false; it moves the checkpointed "
                        "layer inputs, so it needs checkpointing")
    if job.train.tiled_mlp and job.model.router_aux_loss:
        problems.append("config key 'train.tiled_mlp' is true with 'model.router_aux_loss': TiledMLP "
                        "runs the MoE router without autograd in forward, so the aux loss would "
                        "get no gradient; turn one of them off")
    if job.train.tiled_mlp and job.lora.r and job.lora.dropout:
        problems.append(f"config key 'train.tiled_mlp' is true with 'lora.dropout' {job.lora.dropout}: "
                        "TiledMLP recomputes the MLP in backward without replaying its dropout "
                        "masks; set lora.dropout to 0 or train.tiled_mlp to false")
    return problems


def _video_checks(video: VideoSection) -> list[str]:
    """`data.video` rules beyond each key's range."""
    problems = [f"config key 'data.video.{name}': must be > 0, got 0"
                for name in ("fps", "frame_list_fps") if getattr(video, name) == 0]
    for low, high in (("min_frames", "max_frames"), ("min_pixels", "max_pixels")):
        a, b = getattr(video, low), getattr(video, high)
        if a is not None and b is not None and a > b:
            problems.append(f"config key 'data.video.{low}' ({a}) is above "
                            f"'data.video.{high}' ({b})")
    return problems


def training_data_problems(job: JobConfig) -> list[str]:
    """data.train is required unless rollouts.dir names the training data."""
    if job.data.train or job.rollouts.dir:
        return []
    return ["missing required config key 'data.train'"]


def _keys_set_without(section: RolloutsSection | PublishSection, name: str, switch: str
                      ) -> list[str]:
    """The keys of `section` set to other than their defaults while its `switch` key is off."""
    if getattr(section, switch):
        return []
    default = type(section)()
    return [f"config key '{name}.{f.name}' is set but '{name}.{switch}' is not"
            for f in fields(section) if f.name != switch
            and getattr(section, f.name) != getattr(default, f.name)]


def _rollout_checks(job: JobConfig) -> list[str]:
    """The rollouts keys that need rollouts.dir, or do not apply with it."""
    rollouts = job.rollouts
    if not rollouts.dir:
        return _keys_set_without(rollouts, "rollouts", "dir")
    problems = []
    if job.train.grad_accum != 1:
        problems.append("config key 'train.grad_accum' does not apply with 'rollouts.dir': each "
                        "step runs as many micro-batches per rank as its samples pack into "
                        "(data.max_seq_len)")
    if rollouts.on_stale != "error" and rollouts.max_staleness is None:
        problems.append("config key 'rollouts.on_stale' is set but 'rollouts.max_staleness' is "
                        "not, so no step is ever stale")
    if job.loss.reference_logps is not None:
        problems.append("config key 'loss.reference_logps' does not apply with 'rollouts.dir': "
                        "it scores data.train (or names a score of it); the pairs of a rollout "
                        "step carry their reference sums in the records (ref_chosen_logp, "
                        "ref_rejected_logp)")
    return problems


def _lora_checks(lora: LoraSection, model: ModelSection) -> list[str]:
    """The `lora` section's own rules (the module names are checked against the model later)."""
    if not lora.r:
        changed = [f.name for f in fields(LoraSection)
                   if f.name != "r" and getattr(lora, f.name) != getattr(LoraSection(), f.name)]
        return [f"config key 'lora.{name}' is set but 'lora.r' is 0 (LoRA off)" for name in changed]
    problems = []
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        problems.append(f"config key 'lora.target_modules': expected a list of module names or "
                        f"\"all-linear\", got {json.dumps(lora.target_modules)}")
    if (isinstance(lora.target_modules, list) and not lora.target_modules
            and not lora.target_parameters):
        problems.append("config key 'lora.target_modules': must name at least one module (or "
                        "set lora.target_parameters)")
    if lora.target_parameters and lora.dropout:
        problems.append(f"config key 'lora.dropout' is {lora.dropout} but 'lora.target_parameters' "
                        "is set: PEFT's parameter LoRA has no dropout (set lora.dropout to 0)")
    if not model.freeze_vision:
        problems.append("config key 'model.freeze_vision' is false but LoRA (lora.r > 0) keeps "
                        "the vision tower frozen")
    return problems
