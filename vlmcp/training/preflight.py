"""Every check a job must pass before training: `vlmcp validate`, and the start of every rank.

One line per problem, each naming what to fix (a config key, or a "file:line" / "file[index]" of
the data). Checked: the job schema (by `load_job`, before this), the checkpoint directory and its
processor, the sequence-parallel constraints of the model for the world size, the DeepSpeed config,
every record of every file of data.train and data.eval (files, images, placeholder counts,
lengths, targets; each weighted file contributing at least one sample per epoch), that a resume
has a complete checkpoint to resume from, and that output_dir is writable.
Every training sample must carry the per-token arrays `loss.type` needs.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from vlmcp.config import ConfigError, JobConfig, JobError
from vlmcp.data.dataset import iter_samples
from vlmcp.data.formats import DataError, Sample
from vlmcp.data.mixture import draws_per_epoch
from vlmcp.data.processor import ProcessorError, VLProcessor, load_processor
from vlmcp.data.sources import DataFile, data_files
from vlmcp.model.load import ModelLoadError, load_config, text_hidden_size
from vlmcp.model.lora import lora_problems
from vlmcp.model.router_loss import router_config_problem
from vlmcp.parallel import comm
from vlmcp.parallel.constraints import check_sp_constraints
from vlmcp.parallel.zero3_sp import largest_tensor_numel, sp_exact_zero_settings
from vlmcp.training.checkpoint import checkpoint_dir, checkpoint_tags, latest_tag, newest_complete
from vlmcp.training.ds_config import fill_deepspeed_config, load_deepspeed_config, zero_stage
from vlmcp.training.objective_step import objective_problems


logger = logging.getLogger(__name__)


class PreflightError(JobError):
    """The job, its model or its data cannot train; one line per problem."""


@dataclass
class Preflight:
    """What the checks found and built, reused by training so nothing is parsed twice."""

    problems: list[str] = field(default_factory=list)
    model_config: PretrainedConfig | None = None
    processor: VLProcessor | None = None
    ds_config: dict[str, Any] | None = None
    train_samples: list[Sample] = field(default_factory=list)
    #: Samples of each data.train file (train_samples holds them concatenated in file order).
    train_file_sizes: list[int] = field(default_factory=list)
    #: Weight of each data.train file (`vlmcp.data.mixture`).
    train_weights: list[float] = field(default_factory=list)
    eval_samples: list[Sample] = field(default_factory=list)


def _where(job: JobConfig, path: str) -> str:
    """Where a missing input was looked for."""
    if Path(path).is_absolute():
        return path
    return f"{path!r} (looked in {job.job_dir} and in {Path.cwd()})"


def _read_files(job: JobConfig, files: list[DataFile], processor: VLProcessor,
                image_root: Path | None, report: Preflight) -> tuple[list[Sample], list[int]]:
    """The samples of every file, concatenated in file order, and each file's sample count."""
    samples: list[Sample] = []
    counts: list[int] = []
    for data_file in files:
        resolved = job.resolve_input(data_file.path)
        if not resolved.is_file():
            report.problems.append(f"config key '{data_file.key}': file not found: "
                                   f"{_where(job, data_file.path)}")
            counts.append(0)
            continue
        before = len(samples)
        for item in iter_samples(resolved, processor, job.data.max_seq_len, job.data.truncate,
                                 image_root):
            if isinstance(item, DataError):
                report.problems.append(str(item))
            else:
                samples.append(item)
        counts.append(len(samples) - before)
    return samples, counts


def _check_mixture(files: list[DataFile], counts: list[int], report: Preflight) -> None:
    """Every weighted file must contribute at least one sample per epoch."""
    for data_file, n, k in zip(files, counts, draws_per_epoch(counts, [f.weight for f in files])):
        if n and not k:
            report.problems.append(f"config key '{data_file.key}.weight': {data_file.weight:g} x "
                                   f"{n} samples rounds to 0 samples per epoch")


def _read_data(job: JobConfig, processor: VLProcessor, report: Preflight) -> None:
    """Read every file of data.train and data.eval into `report` (samples, problems)."""
    image_root = None
    if job.data.image_root is not None:
        image_root = job.resolve_input(job.data.image_root)
        if not image_root.is_dir():  # one line, not one "image not found" per record
            report.problems.append(f"config key 'data.image_root': directory not found: "
                                   f"{_where(job, job.data.image_root)}")
            return
    train_files = data_files(job.data.train, "data.train")
    report.train_samples, report.train_file_sizes = _read_files(job, train_files, processor,
                                                                image_root, report)
    report.train_weights = [f.weight for f in train_files]
    _check_mixture(train_files, report.train_file_sizes, report)
    if job.data.eval:
        eval_files = data_files(job.data.eval, "data.eval", weighted=False)
        report.eval_samples, _ = _read_files(job, eval_files, processor, image_root, report)


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
    if job.model.router_aux_loss:
        problem = router_config_problem(report.model_config.get_text_config())
        if problem:
            report.problems.append(problem)
    try:
        report.processor = load_processor(model_dir, job.data.chat_template_kwargs,
                                          job.data.empty_think)
    except (ProcessorError, OSError, ValueError) as exc:
        report.problems.append(f"config key 'model.path': {exc}")


def _check_deepspeed(job: JobConfig, world_size: int, report: Preflight) -> None:
    if report.model_config is None or world_size % job.parallel.sp_size:
        return
    try:
        raw = load_deepspeed_config(job)
        filled = fill_deepspeed_config(
            raw, job, dp_size=world_size // job.parallel.sp_size,
            hidden_size=text_hidden_size(report.model_config))
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


def _check_resume(job: JobConfig, report: Preflight) -> None:
    directory = checkpoint_dir(job)
    if job.train.resume:
        tag, skipped = newest_complete(directory)
        if tag is None:
            report.problems.append(f"config key 'train.resume' is true but {directory} holds no "
                                   "complete checkpoint")
            report.problems.extend(f"config key 'train.resume': incomplete checkpoint: {reason}"
                                   for reason in skipped)
        for reason in skipped if tag is not None and comm.rank() == 0 else []:
            logger.warning("train.resume: will resume from %s, skipping an incomplete "
                           "checkpoint: %s", directory / tag, reason)
        return
    tags = checkpoint_tags(directory)
    latest = latest_tag(directory) or (tags[0][1] if tags else None)
    if latest is not None:
        report.problems.append(f"config key 'output_dir': {job.output_dir} already holds the "
                               f"checkpoints of an earlier run (latest: {latest}); set "
                               "train.resume=true to continue it, or choose another output_dir")


def _check_output_dir(job: JobConfig, report: Preflight) -> None:
    """output_dir, or the nearest directory above it that exists, accepts a new file (a probe
    file, removed again; nothing is created for a directory that does not exist yet)."""
    out = Path(job.output_dir).absolute()
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
        report.problems.append(f"config key 'output_dir': cannot write to {out}: "
                               f"{exc.strerror or exc}")


def run_preflight(job: JobConfig, world_size: int, training: bool = True) -> Preflight:
    """Run every check of `job` for a world of `world_size` ranks and load its data.

    `training` False (`vlmcp score`): no checkpoint-resume check and no check of the per-token
    arrays `loss.type` needs."""
    report = Preflight()
    _check_model(job, world_size, report)
    _check_deepspeed(job, world_size, report)
    _check_lora(job, report)
    _check_output_dir(job, report)
    if training:
        _check_resume(job, report)
    if report.processor is not None:
        _read_data(job, report.processor, report)
    if training:
        report.problems.extend(objective_problems(job, report.train_samples))
    return report
