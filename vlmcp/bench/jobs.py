"""The short training jobs that `vlmcp bench`'s end-to-end modes run (`--data-scale`,
`--rollout-rss`, `--publish`): their job and a timed run of it; and the scratch folder those modes
and `--engine-mismatch` work in.

The job is the smallest one vlmcp trains: a local tiny checkpoint, SGD, ZeRO-0 unless told
otherwise, seed 0; each mode adds its own data, rollouts or publish sections.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmcp.training.loop import Run


@contextmanager
def scratch_folder(parent: str | None, prefix: str) -> Iterator[Path]:
    """A new temporary folder inside `parent` (made when missing; None: the system's temporary
    folder), removed with everything in it on leaving."""
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as name:
        yield Path(name)


def short_job(model: dict[str, Any], data: dict[str, Any], out: Path, steps: int,
              lr: float = 1e-3, zero_stage: int = 0, **sections: Any) -> dict[str, Any]:
    """A job dict (docs/config.md): `model` and `data` as given, SGD at `lr`, `steps` steps from
    seed 0 under ZeRO `zero_stage`, outputs in `out`, and the further `sections` as given
    (`parallel`, `rollouts`, `publish`)."""
    return {"model": model, "data": data, "optimizer": {"type": "sgd", "lr": lr},
            "train": {"max_steps": steps, "seed": 0},
            "deepspeed": {"zero_optimization": {"stage": zero_stage}},
            "output_dir": str(out), **sections}


def timed_training(job_path: str) -> tuple[Run, float]:
    """Train the job file at `job_path` (every rank of the world calls this): the finished
    `Run` (vlmcp.training.loop) and its wall-clock seconds on this rank."""
    from vlmcp.config import load_job
    from vlmcp.training.loop import train

    started = time.perf_counter()
    run = train(load_job(job_path, []))
    return run, time.perf_counter() - started


def started_run(job: dict[str, Any]) -> tuple[Run, int]:
    """The run of the job dict `job` (every rank of the world calls this), in train mode, after
    its first optimizer step: (the run, 1)."""
    from vlmcp.config import job_from_dict
    from vlmcp.training.loop import start_run, train_step

    run = start_run(job_from_dict(job))
    run.engine.train()
    train_step(run, 0)
    return run, 1


def published_after(run: Run, publisher: Any, step: int, *, train_meanwhile: bool = True
                    ) -> tuple[list[dict[str, Any]], int]:
    """`publisher` publishes the weights after `step` steps, and the run trains on until the
    publish completed (every rank), or with `train_meanwhile` False waits for it idle: (the
    rows `publish` and `check` returned, the steps done now)."""
    from vlmcp.training.loop import train_step

    run.publisher = publisher  # the steps' optimizer steps wait at its fence
    rows = publisher.publish(step)
    while not rows:
        if train_meanwhile:
            train_step(run, step)
            step += 1
        else:
            time.sleep(0.01)
        rows = publisher.check()
    return rows, step

