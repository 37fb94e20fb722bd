"""DeepSpeed checkpoints of a run: OUTPUT_DIR/checkpoints/step<N>/, plus DeepSpeed's `latest`.

The client state records the completed step (the data position: the step schedule is a pure
function of it) and how the training module's keys map to Hugging Face names (for
`vlmcp export`). Model, optimizer, LR scheduler and RNG-free data order restore exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vlmcp.config import JobConfig

logger = logging.getLogger(__name__)


def checkpoint_dir(job: JobConfig) -> Path:
    """Where DeepSpeed checkpoints of the job go."""
    return Path(job.output_dir) / "checkpoints"


def latest_tag(directory: str | Path) -> str | None:
    """The tag DeepSpeed's `latest` file names, or None when there is no checkpoint."""
    latest = Path(directory) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def save_checkpoint(engine: Any, job: JobConfig, step: int, hf_key_prefixes: dict[str, str]) -> Path:
    """Save the engine after `step` completed optimizer steps (call on every rank)."""
    directory = checkpoint_dir(job)
    tag = f"step{step}"
    engine.save_checkpoint(str(directory), tag=tag,
                           client_state={"step": step, "hf_key_prefixes": hf_key_prefixes})
    logger.info("saved DeepSpeed checkpoint %s", directory / tag)
    return directory / tag


def load_latest(engine: Any, job: JobConfig) -> int:
    """Restore the latest checkpoint into `engine`; returns the completed step to continue from."""
    directory = checkpoint_dir(job)
    path, client_state = engine.load_checkpoint(str(directory))
    if path is None:
        raise FileNotFoundError(f"train.resume: no checkpoint could be loaded from {directory}")
    step = int(client_state["step"])
    logger.info("resumed from %s at step %d", path, step)
    return step
