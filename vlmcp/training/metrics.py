"""Metrics of a run: OUTPUT_DIR/metrics.jsonl (one JSON object per line) and TensorBoard.

Training rows: {"step", "loss", "lr", "grad_norm", "tokens", "targets", "tokens_per_s",
"step_time_s", "epoch", "entropy"} plus the objective's metrics (e.g. "clip_fraction", "ratio",
"approx_kl" for ppo_clip, TRL's "rewards/..." for the preference objectives, "term0_loss", ...
for several terms: model/loss_terms.py, training/objective_step.py; "loss" is then the step's
objective under its normalisation), plus "router_aux_loss" (the mean router load-balancing loss of the step's
micro-batches, without its coefficient; `loss` stays the LM loss) with `model.router_aux_loss`;
on a MoE model the routing replay's and the expert load's keys (model.router_replay,
model.expert_load), under `parallel.ep_size` > 1 "expert_a2a_bytes" and "expert_a2a_s"
(training/ds/expert_comms.py).
Evaluation rows: {"step", "eval_loss", "eval_targets"} plus
"eval_accuracy" and "eval_samples" when generation eval is on. `step` counts completed optimizer
steps. Rows are strict JSON: a NaN or infinite value is written as null and its key listed in
"nonfinite"; a training row whose optimizer step was not applied carries "skipped_step": true.
TensorBoard event files go to OUTPUT_DIR/tensorboard when `tensorboard` is importable.
Only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def strict_row(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with NaN/Inf values replaced by None and their keys listed under "nonfinite"."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return row
    return {**{k: (None if k in bad else v) for k, v in row.items()}, "nonfinite": bad}


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(log_dir))


class MetricsWriter:
    """Appends rows to metrics.jsonl (and TensorBoard). Inert on ranks other than 0.

    `start_step` > 0 (a resumed run) first drops rows of steps after `start_step`, which the
    resumed run is about to repeat.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= start_step] \
            if start_step and self.path.exists() else []
        with self.path.open("w") as handle:
            for row in kept:
                handle.write(json.dumps(row) + "\n")
        self._tb = _tensorboard_writer(Path(output_dir) / "tensorboard")

    def write(self, row: dict[str, Any]) -> None:
        """Append one row; numeric fields also go to TensorBoard under their key."""
        if not self.enabled:
            return
        row = strict_row(row)
        with self.path.open("a") as handle:
            handle.write(json.dumps(row, allow_nan=False) + "\n")
        if self._tb is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
