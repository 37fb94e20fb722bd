"""Every check a job must pass before training: `vlmcp validate`, and the start of every rank.

One line per problem, each naming what to fix (a config key, or a "file:line" / "file[index]" of the
data). Checked: the job schema (by `load_job`, before this), the checkpoint directory and its
processor, the sequence-parallel constraints of the model for the world size, the DeepSpeed config,
every record of every file of data.train and data.eval (files, images, videos, placeholder counts,
lengths, targets; each weighted file contributing at least one sample per epoch), that a resume has
a complete checkpoint to resume from, and that output_dir is writable.

data.train and data.eval become length indexes (`vlmcp.data.index`), not samples in memory.
`vlmcp validate` (`decode_images=True`) decodes every image and every sampled video frame once and
rebuilds the cached indexes.
A training rank that builds indexes (`index_role="build"`) loads the cached indexes or builds
them from image headers; the others (`"skip"`) load them afterwards with `load_train_index` and
`load_eval_index`.
Every training sample must fit the loss (read from the index): carry the per-token arrays its
objectives need, be a preference pair exactly when the loss is a preference objective, and carry
reference sums when dpo or ipo has them from nowhere else; a `loss.reference_logps` score file
must match data.train.

A rollout job (`rollouts.dir`) has no data.train to index: each rollout step is indexed and
checked when training reaches it (`vlmcp.training.steps.rollout_steps`); here only the rollout and
publish directories are checked.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PretrainedConfig

from vlmcp.config import JobConfig
from vlmcp.data.batch import TOKEN_ARRAYS
from vlmcp.data.index import LengthIndex
from vlmcp.data.index_cache import IndexResult, default_cache_dir, obtain_index
from vlmcp.data.mixture import draws_per_epoch
from vlmcp.data.processor import VLProcessor, load_processor
from vlmcp.data.rollouts import PUBLISHED_BY, written_by_publish
from vlmcp.data.sources import DataFile, data_files
from vlmcp.device import compute_device
from vlmcp.engine.weight_push_http import VllmPushControl
from vlmcp.errors import ConfigError, EngineError, KernelError, ModelLoadError, ProcessorError
from vlmcp.model.deltanet_kernel import resolve_kernel
from vlmcp.model.load import load_config, text_hidden_size
from vlmcp.model.lora import lora_problems
from vlmcp.model.router_loss import router_config_problem
from vlmcp.parallel import comm
from vlmcp.parallel.constraints import check_ep_constraints, check_sp_constraints
from vlmcp.training.ds.zero3_sp import largest_tensor_numel, sp_exact_zero_settings
from vlmcp.training.checkpoint import (checkpoint_dir, checkpoint_tags, latest_tag,
                                      newest_complete, read_manifest)
from vlmcp.training.ds.blocks import offloads_optimizer
from vlmcp.training.ds.config import fill_deepspeed_config, load_deepspeed_config, zero_stage
from vlmcp.training.ds.edits import DeepSpeedEdits
from vlmcp.training.layout import ResumePlan, data_of, data_position_problems, plan_resume
from vlmcp.training.objective_step import objective_problems, token_array_names
from vlmcp.training.reference import reference_problems
from vlmcp.training.weights.publish import step_dirs


logger = logging.getLogger(__name__)


@dataclass
class Preflight:
    """What the checks found and built, reused by training so nothing is parsed twice."""

    problems: list[str] = field(default_factory=list)
    model_config: PretrainedConfig | None = None
    processor: VLProcessor | None = None
    ds_config: dict[str, Any] | None = None
    train_index: LengthIndex | None = None
    train_index_result: IndexResult | None = None
    #: Samples of each data.train file (the index holds them in file order).
    train_file_sizes: list[int] = field(default_factory=list)
    #: Weight of each data.train file (`vlmcp.data.mixture`).
    train_weights: list[float] = field(default_factory=list)
    eval_index: LengthIndex | None = None
    #: [N, 2] the pairs' reference sums from a `loss.reference_logps` score file (None: from
    #: the data, or scored with the initial policy when the run starts).
    reference_logps: np.ndarray | None = None
    #: With train.resume: how this run loads the newest complete checkpoint (training/layout.py).
    resume: ResumePlan | None = None


def _where(job: JobConfig, path: str) -> str:
    """Where a missing input was looked for."""
    if Path(path).is_absolute():
        return path
    return f"{path!r} (looked in {job.job_dir} and in {Path.cwd()})"


def _image_root(job: JobConfig) -> Path | None:
    """data.image_root resolved (None: unset)."""
    return None if job.data.image_root is None else job.resolve_input(job.data.image_root)


def _check_image_root(job: JobConfig, report: Preflight) -> bool:
    """Whether data.image_root is unset or a directory (else a problem)."""
    root = _image_root(job)
    if root is not None and not root.is_dir():
        report.problems.append(f"config key 'data.image_root': directory not found: "
                               f"{_where(job, job.data.image_root)}")
        return False
    return True


def _missing_files(job: JobConfig, files: list[DataFile]) -> list[str]:
    """One problem per file of `files` that does not exist."""
    return [f"config key '{f.key}': file not found: {_where(job, f.path)}" for f in files
            if not job.resolve_input(f.path).is_file()]


def _check_mixture(files: list[DataFile], counts: list[int], report: Preflight) -> None:
    """Every weighted file must contribute at least one sample per epoch."""
    for data_file, n, k in zip(files, counts, draws_per_epoch(counts, [f.weight for f in files])):
        if n and not k:
            report.problems.append(f"config key '{data_file.key}.weight': {data_file.weight:g} x "
                                   f"{n} samples rounds to 0 samples per epoch")


def _check_model(job: JobConfig, world_size: int, report: Preflight) -> None:
    model_dir = job.resolve_input(job.model.path)
    if not model_dir.is_dir():
        report.problems.append(f"config key 'model.path': directory not found: "
                               f"{_where(job, job.model.path)}")
        return
    try:
        report.model_config = load_config(model_dir)
    except (ModelLoadError, OSError, ValueError) as exc:
        report.problems.append(str(exc) if isinstance(exc, ModelLoadError)
                               else f"config key 'model.path': {exc}")
        return
    report.problems.extend(check_sp_constraints(
        report.model_config.get_text_config(), sp_size=job.parallel.sp_size,
        world_size=world_size, deltanet_cp=job.parallel.deltanet_cp))
    report.problems.extend(check_ep_constraints(
        report.model_config.get_text_config(), ep_size=job.parallel.ep_size,
        world_size=world_size))
    try:
        resolve_kernel(job.model.deltanet_kernel, compute_device())
    except KernelError as exc:
        report.problems.append(f"config key 'model.deltanet_kernel': {exc}")
    if job.model.router_aux_loss:
        problem = router_config_problem(report.model_config.get_text_config())
        if problem:
            report.problems.append(problem)
    try:
        report.processor = load_processor(model_dir, job.data.chat_template_kwargs,
                                          job.data.empty_think, asdict(job.data.video))
    except (ProcessorError, OSError, ValueError) as exc:
        report.problems.append(f"config key 'model.path': {exc}")


def _check_deepspeed(job: JobConfig, world_size: int, report: Preflight) -> None:
    if report.model_config is None or world_size % job.parallel.sp_size:
        return
    try:
        raw = load_deepspeed_config(job)
        filled = fill_deepspeed_config(
            raw, job, dp_size=world_size // job.parallel.sp_size,
            hidden_size=text_hidden_size(report.model_config),
            moe_top_k=getattr(report.model_config.get_text_config(), "num_experts_per_tok", 0) or 0)
    except ConfigError as exc:
        report.problems.extend(exc.problems)
        return
    model_dir = str(job.resolve_input(job.model.path))
    report.ds_config = sp_exact_zero_settings(filled, job.parallel.sp_size,
                                              largest_tensor_numel(model_dir))


def _check_lora(job: JobConfig, report: Preflight) -> None:
    """The `lora` module names against the model (built on the meta device)."""
    if not job.lora.r or report.model_config is None:
        return
    report.problems.extend(lora_problems(report.model_config, job.lora))
    if job.lora.modules_to_save and report.ds_config and zero_stage(report.ds_config) == 3:
        report.problems.append("config key 'lora.modules_to_save' is not supported with ZeRO-3 "
                               "(PEFT copies the partitioned modules); use ZeRO 0-2 or train "
                               "adapters only")


def _check_resume(job: JobConfig, world_size: int, report: Preflight) -> None:
    """train.resume: a complete checkpoint, and how this layout resumes it (training/layout.py:
    `report.resume`; its problems and, once the index is there, `_check_resume_data`'s). A resume
    through the universal checkpoint sets the DeepSpeed config's `checkpoint.load_universal`.
    A fresh run refuses an output_dir that holds checkpoints."""
    directory = checkpoint_dir(job)
    if job.train.resume:
        tag, skipped = newest_complete(directory)
        if tag is None:
            report.problems.append(f"config key 'train.resume' is true but {directory} holds no "
                                   "complete checkpoint")
            report.problems.extend(f"config key 'train.resume': incomplete checkpoint: {reason}"
                                   for reason in skipped)
            return
        for reason in skipped if comm.rank() == 0 else []:
            logger.warning("train.resume: will resume from %s, skipping an incomplete "
                           "checkpoint: %s", directory / tag, reason)
        if report.ds_config is None:
            return
        report.resume = plan_resume(directory / tag, read_manifest(directory / tag), job,
                                    world_size, report.ds_config)
        report.problems.extend(report.resume.problems)
        loads = ("the universal checkpoint of" if report.resume.universal
                 else "DeepSpeed's own files of")
        DeepSpeedEdits().set(report.ds_config, "checkpoint.load_universal",
                             report.resume.universal, f"train.resume loads {loads} {directory / tag}")
        return
    tags = checkpoint_tags(directory)
    latest = latest_tag(directory) or (tags[0][1] if tags else None)
    if latest is not None:
        report.problems.append(f"config key 'output_dir': {job.output_dir} already holds the "
                               f"checkpoints of an earlier run (latest: {latest}); set "
                               "train.resume=true to continue it, or choose another output_dir")


def _check_resume_data(job: JobConfig, world_size: int, report: Preflight) -> None:
    """A resume's data position against the checkpoint's (training/layout.py
    `data_position_problems`), once data.train's index is loaded (a rollout job: at once)."""
    plan = report.resume
    if plan is None or not (job.rollouts.dir or report.train_index is not None):
        return
    index = report.train_index
    now = data_of(job, world_size, None if index is None else index.tokens,
                  report.train_file_sizes, report.train_weights)
    problems, notes = data_position_problems(plan, now, world_size // job.parallel.sp_size)
    report.problems.extend(problems)
    plan.notes.extend(notes)


def _check_publish_dir(job: JobConfig, report: Preflight) -> None:
    """publish.dir of a training run: a fresh run refuses one that holds steps (an earlier run's
    published weights, or another's step directories), as it refuses an earlier run's output_dir;
    a resume refuses step directories vlmcp's publish did not write (it sets aside its own
    steps beyond the checkpoint itself, training/weights/publish.py). Warns on publish.keep 1."""
    root = Path(job.publish.dir).absolute()
    steps = step_dirs(root)
    foreign = sorted(n for n, path in steps.items() if not written_by_publish(path))
    if foreign:
        report.problems.append(
            f"config key 'publish.dir': {root} holds step directories that vlmcp's publish did "
            f"not write (step_{foreign[0]}{', ...' if len(foreign) > 1 else ''}: no STABLE naming "
            f"{PUBLISHED_BY!r}); is it a rollouts.dir? choose an empty or new publish.dir")
    elif steps and not job.train.resume:
        report.problems.append(
            f"config key 'publish.dir': {root} already holds the published weights of an "
            f"earlier run (newest: step_{max(steps)}); set train.resume=true to continue it, or "
            "choose another publish.dir (or empty it)")
    if job.publish.keep == 1 and comm.rank() == 0:
        logger.warning("publish.keep=1: each publish deletes the previous step, which an engine "
                       "may still be loading; keep at least 2 (enough steps to cover the "
                       "engine's load time, docs/rl-loop.md)")


#: The longest look at one engine before training (publish.engine_timeout_s when shorter).
ENGINE_PROBE_S = 30.0


def _check_engines(job: JobConfig, report: Preflight) -> None:
    """Every engine of publish.engines answers now (its workers counted). One that does not is a
    problem naming it, or under publish.on_engine_error "warn" a warning: the run then pushes
    into the others and tries it again at every push."""
    for url in job.publish.engines:
        try:
            VllmPushControl(url, timeout_s=min(ENGINE_PROBE_S, job.publish.engine_timeout_s)
                            ).probe()
        except EngineError as exc:
            if job.publish.on_engine_error == "error":
                report.problems.append(f"config key 'publish.engines': {exc}")
            elif comm.rank() == 0:
                logger.warning("publish.engines: %s; training on and pushing into it at every "
                               "push (publish.on_engine_error=\"warn\")", exc)


def _check_writable(key: str, directory: str, report: Preflight) -> None:
    """`directory`, or the nearest directory above it that exists, accepts a new file (a probe
    file, removed again; nothing is created for a directory that does not exist yet)."""
    out = Path(directory).absolute()
    base = out
    while not base.exists():
        base = base.parent
    try:
        if not base.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{base} is not a directory")
        handle, probe = tempfile.mkstemp(prefix=".vlmcp-write-test-", dir=base)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        report.problems.append(f"config key '{key}': cannot write to {out}: "
                               f"{exc.strerror or exc}")


def _check_rollouts(job: JobConfig, report: Preflight) -> None:
    """A rollout job: rollouts.dir instead of data.train, and the directories it names."""
    rollouts = job.rollouts.dir
    if job.data.train:
        report.problems.append("config key 'data.train' is set but 'rollouts.dir' is too: a "
                               "rollout job trains step N on rollouts.dir/step_N only (vlmcp "
                               "score reads data.train; unset it for training)")
    if Path(rollouts).exists() and not Path(rollouts).is_dir():
        report.problems.append(f"config key 'rollouts.dir': {Path(rollouts).absolute()} is not a "
                               "directory")
    config = report.ds_config
    if config is not None and zero_stage(config) in (1, 2) and offloads_optimizer(config):
        # DeepSpeed 0.19's ZeRO-1/2 offload takes a gradient-norm shortcut when its configured
        # gradient_accumulation_steps is 1 (train.grad_accum with rollouts) and would clip by the
        # last micro-batch's norm; a rollout step runs as many micro-batches as it packs into.
        report.problems.append("config key 'rollouts.dir': a rollout job cannot run ZeRO-1/2 with "
                               "offload_optimizer (the gradient norm of a step of several "
                               "micro-batches would be wrong); use ZeRO-3, or no optimizer offload")
    if job.data.shuffle and comm.rank() == 0:
        logger.warning("data.shuffle does not apply to rollout steps: a step's gradient is the "
                       "same in any sample order")


def index_settings(job: JobConfig) -> dict[str, Any]:
    """The job settings besides the processor (whose fingerprint covers data.chat_template_kwargs
    and data.empty_think) that change the index: part of its cache key. "weight_arrays": the
    loss terms' own per-token weight arrays, read besides `TOKEN_ARRAYS`."""
    extra = token_array_names(job)[len(TOKEN_ARRAYS):]
    return {"max_seq_len": job.data.max_seq_len, "truncate": job.data.truncate,
            "weight_arrays": list(extra)}


def _index_files(job: JobConfig, report: Preflight, files: list[DataFile], *, may_build: bool,
                 rebuild: bool) -> tuple[IndexResult | None, list[int]]:
    """The length index of those of `files` that exist (None when none does), and their positions
    in `files`; the data's problems, then the missing files, are added to report.problems."""
    paths = [job.resolve_input(f.path) for f in files]
    present = [i for i, path in enumerate(paths) if path.is_file()]
    result = None
    if present:
        cache_dir = Path(job.data.cache_dir) if job.data.cache_dir else default_cache_dir()
        result = obtain_index([paths[i] for i in present], report.processor, index_settings(job),
                              cache_dir, image_root=_image_root(job), may_build=may_build,
                              rebuild=rebuild)
        report.problems.extend(result.problems)
    report.problems.extend(_missing_files(job, files))
    return result, present


def load_train_index(job: JobConfig, report: Preflight, *, may_build: bool,
                     rebuild: bool = False, training: bool = True) -> None:
    """Set report.train_index (and train_file_sizes, train_weights) from the cache, building it
    when `may_build`; problems are added to report.problems (the data's, then missing files,
    then mixture weights that draw nothing, then, when `training`, samples without the per-token
    arrays `loss.type` needs)."""
    if report.processor is None or (training and job.rollouts.dir):
        return
    files = data_files(job.data.train, "data.train")
    result, present = _index_files(job, report, files, may_build=may_build, rebuild=rebuild)
    report.train_index_result = result
    if result is None or result.index is None:
        return
    sizes = [0] * len(files)
    for i, size in zip(present, result.index.file_sizes()):
        sizes[i] = size
    report.train_file_sizes = sizes
    report.train_weights = [f.weight for f in files]
    _check_mixture(files, sizes, report)
    if len(present) == len(files) and not result.problems:
        report.train_index = result.index
    if training:
        report.problems.extend(objective_problems(job, result.index))
        report.reference_logps, problems = reference_problems(job, result.index)
        report.problems.extend(problems)


def load_eval_index(job: JobConfig, report: Preflight, *, may_build: bool,
                    rebuild: bool = False) -> None:
    """Set report.eval_index, the length index of data.eval (evaluation loads its packs and
    generation prompts from it when it runs), like `load_train_index`."""
    if report.processor is None or not job.data.eval:
        return
    files = data_files(job.data.eval, "data.eval", weighted=False)
    result, present = _index_files(job, report, files, may_build=may_build, rebuild=rebuild)
    if result is not None and result.index is not None and len(present) == len(files) \
            and not result.problems:
        report.eval_index = result.index


def run_preflight(job: JobConfig, world_size: int, *, index_role: str = "build",
                  decode_images: bool = False, training: bool = True) -> Preflight:
    """Run every check of `job` for a world of `world_size` ranks and index its data.

    index_role: "build" (load the cached length indexes, or build them) or "skip" (leave them to
    `load_train_index` and `load_eval_index`). decode_images: decode every image once and rebuild
    the index (validation). training False (`vlmcp score`): no checkpoint-resume check and no
    check of the per-token arrays `loss.type` needs.
    """
    report = Preflight()
    _check_model(job, world_size, report)
    _check_deepspeed(job, world_size, report)
    _check_lora(job, report)
    _check_writable("output_dir", job.output_dir, report)
    if job.publish.dir:
        _check_writable("publish.dir", job.publish.dir, report)
    if training:
        _check_resume(job, world_size, report)
        if job.publish.dir:
            _check_publish_dir(job, report)
        if job.publish.engines:
            _check_engines(job, report)
        if job.rollouts.dir:
            _check_rollouts(job, report)
    if report.processor is not None and _check_image_root(job, report) and index_role != "skip":
        load_train_index(job, report, may_build=True, rebuild=decode_images, training=training)
        if training:
            load_eval_index(job, report, may_build=True, rebuild=decode_images)
    if training:
        _check_resume_data(job, world_size, report)
    return report
