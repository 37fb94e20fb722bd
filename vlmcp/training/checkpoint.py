"""DeepSpeed checkpoints of a run, written atomically, with a manifest that proves completeness.

    OUTPUT_DIR/checkpoints/
        step4/               a complete checkpoint: DeepSpeed's files + manifest.json (last)
        step6/
        latest               "step6", the newest complete tag (DeepSpeed's own format)
        .tmp-step8/          a save in progress, or one a crash interrupted: never read

Saving (`save_checkpoint`, every rank):
 1. rank 0 clears and creates `.tmp-step<N>`; all ranks agree it worked;
 2. every rank writes its DeepSpeed files there (model states, its optimizer partition);
    all ranks agree that every rank finished (this is the barrier);
 3. rank 0 writes manifest.json ({"step", "files": {relative path: bytes}}) last, renames the
    directory to `step<N>`, replaces `latest` (temporary file + os.replace), and removes
    checkpoints beyond `train.keep_checkpoints`; all ranks agree.
A failure on any rank leaves the previous checkpoints untouched, removes the temporary directory
and raises CheckpointError on every rank (a full disk says "no space left on ...").

A checkpoint is complete when manifest.json exists and every file it lists exists with its size.
Resume loads the newest complete one and logs each newer incomplete one it skips.

The client state records the completed step (the data position: the step packs are a pure
function of it) and how the training module's keys map to Hugging Face names (for
`vlmcp export`). Model, optimizer, LR scheduler and RNG-free data order restore exactly.
A LoRA run (`lora.r` > 0) leaves its frozen base weights out (they come from `model.path` again
on resume and export), so a checkpoint holds only the adapters and their optimizer state.

The manifest also records the run's layout, trained parameters and data position
(training/layout.py `checkpoint_record`), and every rank writes its RNG states
(`rng_state_<rank>.pt`: python, numpy, torch and the device's). A resume (`load_checkpoint`)
follows its `ResumePlan`: DeepSpeed's own files, or the universal checkpoint beside them at
another layout (training/weights/universal.py, converted by `prepare_resume` before the engine
is built); each rank restores its RNG states when the world size is the saved one (at another,
no rank's stream is the one it would have drawn: the RNGs stay seeded by train.seed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.device import use_cuda
from vlmcp.errors import CheckpointError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.training.ds.expert_lora_checkpoint import restore_expert_adapters, save_expert_adapters
from vlmcp.training.atomic import (dir_size, file_sizes, manifest_problem, remove_quietly,
                                   replace_dir, write_error, write_text_atomic)
from vlmcp.training.layout import ResumePlan
from vlmcp.training.weights.universal import AUTOEP, FUSED, UNIVERSAL, convert
from vlmcp.training.weights.universal import incomplete_reason as incomplete_conversion

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: Each rank's RNG states in a checkpoint.
RNG_FILE = "rng_state_{rank}.pt"
_TAG = re.compile(r"^step(\d+)$")


def checkpoint_dir(job: JobConfig) -> Path:
    """Where DeepSpeed checkpoints of the job go."""
    return Path(job.output_dir) / "checkpoints"


def latest_tag(directory: str | Path) -> str | None:
    """The tag the `latest` file names, or None when there is none."""
    latest = Path(directory) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def checkpoint_tags(directory: str | Path) -> list[tuple[int, str]]:
    """(step, tag) of every `step<N>` directory, newest first (complete or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p.name) for p in directory.iterdir()
             if p.is_dir() and (m := _TAG.match(p.name))]
    return sorted(found, reverse=True)


def incomplete_reason(tag_dir: Path) -> str | None:
    """Why `tag_dir` is not a complete checkpoint, or None when it is."""
    problem = manifest_problem(tag_dir, MANIFEST)
    if problem is not None and not (tag_dir / MANIFEST).is_file():
        return f"{tag_dir} has no {MANIFEST} (its save did not finish)"
    return problem


def newest_complete(directory: str | Path) -> tuple[str | None, list[str]]:
    """(the newest complete tag or None, why each newer checkpoint was skipped)."""
    skipped = []
    for _, tag in checkpoint_tags(directory):
        reason = incomplete_reason(Path(directory) / tag)
        if reason is None:
            return tag, skipped
        skipped.append(reason)
    return None, skipped


def read_manifest(tag_dir: Path) -> dict[str, Any]:
    """The manifest of the complete checkpoint `tag_dir`."""
    return json.loads((tag_dir / MANIFEST).read_text())


def _manifest_bytes(tag_dir: Path) -> int:
    return sum(read_manifest(tag_dir)["files"].values())


def _lines(problem: str | None) -> list[str]:
    return [problem] if problem else []


def _prepare(tmp: Path) -> None:
    """Rank 0: an empty temporary directory (a stale one from an interrupted save is removed)."""
    problem = None
    if comm.rank() == 0:
        try:
            remove_quietly(tmp)
            tmp.mkdir(parents=True)
        except OSError as exc:
            problem = write_error(exc, tmp)
    fail_together(_lines(problem), CheckpointError, what=f"creating {tmp}")


def _publish(tmp: Path, directory: Path, tag: str, step: int, keep: int,
             record: dict[str, Any]) -> None:
    """Rank 0: manifest last, rename into place, replace `latest`, prune old checkpoints."""
    write_text_atomic(tmp / MANIFEST, json.dumps(
        {"step": step, "ep_size": record["layout"]["ep_size"], **record,
         "files": file_sizes(tmp)}, indent=1))
    replace_dir(tmp, directory / tag)
    write_text_atomic(directory / "latest", tag)
    if keep:
        _prune(directory, keep)


def _prune(directory: Path, keep: int) -> None:
    """Remove checkpoints older than the newest `keep` complete ones."""
    complete = [step for step, tag in checkpoint_tags(directory)
                if incomplete_reason(directory / tag) is None]
    if len(complete) <= keep:
        return
    oldest_kept = complete[keep - 1]
    for step, tag in checkpoint_tags(directory):
        if step < oldest_kept:
            remove_quietly(directory / tag)
            logger.info("removed checkpoint %s (train.keep_checkpoints=%d)", directory / tag, keep)


def _rng_states() -> dict[str, Any]:
    """This process's RNG states: python's, numpy's, torch's and the CUDA device's."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "torch": torch.get_rng_state()}
    if use_cuda():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(plan: ResumePlan) -> None:
    """At the saved world size, this rank's RNG states as they were when the checkpoint was
    saved (call last before the first resumed step: whatever the start draws comes before);
    at another world size nothing (module docstring)."""
    path = plan.tag_dir / RNG_FILE.format(rank=comm.rank())
    if plan.saved["layout"]["world_size"] != comm.world_size() or not path.is_file():
        return
    states = torch.load(path, map_location="cpu", weights_only=False)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and use_cuda():
        torch.cuda.set_rng_state(states["cuda"])


@contextlib.contextmanager
def _lora_layout(engine: Any, job: JobConfig) -> Iterator[None]:
    """How DeepSpeed saves and loads the checkpoint of a LoRA job under expert parallelism at
    ZeRO 3: as a dense model's.

    DeepSpeed 0.19.8's MoE checkpoint at ZeRO 3 refuses frozen expert weights ("AutoEP with ZeRO
    Stage 3 checkpointing does not support frozen expert parameters yet"), and LoRA freezes
    AutoEP's w1/w2/w3. A LoRA checkpoint needs none of them (they come from model.path again).
    Saved as dense, every rank's ZeRO-3 files hold its partitions of every trained parameter,
    the experts' LoRA factors among them (each over its expert-data-parallel group), which a
    resume at the same layout loads as they are; vlmcp's own files hold the factors whole for a
    resume at another layout (training/ds/expert_lora_checkpoint.py). The engine's MoE flag is
    off only while it saves or loads."""
    if not (job.lora.r and job.parallel.ep_size > 1 and engine.zero_optimization_stage() == 3):
        yield
        return
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = True


def _agree_saved(problem: str | None, tmp: Path, path: Path) -> None:
    """Every rank: raise CheckpointError on every rank when any rank's part of the save of `path`
    failed (`problem`: this rank's), after rank 0 removed the partial `tmp`."""
    try:
        fail_together(_lines(problem), CheckpointError, what=f"saving checkpoint {path}")
    except CheckpointError:
        if comm.rank() == 0:
            remove_quietly(tmp)
        raise


def save_checkpoint(engine: Any, job: JobConfig, step: int, hf_key_prefixes: dict[str, str],
                    record: dict[str, Any]) -> Path:
    """Save the engine after `step` completed optimizer steps (call on every rank); `record`: the
    run's layout, trained parameters and data position for the manifest
    (training/layout.py `checkpoint_record`)."""
    directory = checkpoint_dir(job)
    tag = f"step{step}"
    tmp_tag = f".tmp-{tag}"
    tmp = directory / tmp_tag
    previous, _ = newest_complete(directory)
    needed = _manifest_bytes(directory / previous) if previous else None
    _prepare(tmp)
    problem = None
    try:
        with _lora_layout(engine, job):
            engine.save_checkpoint(str(directory), tag=tmp_tag, save_latest=False,
                                   client_state={"step": step, "hf_key_prefixes": hf_key_prefixes},
                                   exclude_frozen_parameters=bool(job.lora.r))
    except Exception as exc:  # any failure is agreed: the other ranks wait in the barrier below
        problem = f"saving checkpoint {directory / tag}: {write_error(exc, tmp, needed)}"
        # The others wait in the barrier that closes DeepSpeed's save; join it before agreeing.
        comm.barrier()
    _agree_saved(problem, tmp, directory / tag)  # raises wherever any rank failed
    try:
        # its collectives come before its writes: a write that fails is this rank's alone
        save_expert_adapters(engine, tmp, job.parallel.ep_size)
        torch.save(_rng_states(), tmp / RNG_FILE.format(rank=comm.rank()))
    except Exception as exc:
        problem = f"saving checkpoint {directory / tag}: {write_error(exc, tmp, needed)}"
    _agree_saved(problem, tmp, directory / tag)
    if comm.rank() == 0:
        try:
            _publish(tmp, directory, tag, step, job.train.keep_checkpoints, record)
        except OSError as exc:
            problem = f"saving checkpoint {directory / tag}: {write_error(exc, tmp, needed)}"
            remove_quietly(tmp)
    fail_together(_lines(problem), CheckpointError, what=f"publishing checkpoint {directory / tag}")
    if comm.rank() == 0:
        logger.info("saved checkpoint %s (%d bytes)", directory / tag, dir_size(directory / tag))
    return directory / tag


#: The slowest conversion rate the other ranks wait for (bytes of the checkpoint per second)
#: beyond train.collective_timeout_s: far below any disk's.
_SLOWEST_CONVERSION_BYTES_PER_S = 10e6


def _conversion_error(exc: Exception, out: Path, tag_dir: Path) -> str:
    """Why a conversion failed: a full disk as such (it needs about 3x the checkpoint's fp32
    weights), else the exception."""
    full = write_error(exc, out, _manifest_bytes(tag_dir))
    return full if full.startswith("no space left") else f"{type(exc).__name__}: {exc}"


def prepare_resume(plan: ResumePlan, job: JobConfig) -> None:
    """Before the engine is built, on every rank: rank 0 logs what the resume changes; at another
    layout it converts the checkpoint to DeepSpeed's universal one beside it (or reuses the
    conversion) while the others wait for it (train.collective_timeout_s plus 1 s per 10 MB of
    the checkpoint), and every rank checks that it sees the conversion whole. A failure on any
    rank raises CheckpointError on every rank."""
    if comm.rank() == 0:
        for note in plan.notes:
            logger.info("train.resume: %s", note)
    if not plan.universal:
        return
    out = plan.tag_dir / UNIVERSAL
    waited = job.train.collective_timeout_s + _manifest_bytes(plan.tag_dir) \
        / _SLOWEST_CONVERSION_BYTES_PER_S
    # made by every rank before rank 0 converts: a group's creation is itself a collective
    waiting = comm.new_world_gloo_group(waited)
    problems: list[str] = []
    if comm.rank() == 0:
        try:
            convert(plan.tag_dir, expert_form=AUTOEP if job.parallel.ep_size > 1 else FUSED)
        except Exception as exc:  # noqa: BLE001 - any failure is agreed: the others wait below
            logger.debug("the conversion's traceback", exc_info=True)
            problems = [f"train.resume: converting {plan.tag_dir} to DeepSpeed's universal "
                        f"checkpoint: {_conversion_error(exc, out, plan.tag_dir)}"]
    if waiting is not None:
        comm.barrier(waiting)
    fail_together(problems, CheckpointError, what=f"converting {plan.tag_dir}")
    reason = incomplete_conversion(plan.tag_dir)
    fail_together([f"train.resume: rank {comm.rank()} cannot read the universal checkpoint: "
                   f"{reason} (every rank must see output_dir/checkpoints)"] if reason else [],
                  CheckpointError, what=f"reading {out}")


def _per_group(scheduler_state: dict[str, Any], groups: int, tag_dir: Path) -> dict[str, Any]:
    """An LR scheduler's state for `groups` param groups: its per-group lists (`base_lrs`,
    `_last_lr`, ...) saved for another count (under EP the expert parameters have groups of
    their own) hold one value for every group of a vlmcp run, repeated to `groups`."""
    adapted = dict(scheduler_state)
    for key, value in scheduler_state.items():
        if isinstance(value, list) and value and len(value) != groups:
            if any(entry != value[0] for entry in value):
                raise CheckpointError([f"train.resume: the LR schedule of {tag_dir} has "
                                       f"different {key} per param group ({value}); it cannot "
                                       f"be spread over {groups} groups"])
            adapted[key] = [value[0]] * groups
    return adapted


def load_checkpoint(engine: Any, job: JobConfig, plan: ResumePlan) -> int:
    """Restore the checkpoint of `plan` into `engine` (call on every rank): DeepSpeed's own files,
    or at another layout its universal checkpoint (`prepare_resume` converted it); then the
    routed experts' LoRA factors from their own files (DeepSpeed's own files only). Returns the
    completed step. The RNG states follow later (`restore_rng_states`)."""
    tag_dir = plan.tag_dir
    # A LoRA checkpoint holds no frozen base weights; the module already has them from model.path.
    if plan.universal:
        # its LR schedule follows: it may have been saved for another number of param groups
        path, client_state = engine.load_checkpoint(str(tag_dir), tag=UNIVERSAL,
                                                    load_module_strict=not job.lora.r,
                                                    load_lr_scheduler_states=False)
        scheduler = engine.lr_scheduler
        if path is not None and scheduler is not None:
            groups = len(getattr(scheduler, "optimizer", engine.optimizer).param_groups)
            scheduler.load_state_dict(_per_group(client_state["lr_scheduler"], groups, tag_dir))
    else:
        with _lora_layout(engine, job):
            path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                                        load_module_strict=not job.lora.r)
    if path is None:
        raise CheckpointError([f"train.resume: DeepSpeed could not load {tag_dir}"])
    if not plan.universal:
        restore_expert_adapters(engine.module, tag_dir)
    step = int(client_state["step"])
    logger.info("resumed from %s at step %d", path, step)
    return step
