"""The orchestrator of `vlmcp rl`: prompts -> engines -> rewards -> advantages -> rollout steps.

It speaks to the trainer only through the rollout-step contract (it writes ROLLOUTS/step_N,
`vlmcp.rl.steps`) and the policy versions the engines report (the trainer pushes step N into
them, or publishes it and the orchestrator reloads it), so another trainer can take vlmcp's
place, as long as it labels the engines' weights with its step.

Step N, for N from the resume point to train.max_steps:

1. **Pacing.** Wait until every engine serves policy version N-1-k or newer (k =
   rl.max_off_policy; with rl.weights "files", reload the newest published step first). Every
   token of step N is then within k steps of the weights that train it: nothing finished is
   ever dropped for staleness. While it waits the trainer trains: generating step N overlaps
   training steps N-k..N-1. No version in rollouts.timeout_s, or the trainer gone, is an error.
2. **Sampling.** Prompts are taken from the seeded stream (`vlmcp.rl.prompts.PromptStream`) in
   order, and each becomes a request for rl.group_size answers on the least busy engine
   (`vlmcp.rl.engines`), up to rl.concurrency at once; each group is scored by the reward
   functions as soon as it is back, in reward processes (`vlmcp.rl.rewards`), while the other
   groups generate. Groups are decided in stream order: one whose rewards failed is skipped
   (rl.on_reward_error "skip", counted) or stops the run ("error"); with rl.dynamic_sampling one
   whose answers all got one reward value is dropped (it carries no signal); the others are kept
   until the step has rl.prompts_per_step. No more prompts are started than the step can still
   keep, so every prompt the step started is decided by it: the prompts of step N are exactly
   stream positions [start, end), none repeated or skipped, also across a resume.
   A step that reaches rl.max_prompts_per_step trains on the groups it kept (or, with none, on
   the last dropped group, whose advantages are 0).
3. **Writing.** Group advantages (`vlmcp.rl.advantages`), with rl.overlong_filter the answers
   cut at the length limit left out, every answer one rollout line, the step renamed into
   place with its meta.json (the stream positions: the orchestrator's state).
4. **Metrics** (`vlmcp.rl.step_metrics`): one row per step, one line on the console; every
   rl.eval_every steps (and at the start and after the last step) greedy answers to
   rl.eval_prompts scored by the same rewards.

A stop (`stop` set: SIGTERM to `vlmcp rl`) abandons the step being sampled: its prompts were not
consumed, the resumed run samples them again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vlmcp.config.schema import JobConfig
from vlmcp.engine.published import step_path
from vlmcp.errors import EngineError, OrchestratorError
from vlmcp.rl.advantages import carries_signal, group_advantages
from vlmcp.rl.engines import EnginePool
from vlmcp.rl.groups import Group, GroupSource
from vlmcp.rl.prompts import PromptStream
from vlmcp.rl.step_metrics import (RowWriter, TrainerRows, reward_stats, staleness,
                                   summary_line, trainer_fields)
from vlmcp.rl.steps import StepRecord, resume_point, rollout_line, write_samples, write_step

logger = logging.getLogger(__name__)

#: Seconds between two looks at the engines' versions while pacing.
POLL_S = 0.1


@dataclass
class StepOutcome:
    """The groups a step decided, in stream order, and which of them it writes."""

    decided: list[Group] = field(default_factory=list)
    kept: list[Group] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    skipped: list[Group] = field(default_factory=list)


class Orchestrator:
    """Writes the rollout steps of an rl job (see the module docstring).

    groups: where a row's group comes from (`vlmcp.rl.groups.PromptGroups`, or an environment's
    `vlmcp.rl.environments.EnvironmentGroups`); rows / eval_rows: what it takes (prompt rows of
    `vlmcp.rl.prompts.read_prompts`, or the environment's tasks); engines: the started pool (its
    versions pace the steps); trainer_alive: False once the trainer is gone (waits then fail at
    once); stop: set to stop after the step in progress is abandoned; out_dir: OUTPUT_DIR/rl;
    trainer_metrics: the trainer's metrics.jsonl, read for the console and the rows; progress:
    where the console lines go (default: above the progress bar, shown on a terminal only).
    """

    def __init__(self, job: JobConfig, groups: GroupSource, rows: Sequence[Any],
                 eval_rows: Sequence[Any], engines: EnginePool, *, out_dir: Path,
                 trainer_alive: Callable[[], bool] = lambda: True,
                 stop: threading.Event | None = None, trainer_metrics: Path | None = None,
                 progress: Callable[[str], None] | None = None):
        self.job, self.rl, self.groups = job, job.rl, groups
        self.rows, self.eval_rows = list(rows), list(eval_rows)
        self.engines = engines
        self.rollouts = Path(job.rollouts.dir)
        self.trainer_alive, self.stop = trainer_alive, stop or threading.Event()
        self.stream = PromptStream(len(self.rows), job.train.seed)
        self.names = groups.names
        start = resume_point(self.rollouts, job.train.resume)
        self.next_step, self.position = start.step, start.position
        self.bar = tqdm(total=job.train.max_steps, initial=self.next_step - 1, unit="step",
                        desc="vlmcp rl", disable=None, dynamic_ncols=True)
        self.progress = progress or self._write
        self.out_dir = out_dir
        self.metrics = RowWriter(out_dir / "metrics.jsonl", self.next_step)
        self.trainer_rows = TrainerRows(trainer_metrics) if trainer_metrics else None
        self.pool = ThreadPoolExecutor(self.rl.concurrency, thread_name_prefix="vlmcp-generate")
        self.served = 0

    # ------------------------------------------------------------------ pacing

    def wait_for_version(self, needed: int) -> tuple[float, float]:
        """Wait until every engine serves version `needed` or newer (see the module docstring);
        returns (seconds waited, seconds reloading). Raises OrchestratorError when the trainer
        is gone first or nothing comes within rollouts.timeout_s; returns early on a stop."""
        started = time.perf_counter()
        reload_s = 0.0
        while not self.stop.is_set():
            if self.rl.weights == "files":
                reload_s += self._serve_newest()
            if min(self.engines.versions()) >= needed:
                break
            waited = time.perf_counter() - started
            if not self.trainer_alive():
                raise OrchestratorError([f"the trainer stopped before policy version {needed} "
                                         "reached the engines"])
            if waited > self.job.rollouts.timeout_s:
                raise OrchestratorError([
                    f"rollouts.timeout_s={self.job.rollouts.timeout_s:g}: no engine serves policy "
                    f"version {needed} after {waited:.0f} s (versions "
                    f"{self.engines.versions()}); has the trainer stopped?"])
            time.sleep(POLL_S)
        return time.perf_counter() - started - reload_s, reload_s

    def _serve_newest(self) -> float:
        """rl.weights "files": reload the newest published step when it is newer than served."""
        weights = Path(self.job.publish.dir)
        newest = max((int(p.name[5:]) for p in weights.glob("step_*")
                      if p.name[5:].isdigit() and (p / "STABLE").is_file()), default=0)
        if newest <= self.served:
            return 0.0
        try:
            step_path(weights, newest)
        except EngineError:
            return 0.0
        seconds = self.engines.serve(newest)
        self.served = newest
        return seconds

    # ------------------------------------------------------------------ one group

    def _submit(self, position: int) -> Future[Group]:
        seed = (self.job.train.seed * 1_000_003 + position * self.rl.group_size) % 2**31
        return self.pool.submit(self.groups.group, self.rows[self.stream.at(position)], position,
                                n=self.rl.group_size, temperature=self.rl.temperature, seed=seed)

    def _result(self, future: Future[Group]) -> Group | None:
        """The group of `future`, or None on a stop."""
        while not self.stop.is_set():
            try:
                return future.result(timeout=0.2)
            except TimeoutError:
                continue
        return None

    # ------------------------------------------------------------------ one step

    def _decide(self, group: Group, outcome: StepOutcome) -> None:
        outcome.decided.append(group)
        if group.failure is not None:
            if self.rl.on_reward_error == "error":
                raise OrchestratorError([f"{group.failure} (rl.on_reward_error \"error\": the "
                                         "run stops; \"skip\" skips such groups)"])
            logger.warning("%s: group skipped (rl.on_reward_error \"skip\")", group.failure)
            outcome.skipped.append(group)
        elif self.rl.dynamic_sampling and not carries_signal(group.rewards.total):
            outcome.dropped.append(group)
        else:
            outcome.kept.append(group)

    def sample_step(self) -> StepOutcome | None:
        """Sample the next step's groups from the stream (see the module docstring); None on a
        stop (the position stays where it was)."""
        needed = self.rl.prompts_per_step
        limit = (self.rl.max_prompts_per_step or 4 * needed) if self.rl.dynamic_sampling \
            else needed
        outcome = StepOutcome()
        pending: deque[Future[Group]] = deque()
        position = self.position
        try:
            while len(outcome.kept) < needed:
                while len(outcome.kept) + len(pending) < needed \
                        and position - self.position < limit:
                    pending.append(self._submit(position))
                    position += 1
                if not pending:
                    break
                group = self._result(pending[0])
                if group is None:
                    return None
                pending.popleft()
                self._decide(group, outcome)
        finally:
            for future in pending:
                future.cancel()
        self.position = position
        return outcome

    def _lines(self, outcome: StepOutcome) -> list[dict[str, Any]]:
        groups = outcome.kept or [g for g in outcome.dropped[-1:]]
        merge = self.rl.merge_identical_answers
        written: list[list[Any]] = []
        sampled = 0
        for group in groups:
            advantages = group_advantages(group.rewards.total, self.rl.advantage)
            merged: dict[tuple, list[Any]] = {}
            for i, (sample, owner) in enumerate(zip(group.samples, group.owners)):
                advantage = advantages[owner]
                if self.rl.overlong_filter and sample.truncated:
                    continue
                sampled += sum(sample.sampled)
                # same tokens, versions and sign of advantage: the merged loss is exactly theirs
                key = ((tuple(sample.token_ids), tuple(sample.versions), advantage > 0)
                       if merge else (i,))
                entry = merged.setdefault(key, [group, i, 0.0, 0])
                entry[2] += advantage
                entry[3] += 1
            written += merged.values()
        # Merged: each line's advantage times (tokens written / tokens sampled), so that the
        # step's token-normalised loss is that of every sampled answer (docs/rl-loop.md).
        scale = (sum(sum(g.samples[i].sampled) for g, i, _, _ in written) / max(sampled, 1)
                 if merge else 1.0)
        lines = []
        for group, i, advantage, copies in written:
            owner = group.owners[i]
            lines.append(rollout_line(
                group.samples[i], advantage * scale, self.rl.temperature,
                reward=group.rewards.total[owner], prompt_position=group.position,
                rewards={n: v[owner] for n, v in group.rewards.per_function.items()},
                **({"copies": copies} if merge else {})))
        return lines

    @staticmethod
    def _sample_record(group: Group, status: str) -> dict[str, Any]:
        rewards = group.rewards
        return {"prompt_position": group.position, "source": group.source, "status": status,
                "completion_ids": [s.completion_ids for s in group.samples],
                "owners": group.owners,
                "truncated": [s.truncated for s in group.samples],
                "reward": rewards.total if rewards else None,
                "rewards": rewards.per_function if rewards else None,
                "failure": group.failure}

    def run_step(self, number: int) -> bool:
        """Pace, sample, write and report step `number`; False on a stop."""
        started = time.perf_counter()
        busy_before, retries_before = self.engines.busy_seconds(), self.engines.retries
        waited, reload_s = self.wait_for_version(number - 1 - self.rl.max_off_policy)
        if self.stop.is_set():
            return False
        start_position = self.position
        fill_started = time.perf_counter()
        outcome = self.sample_step()
        if outcome is None:
            return False
        fill_s = time.perf_counter() - fill_started
        lines = self._lines(outcome)
        if not lines:
            raise OrchestratorError([
                f"rollout step {number}: no answer to write (every group skipped, or every "
                "answer cut at rl.max_new_tokens with rl.overlong_filter)"])
        versions = [span["version"] for line in lines for span in line["policy_versions"]]
        record = StepRecord(min(versions), start_position, self.position,
                            [g.position for g in outcome.decided],
                            [g.position for g in outcome.kept],
                            [g.position for g in outcome.dropped],
                            [g.position for g in outcome.skipped])
        status = {id(g): name for name, groups in (("kept", outcome.kept),
                                                     ("dropped", outcome.dropped),
                                                     ("skipped", outcome.skipped))
                  for g in groups}
        write_samples(self.out_dir / "samples" / f"step_{number}.jsonl",
                      [self._sample_record(g, status[id(g)]) for g in outcome.decided])
        write_step(self.rollouts, number, lines, record)
        elapsed = time.perf_counter() - started
        busy = sum(self.engines.busy_seconds()) - sum(busy_before)
        answers = [s for g in outcome.decided for s in g.samples]
        lengths = [sum(s.sampled) for s in answers]
        gen_tokens = sum(lengths)
        row = {"step": number, **reward_stats(outcome.decided, self.names, self.rl.group_size),
               "answer_tokens_mean": gen_tokens / max(len(answers), 1),
               "answer_tokens_max": max(lengths, default=0),
               "truncated_fraction": sum(a.truncated for a in answers) / max(len(answers), 1),
               "groups_kept": len(outcome.kept), "groups_dropped": len(outcome.dropped),
               "groups_skipped": len(outcome.skipped), "prompts": len(outcome.decided),
               "answers_written": len(lines), "policy_version_oldest": min(versions),
               "policy_version_newest": max(versions), "staleness": staleness(lines, number),
               "gen_tokens": gen_tokens, "gen_tokens_per_s": gen_tokens / fill_s,
               "fill_s": fill_s, "wait_weights_s": waited, "reload_s": reload_s,
               "reward_s": sum(g.reward_s for g in outcome.decided),
               "engine_idle_fraction": max(0.0, 1 - busy / (len(self.engines.engines) * elapsed)),
               "engine_retries": self.engines.retries - retries_before, "step_s": elapsed}
        if self.trainer_rows is not None:
            row.update(trainer_fields(self.trainer_rows.poll()))
        self.metrics.write(row)
        self.progress(summary_line(row, self.job.train.max_steps, self.rl.group_size))
        self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}" if row["reward_mean"] is not None
                             else "-", policy=row["policy_version_newest"])
        self.bar.update(1)
        return True

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, after_step: int) -> dict[str, Any] | None:
        """Greedy answers to the held-out prompts, scored; writes and returns the row (None
        without rl.eval_prompts, or on a stop)."""
        if not self.eval_rows:
            return None
        count = min(len(self.eval_rows), self.rl.eval_max_prompts or len(self.eval_rows))
        version = min(self.engines.versions())
        futures = [self.pool.submit(self.groups.group, self.eval_rows[i], i, n=1,
                                    temperature=0.0, seed=None) for i in range(count)]
        groups = []
        for future in futures:
            group = self._result(future)
            if group is None:
                return None
            if group.failure is not None and self.rl.on_reward_error == "error":
                raise OrchestratorError([f"{group.failure} (in the evaluation after step "
                                         f"{after_step})"])
            groups.append(group)
        row = {"eval_step": after_step, "policy_version": version, "eval_prompts": count,
               "eval_skipped": sum(g.failure is not None for g in groups),
               **reward_stats(groups, self.names, 1, prefix="eval_")}
        self.metrics.write(row)
        self.progress(f"eval after step {after_step} (policy {version}): reward "
                      f"{row['eval_reward_mean']:.3f}, pass@1 {row['eval_pass@1']:.3f} over "
                      f"{count} held-out prompts")
        return row

    # ------------------------------------------------------------------ the run

    def run(self) -> bool:
        """Every step from the resume point to train.max_steps, the evaluations, and after the
        last step the final policy's evaluation; False when stopped."""
        steps, every = self.job.train.max_steps, self.rl.eval_every
        if not self.job.train.resume:
            self.engines.label_fresh()
        if every and self.next_step == 1:
            self.evaluate(0)
        for number in range(self.next_step, steps + 1):
            if not self.run_step(number):
                return False
            if every and number % every == 0 and number < steps:
                self.evaluate(number)
        if every:
            self.wait_for_version(steps)
            if self.stop.is_set():
                return False
            self.evaluate(steps)
        return True

    def _write(self, line: str) -> None:
        """A console line, printed above the progress bar (plain stdout when it is off)."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def close(self) -> None:
        """Stop the progress bar, the generation threads' pool (requests in flight finish in the background) and
        what the group source holds (reward processes, an environment)."""
        self.bar.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.groups.close()
