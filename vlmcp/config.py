"""The job schema: one JSON file describes a whole training run.

A job is a JSON object with the sections below. Every key has a default except `model.path` and
`data.train`. An unknown key, a value of the wrong type or a value out of range is an error that
names the full key path (for example ``unknown config key 'train.max_stepz'``).

Relative input paths (`model.path`, the files of `data.train` and `data.eval`, `data.image_root`, a
`deepspeed` JSON path) are looked up next to the job file first and then in the current directory.
`output_dir` is relative to the current directory.

Overrides given as ``--set key.path=value`` are parsed as JSON when they parse (``4``, ``true``,
``[0.9, 0.99]``, ``null``) and taken as a plain string otherwise. Keys under ``deepspeed.`` edit the
DeepSpeed config after it is loaded, whether it is a path or an inline dict.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmcp.data.sources import DataSpecError, data_files


class JobError(ValueError):
    """A job that cannot run; `problems` holds one line per problem, each naming what to fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(JobError):
    """Problems in the job's keys and values; each line names its key."""


def _key(help_text: str, **checks: Any) -> dict[str, Any]:
    """Field metadata: a help text plus optional `choices`, `min`, `max` and `required` checks."""
    return {"help": help_text, **checks}


@dataclass
class ModelSection:
    path: str = field(default="", metadata=_key(
        "local Hugging Face checkpoint directory (config.json, safetensors, tokenizer, "
        "preprocessor_config.json, chat template); loaded offline", required=True))
    dtype: str = field(default="float32", metadata=_key(
        "parameter and compute dtype", choices=["float32", "bfloat16", "float16"]))
    freeze_vision: bool = field(default=True, metadata=_key(
        "keep the vision tower frozen: replicated, outside the optimizer and ZeRO-3"))
    attn_implementation: str | None = field(default=None, metadata=_key(
        "attention implementation given to from_pretrained (null: sdpa); in training the "
        "text model's full attention always runs vlmcp's registered Ulysses kernel",
        choices=[None, "sdpa", "eager", "flash_attention_2"]))
    router_aux_loss: bool = field(default=False, metadata=_key(
        "MoE checkpoints only: add router_aux_loss_coef (from the checkpoint's config) x the "
        "router load-balancing loss of each micro-batch over its real tokens, as transformers "
        "computes it with output_router_logits; reported as router_aux_loss in metrics"))


@dataclass
class VideoSection:
    fps: float | None = field(default=None, metadata=_key(
        "frames sampled per second of video (null: video_preprocessor_config.json's fps)",
        min=0.0))
    min_frames: int | None = field(default=None, metadata=_key(
        "fewest frames sampled from a video, when it has that many (null: the checkpoint's)",
        min=1))
    max_frames: int | None = field(default=None, metadata=_key(
        "most frames sampled from a video (null: the checkpoint's)", min=1))
    min_pixels: int | None = field(default=None, metadata=_key(
        "lower bound of a video's sampled frames' pixels, all frames together (null: the "
        "checkpoint's size.shortest_edge)", min=1))
    max_pixels: int | None = field(default=None, metadata=_key(
        "upper bound of a video's sampled frames' pixels, all frames together (null: the "
        "checkpoint's size.longest_edge)", min=1))
    frame_list_fps: float | None = field(default=None, metadata=_key(
        "native frame rate of a video given as a list of frame images, when its record has no "
        '"fps" (null: such a record is an error)', min=0.0))


@dataclass
class DataSection:
    train: str | list = field(default="", metadata=_key(
        "training data: a JSONL or JSON-array file, a list of them, or a weighted mixture "
        '[{"path": ..., "weight": w}, ...] (paths and objects may mix); weight w (default 1) is '
        "the per-epoch multiplier of that file's samples: each epoch draws round(w x n) of its "
        "n samples (w < 1 a seeded subset, w > 1 whole copies plus a seeded remainder)",
        required=True, files="weighted"))
    eval: str | list | None = field(default=None, metadata=_key(
        "held-out data: a JSONL or JSON-array file or a list of them (not weighted; optional)",
        files="plain"))
    image_root: str | None = field(default=None, metadata=_key(
        "directory that relative image and video paths of the data are relative to (null: each "
        "data file's own directory); absolute paths are used as they are"))
    max_seq_len: int = field(default=4096, metadata=_key(
        "tokens per packed micro-batch (one pack of whole samples)", min=2))
    shuffle: bool = field(default=False, metadata=_key(
        "shuffle samples (seeded by train.seed and the epoch) before packing each epoch"))
    truncate: bool = field(default=False, metadata=_key(
        "cut samples longer than max_seq_len instead of failing on them"))
    chat_template_kwargs: dict = field(default_factory=dict, metadata=_key(
        "extra keyword arguments (template variables) of every apply_chat_template call that "
        "renders a sample, e.g. {\"enable_thinking\": false}"))
    empty_think: str = field(default="target", metadata=_key(
        "an empty <think>\\n\\n</think>\\n\\n the chat template renders at the start of a reply "
        "(Qwen3.5: the last one): a target (as rendered; teaches answering without thinking), or "
        "part of the prompt (as the enable_thinking=false generation prompt has it)",
        choices=["target", "prompt"]))
    num_workers: int = field(default=2, metadata=_key(
        "DataLoader worker processes per rank that read, decode and patchify the next packs; "
        "0 loads them in the training process", min=0))
    prefetch_factor: int = field(default=2, metadata=_key(
        "packs each data loader worker keeps ready ahead of training", min=1))
    cache_dir: str | None = field(default=None, metadata=_key(
        "directory of the cached length index of data.train, relative to the current directory "
        "(null: $XDG_CACHE_HOME/vlmcp/index, else ~/.cache/vlmcp/index)"))
    video: VideoSection = field(default_factory=VideoSection, metadata=_key(
        "video sampling and pixel bounds over the checkpoint's video_preprocessor_config.json"))


@dataclass
class ParallelSection:
    sp_size: int = field(default=1, metadata=_key(
        "sequence-parallel group size P; the world size must be a multiple of P", min=1))
    deltanet_cp: str = field(default="state", metadata=_key(
        "how Gated DeltaNet layers run under SP: pass the recurrent state between ranks, or "
        "all-to-all to head groups", choices=["state", "heads"]))
    vision: str = field(default="split", metadata=_key(
        "where image features are computed under SP: split (each rank embeds only its shard and "
        "encodes a patch-balanced share of the images, features are routed to the ranks holding "
        "their placeholders) or replicated (every rank embeds the whole pack and encodes every "
        "image)", choices=["split", "replicated"]))


@dataclass
class OptimizerSection:
    type: str = field(default="adamw", metadata=_key(
        "torch optimizer (torch.optim.AdamW or torch.optim.SGD)", choices=["adamw", "sgd"]))
    lr: float = field(default=1e-4, metadata=_key("peak learning rate", min=0.0))
    weight_decay: float = field(default=0.0, metadata=_key("decoupled weight decay", min=0.0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata=_key(
        "AdamW betas [beta1, beta2]", length=2))
    eps: float = field(default=1e-8, metadata=_key("AdamW epsilon", min=0.0))
    momentum: float = field(default=0.0, metadata=_key("SGD momentum", min=0.0))


@dataclass
class SchedulerSection:
    type: str = field(default="constant", metadata=_key(
        "learning-rate schedule after warmup", choices=["constant", "cosine"]))
    warmup_steps: int = field(default=0, metadata=_key("linear warmup steps from 0", min=0))
    min_lr_ratio: float = field(default=0.0, metadata=_key(
        "cosine floor as a fraction of optimizer.lr", min=0.0, max=1.0))


@dataclass
class TrainSection:
    max_steps: int = field(default=100, metadata=_key("optimizer steps to train", min=1))
    seed: int = field(default=0, metadata=_key("seed of the python/numpy/torch RNGs and of "
                                               "data shuffling"))
    grad_clip: float = field(default=1.0, metadata=_key(
        "global gradient-norm clip; 0 disables it", min=0.0))
    grad_accum: int = field(default=1, metadata=_key(
        "micro-batches (packs) per optimizer step on each data-parallel rank", min=1))
    save_every: int = field(default=0, metadata=_key(
        "DeepSpeed checkpoint every N steps into output_dir/checkpoints; 0 never", min=0))
    eval_every: int = field(default=0, metadata=_key(
        "evaluate on data.eval every N steps (and after the last step); 0 never", min=0))
    resume: bool = field(default=False, metadata=_key(
        "continue from the latest checkpoint in output_dir/checkpoints"))
    log_every: int = field(default=1, metadata=_key("write a metrics row every N steps", min=1))
    gradient_checkpointing: bool = field(default=False, metadata=_key(
        "recompute each decoder layer in backward (its SP collectives too) instead of keeping "
        "its activations"))
    keep_checkpoints: int = field(default=0, metadata=_key(
        "keep only the newest N complete checkpoints in output_dir/checkpoints; 0 keeps all",
        min=0))
    nonfinite: str = field(default="abort", metadata=_key(
        "a step whose loss or gradient norm is not finite: abort the run (keeping a checkpoint "
        "of the last finite state), or skip the step", choices=["abort", "skip"]))
    max_skipped_steps: int = field(default=10, metadata=_key(
        "with nonfinite 'skip': abort after this many non-finite steps in a row", min=1))
    collective_timeout_s: float = field(default=600.0, metadata=_key(
        "a rank whose training step, checkpoint or export does not finish within this many "
        "seconds (a hung collective, a frozen peer) logs where it waits and exits; the default "
        "process group times out 60 s later", min=1.0))
    loss_chunk_mb: float = field(default=256.0, metadata=_key(
        "memory budget (MiB) of one lm_head + cross-entropy chunk; its target rows are "
        "budget / (6 bytes x vocab) (12 bytes for a ZeRO-3-partitioned "
        "lm_head), so the loss transient does not grow with the vocabulary or the shard length", min=1.0))


@dataclass
class EvalSection:
    generate: bool = field(default=False, metadata=_key(
        "also measure accuracy by greedy generation on data.eval (exact match of the "
        "first target span)"))
    max_new_tokens: int = field(default=16, metadata=_key("generation length limit", min=1))
    max_samples: int | None = field(default=None, metadata=_key(
        "generation accuracy uses at most this many held-out samples (eval_loss uses all); "
        "null for all", min=1))


@dataclass
class LossSection:
    type: str = field(default="ce", metadata=_key(
        "training objective per target token: ce, weighted_ce (per-token loss_weights), "
        "policy_gradient (-A log pi, per-token advantages) or ppo_clip (clipped ratio against "
        "per-token old_logprobs, with advantages)",
        choices=["ce", "weighted_ce", "policy_gradient", "ppo_clip"]))
    normalize: str = field(default="token", metadata=_key(
        "token: divide by the step's global target count; sequence: mean over each sample's "
        "tokens, then over the step's samples", choices=["token", "sequence"]))
    clip_low: float = field(default=0.2, metadata=_key(
        "ppo_clip: the ratio is clipped below at 1 - clip_low", min=0.0, max=1.0))
    clip_high: float = field(default=0.2, metadata=_key(
        "ppo_clip: the ratio is clipped above at 1 + clip_high", min=0.0))
    kl_coef: float = field(default=0.0, metadata=_key(
        "ppo_clip: weight of the k3 KL penalty against per-token ref_logprobs; 0 disables it",
        min=0.0))


@dataclass
class LoraSection:
    r: int = field(default=0, metadata=_key(
        "LoRA rank; 0 trains full weights (LoRA off), > 0 trains PEFT LoRA adapters on the "
        "language model only (base weights, vision tower, embeddings and lm_head frozen)", min=0))
    alpha: float = field(default=16.0, metadata=_key(
        "LoRA scaling numerator (PEFT lora_alpha; the update is scaled by alpha / r)", min=0.0))
    dropout: float = field(default=0.0, metadata=_key(
        "dropout on the adapters' input", min=0.0, max=1.0))
    target_modules: list[str] | str = field(default="all-linear", metadata=_key(
        "Linear modules to adapt: names matched as PEFT does (full name, or its last dotted "
        "parts: q_proj, in_proj_qkv, mlp.down_proj, ...), or \"all-linear\" for every Linear "
        "of the decoder layers"))
    modules_to_save: list[str] = field(default_factory=list, metadata=_key(
        "leaf modules of the language model trained in full next to the adapters (norms, "
        "Linear layers; not embed_tokens or lm_head); not with ZeRO-3"))
    target_parameters: list[str] = field(default_factory=list, metadata=_key(
        "fused parameters to adapt (PEFT target_parameters): the routed experts' 3-D weights of "
        "a qwen3_5_moe model, mlp.experts.gate_up_proj and mlp.experts.down_proj, one LoRA pair "
        "per expert; needs lora.dropout 0"))


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection, metadata=_key("the checkpoint"))
    data: DataSection = field(default_factory=DataSection, metadata=_key("data and packing"))
    parallel: ParallelSection = field(default_factory=ParallelSection, metadata=_key(
        "sequence parallelism"))
    optimizer: OptimizerSection = field(default_factory=OptimizerSection, metadata=_key(
        "torch optimizer"))
    scheduler: SchedulerSection = field(default_factory=SchedulerSection, metadata=_key(
        "learning-rate schedule"))
    train: TrainSection = field(default_factory=TrainSection, metadata=_key("training loop"))
    eval: EvalSection = field(default_factory=EvalSection, metadata=_key("evaluation"))
    loss: LossSection = field(default_factory=LossSection, metadata=_key(
        "token-level training objective"))
    lora: LoraSection = field(default_factory=LoraSection, metadata=_key(
        "LoRA adapters (PEFT); off while lora.r is 0"))
    deepspeed: str | dict = field(default_factory=lambda: {"zero_optimization": {"stage": 0}},
                                  metadata=_key("DeepSpeed JSON path or inline dict"))
    output_dir: str = field(default="runs/job", metadata=_key(
        "where metrics.jsonl, checkpoints/ and final/ go"))
    #: Directory of the job file; relative input paths are looked up here first. Not a job key.
    job_dir: str = field(default=".", metadata={"internal": True})
    #: `--set deepspeed.*` overrides, applied to the DeepSpeed config once loaded. Not a job key.
    deepspeed_overrides: dict[str, Any] = field(default_factory=dict, metadata={"internal": True})
    #: Leaf key paths the job file or `--set` gave a value (the rest are defaults). Not a job key.
    explicit_keys: frozenset[str] = field(default_factory=frozenset, metadata={"internal": True})
    #: Job key path -> where a launcher-given value came from (vlmcp/launch_env.py). Not a job key.
    key_sources: dict[str, str] = field(default_factory=dict, metadata={"internal": True})
    #: DeepSpeed key path -> (value, source) the launcher sets (vlmcp/launch_env.py). Not a job key.
    launcher_deepspeed: dict[str, tuple[Any, str]] = field(default_factory=dict,
                                                           metadata={"internal": True})
    #: Build the model under ZeRO-3 partitioned (deepspeed.zero.Init); None: the default (yes).
    #: Set from accelerate's zero3_init_flag. Not a job key.
    zero3_init: bool | None = field(default=None, metadata={"internal": True})

    def shown_key(self, key: str, value: Any) -> str:
        """Job key `key` with its value as a message names it: ``key=value``, plus the launcher
        setting it came from, if any."""
        source = self.key_sources.get(key)
        return f"{key}={json.dumps(value)}" + (f" (from {source})" if source else "")

    def resolve_input(self, path: str) -> Path:
        """An input path as the job means it: absolute, else next to the job file, else cwd."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        beside_job = Path(self.job_dir) / p
        if beside_job.exists() or not p.exists():
            return beside_job
        return p.resolve()

    def to_dict(self) -> dict[str, Any]:
        """The job as plain JSON data (internal fields left out)."""
        return _to_dict(self)


def _to_dict(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in fields(obj)
                if not f.metadata.get("internal")}
    return obj


def schema_fields(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key path, default, help) for every leaf key of the schema, for docs and --help."""
    rows: list[tuple[str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f"{prefix}{f.name}"
        if is_dataclass(hints[f.name]):
            rows.extend(schema_fields(hints[f.name], key + "."))
        else:
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
            rows.append((key, default, f.metadata.get("help", "")))
    return rows


# --------------------------------------------------------------------------- parsing


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
        return ok, float(value) if ok else value
    if tp is str or tp is dict:
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


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
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
            values[f.name] = _build(tp, raw.get(f.name, {}), key + ".", problems)
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


def _cross_checks(job: JobConfig) -> list[str]:
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
    if job.loss.kl_coef > 0 and job.loss.type != "ppo_clip":
        problems.append(f"config key 'loss.kl_coef' is {job.loss.kl_coef} but 'loss.type' is "
                        f"{job.loss.type!r}; the KL penalty applies to ppo_clip only")
    problems.extend(_lora_checks(job.lora, job.model))
    problems.extend(_video_checks(job.data.video))
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


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.path=value``; the value is JSON when it parses, else a plain string."""
    if "=" not in text:
        raise ConfigError([f"--set {text!r}: expected key.path=value"])
    key, raw_value = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError([f"--set {text!r}: bad key path {key!r}"])
    try:
        value = json.loads(raw_value)
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

    With `environ`, the settings a launcher exported (accelerate's, see vlmcp/launch_env.py)
    apply on top of the job's defaults; a value the job sets that disagrees is an error.
    """
    problems: list[str] = []
    job = _build(JobConfig, raw, "", problems)
    if not problems:
        problems.extend(_cross_checks(job))
    if problems:
        raise ConfigError(problems)
    job.job_dir = str(job_dir)
    job.deepspeed_overrides = dict(deepspeed_overrides or {})
    job.explicit_keys = frozenset(_leaf_keys(raw))
    if environ is not None:
        from vlmcp.launch_env import apply_launch_env

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
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"]) from exc
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: a job must be a JSON object"])
    deepspeed_overrides = apply_overrides(raw, overrides or [])
    return job_from_dict(raw, path.resolve().parent, deepspeed_overrides, environ)
