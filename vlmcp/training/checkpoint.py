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
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from vlmcp.config import JobConfig
from vlmcp.errors import CheckpointError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.training.ds.expert_lora import (EXPERT_ADAPTER_FILE, local_adapter_state,
                                           restore_local_adapters)
from vlmcp.training.atomic import (dir_size, remove_quietly, replace_dir, write_error,
                                   write_text_atomic)

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
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
    manifest = tag_dir / MANIFEST
    if not manifest.is_file():
        return f"{tag_dir} has no {MANIFEST} (its save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{manifest} is unreadable ({exc})"
    for name, size in files.items():
        path = tag_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, the manifest says {size}"
    return None


def newest_complete(directory: str | Path) -> tuple[str | None, list[str]]:
    """(the newest complete tag or None, why each newer checkpoint was skipped)."""
    skipped = []
    for _, tag in checkpoint_tags(directory):
        reason = incomplete_reason(Path(directory) / tag)
        if reason is None:
            return tag, skipped
        skipped.append(reason)
    return None, skipped


def _manifest_bytes(tag_dir: Path) -> int:
    return sum(json.loads((tag_dir / MANIFEST).read_text())["files"].values())


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


def _publish(tmp: Path, directory: Path, tag: str, step: int, keep: int, ep_size: int) -> None:
    """Rank 0: manifest last, rename into place, replace `latest`, prune old checkpoints."""
    files = {str(p.relative_to(tmp)): p.stat().st_size
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    write_text_atomic(tmp / MANIFEST, json.dumps({"step": step, "ep_size": ep_size,
                                                  "files": files}, indent=1))
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


def _save_expert_adapters(module: Any, tmp: Path, ep_size: int) -> None:
    """Under expert parallelism with LoRA on the routed experts: global ranks 0..E-1 (EP group
    0, one of each EP rank) each write their experts' adapter factors to
    `expert_adapters_ep_rank_<r>.pt`. DeepSpeed's expert files hold only AutoEP's `w1`/`w2`/`w3`,
    and its model states only rank 0's experts' adapters; `vlmcp export` reads these (resume
    restores every rank's own from its optimizer partition)."""
    state = local_adapter_state(module)
    if state and comm.rank() < ep_size:
        torch.save(state, tmp / EXPERT_ADAPTER_FILE.format(rank=comm.rank()))


def save_checkpoint(engine: Any, job: JobConfig, step: int, hf_key_prefixes: dict[str, str]) -> Path:
    """Save the engine after `step` completed optimizer steps (call on every rank)."""
    directory = checkpoint_dir(job)
    tag = f"step{step}"
    tmp_tag = f".tmp-{tag}"
    tmp = directory / tmp_tag
    previous, _ = newest_complete(directory)
    needed = _manifest_bytes(directory / previous) if previous else None
    _prepare(tmp)
    problem = None
    try:
        engine.save_checkpoint(str(directory), tag=tmp_tag, save_latest=False,
                               client_state={"step": step, "hf_key_prefixes": hf_key_prefixes},
                               exclude_frozen_parameters=bool(job.lora.r))
        _save_expert_adapters(engine.module, tmp, job.parallel.ep_size)
    except Exception as exc:  # any failure is agreed: the other ranks wait in the barrier below
        problem = f"saving checkpoint {directory / tag}: {write_error(exc, tmp, needed)}"
        # The others wait in the barrier that closes DeepSpeed's save; join it before agreeing.
        comm.barrier()
    try:
        fail_together(_lines(problem), CheckpointError,
                      what=f"saving checkpoint {directory / tag}")
    except CheckpointError:
        if comm.rank() == 0:
            remove_quietly(tmp)
        raise
    problem = None
    if comm.rank() == 0:
        try:
            _publish(tmp, directory, tag, step, job.train.keep_checkpoints, job.parallel.ep_size)
        except OSError as exc:
            problem = f"saving checkpoint {directory / tag}: {write_error(exc, tmp, needed)}"
            remove_quietly(tmp)
    fail_together(_lines(problem), CheckpointError, what=f"publishing checkpoint {directory / tag}")
    if comm.rank() == 0:
        logger.info("saved checkpoint %s (%d bytes)", directory / tag, dir_size(directory / tag))
    return directory / tag


def expert_layout_problem(tag_dir: Path, ep_size: int) -> str | None:
    """Why the complete checkpoint `tag_dir` cannot resume a run at `parallel.ep_size` =
    `ep_size` (None when it can): DeepSpeed's AutoEP saves each EP rank's experts and their
    optimizer partitions for its own layout, and vlmcp converts no checkpoint between expert
    layouts. A manifest without `ep_size` is from a run without expert parallelism."""
    saved = json.loads((tag_dir / MANIFEST).read_text()).get("ep_size", 1)
    if saved == ep_size:
        return None
    return (f"config key 'parallel.ep_size': {ep_size}, but checkpoint {tag_dir} was saved at "
            f"parallel.ep_size={saved}; resume at ep_size {saved} (a checkpoint's experts and "
            "their optimizer state are laid out per EP rank), or start from an exported model")


def load_latest(engine: Any, job: JobConfig) -> int:
    """Restore the newest complete checkpoint into `engine`; returns the completed step."""
    directory = checkpoint_dir(job)
    tag, skipped = newest_complete(directory)
    for reason in skipped if comm.rank() == 0 else []:
        logger.warning("train.resume: skipping an incomplete checkpoint: %s", reason)
    if tag is None:
        raise CheckpointError([f"train.resume: {directory} holds no complete checkpoint"] + skipped)
    problem = expert_layout_problem(directory / tag, job.parallel.ep_size)
    if problem:
        raise CheckpointError([f"train.resume: {problem}"])
    # A LoRA checkpoint holds no frozen base weights; the module already has them from model.path.
    path, client_state = engine.load_checkpoint(str(directory), tag=tag,
                                                load_module_strict=not job.lora.r)
    if path is None:
        raise CheckpointError([f"train.resume: DeepSpeed could not load {directory / tag}"])
    restore_local_adapters(engine.module, directory / tag)
    step = int(client_state["step"])
    logger.info("resumed from %s at step %d", path, step)
    return step
