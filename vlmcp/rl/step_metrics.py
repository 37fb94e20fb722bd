"""The orchestrator's metrics: one row per rollout step and per evaluation, and the console line.

A step row (OUTPUT_DIR/rl/metrics.jsonl) holds, over the groups the step sampled (kept, dropped
for no signal; skipped groups have no rewards):

    reward_mean, reward_std           the weighted reward of every answer
    reward/NAME_mean, reward/NAME_std each reward function's values (None values left out)
    pass@1, pass@G                    the mean fraction of a group's answers that pass (reward > 0),
                                      and the fraction of groups with at least one that passes
    answer_tokens_mean, _max          the answers' lengths; truncated_fraction: cut at the limit
    groups_kept, groups_dropped,      groups written; dropped for one reward value (dynamic
    groups_skipped, prompts           sampling); skipped for a reward failure; prompts consumed
    answers_written                   rollout lines written
    policy_version_oldest, _newest    over the written tokens; staleness: {lag: tokens} with lag
                                      (step - 1) - version, the trainer's own definition
    gen_tokens, gen_tokens_per_s      the answers' tokens over the time the step's groups took
    fill_s, wait_weights_s, reload_s  the step's sampling, its wait for the policy (pacing) and,
                                      with rl.weights "files", the engines' reloads
    reward_s                          the groups' time from their answers to their rewards (the
                                      reward calls and their queue), summed over the groups
    engine_idle_fraction              1 - (engine time with a request in flight) / (engines x the
                                      step's wall time, wait included)
    engine_retries                    requests retried on another engine during the step
    trainer_step, trainer_idle_fraction, mismatch_kl
                                      the newest trainer row: its wait for rollouts over its wait
                                      and step time, and its train-inference mismatch

Evaluation rows: {"eval_step", "policy_version", "eval_prompts", "eval_reward_mean",
"eval_pass@1", "eval/NAME_mean", ...}.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, population std) of `values`; (None, None) without any."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.pstdev(values)


def reward_stats(groups: Sequence[Any], names: Sequence[str], group_size: int,
                 prefix: str = "") -> dict[str, Any]:
    """Reward means and stds (total and per function) and pass@1 / pass@G over the scored
    `groups` (each with `.rewards`: a `GroupRewards`)."""
    scored = [g for g in groups if g.rewards is not None]
    totals = [r for g in scored for r in g.rewards.total]
    row: dict[str, Any] = {}
    row[f"{prefix}reward_mean"], row[f"{prefix}reward_std"] = mean_std(totals)
    for name in names:
        values = [v for g in scored for v in g.rewards.per_function[name] if v is not None]
        mean, std = mean_std(values)
        row[f"{prefix}reward/{name}_mean"] = mean
        if not prefix:
            row[f"reward/{name}_std"] = std
    passing = [sum(r > 0 for r in g.rewards.total) / len(g.rewards.total) for g in scored]
    row[f"{prefix}pass@1"] = statistics.fmean(passing) if passing else None
    if not prefix:
        row[f"pass@{group_size}"] = (statistics.fmean(float(p > 0) for p in passing)
                                     if passing else None)
    return row


def staleness(lines: Sequence[dict[str, Any]], step: int) -> dict[str, int]:
    """{lag: tokens} of the written lines' answer tokens, lag = (step - 1) - version."""
    counts: dict[int, int] = {}
    for line in lines:
        for span in line["policy_versions"]:
            lag = step - 1 - span["version"]
            counts[lag] = counts.get(lag, 0) + span["end"] - span["start"]
    return {str(lag): counts[lag] for lag in sorted(counts)}


class TrainerRows:
    """The trainer's OUTPUT_DIR/metrics.jsonl, read as it grows (only complete lines)."""

    def __init__(self, path: Path):
        self.path, self._offset = path, 0
        self.newest: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any] | None:
        """The newest training row so far (None before the first)."""
        if not self.path.is_file():
            return self.newest
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for raw in data[:end].splitlines():
            row = json.loads(raw) if raw.strip() else {}
            if "step_time_s" in row:
                self.newest = row
        return self.newest


def trainer_fields(row: dict[str, Any] | None) -> dict[str, Any]:
    """The trainer's side of a step row (see the module docstring)."""
    if row is None:
        return {}
    wait, busy = row.get("rollout_wait_s", 0.0), row["step_time_s"]
    out = {"trainer_step": row["step"],
           "trainer_idle_fraction": wait / (wait + busy) if wait + busy > 0 else 0.0}
    if row.get("mismatch_kl") is not None:
        out["mismatch_kl"] = row["mismatch_kl"]
    return out


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def summary_line(row: dict[str, Any], steps: int, group_size: int) -> str:
    """The console's one line about a step row."""
    parts = [f"step {row['step']}/{steps}: reward {_fmt(row['reward_mean'])}",
             f"pass@1 {_fmt(row['pass@1'], '.2f')} pass@{group_size} "
             f"{_fmt(row[f'pass@{group_size}'], '.2f')}",
             f"{row['groups_kept']} groups ({row['groups_dropped']} dropped, "
             f"{row['groups_skipped']} skipped) of {row['prompts']} prompts",
             f"answers {_fmt(row['answer_tokens_mean'], '.1f')} tokens "
             f"({_fmt(100 * row['truncated_fraction'], '.0f')} % cut)",
             f"policy {row['policy_version_oldest']}-{row['policy_version_newest']}",
             f"{_fmt(row['gen_tokens_per_s'], '.0f')} tok/s, waited "
             f"{_fmt(row['wait_weights_s'], '.1f')} s, engines idle "
             f"{_fmt(100 * row['engine_idle_fraction'], '.0f')} %"]
    if "trainer_idle_fraction" in row:
        parts.append(f"trainer idle {_fmt(100 * row['trainer_idle_fraction'], '.0f')} % "
                     f"(step {row['trainer_step']})")
    if "mismatch_kl" in row:
        parts.append(f"mismatch_kl {_fmt(row['mismatch_kl'], '.1e')}")
    return ", ".join(parts)


class RowWriter:
    """Appends rows to a JSON Lines file (a resumed run first drops the rows of steps it is
    about to write again)."""

    def __init__(self, path: Path, first_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line.strip()
                    and json.loads(line).get("step", json.loads(line).get("eval_step", 0))
                    < first_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")
