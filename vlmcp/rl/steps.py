"""What the orchestrator writes: rollout lines and rollout steps, in the trainer's contract.

One answer (or one multi-turn episode's branch) is one tokens-format line (docs/rl-loop.md,
"The data"):

    input_ids            the prompt's token ids (as training renders it) + the engine's answer ids
                         (multi-turn: every turn's prompt tokens and answers, as the engine saw
                         them)
    labels               -100 on the prompt (and the environment's messages), the sampled ids on
                         the answer
    images               the prompt's image paths (absolute)
    advantages           the answer's advantage on each of its tokens (null on the prompt)
    old_logprobs,        the engine's logprob of each sampled token (after temperature and the
    inference_logprobs   sampling mask: vLLM's processed logprobs)
    temperatures         the sampling temperature on each answer token
    policy_versions      spans of input_ids positions with the policy version that sampled them
                         (the engine's `weight_versions`, shifted by the prompt's length)
    reward, rewards      the answer's reward (the weighted sum) and each function's value, and
    prompt_position      its group's position in the prompt stream: what the advantage came from
                         (the trainer reads none of the three)

A step goes to ROLLOUTS/.tmp-step_N first, `STABLE` last, then is renamed to ROLLOUTS/step_N (an
atomic rename: the trainer sees all of it or nothing). Its meta.json says, beside `policy_step`
(the oldest version of any token), where in the prompt stream the step began and ended and which
rows it consumed, kept, dropped and skipped: the orchestrator's state is the newest step's
meta.json (`resume_point`), so a resumed run continues the stream exactly where the last written
step ended, and nothing else needs saving.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmcp.data.rollouts import META, STABLE, is_complete, read_meta, step_dir
from vlmcp.errors import OrchestratorError

DATA_FILE = "rollouts.jsonl"
#: meta.json's "written_by" of the steps `vlmcp rl` writes.
WRITTEN_BY = "vlmcp rl"
_TMP = ".tmp-"


@dataclass
class Answer:
    """One answer as the engine returned it: its token ids and logprobs, the policy version of
    each token, and whether it was cut at the length limit."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    truncated: bool


@dataclass
class Sample:
    """One trainable sequence: every token id, which of them the engine sampled (the others are
    the prompt, or in a multi-turn episode the environment's messages and the template between
    turns), and for the sampled ones, in order, their logprobs and policy versions."""

    token_ids: list[int]
    sampled: list[bool]
    logprobs: list[float]
    versions: list[int]
    truncated: bool = False
    images: list[Path] = field(default_factory=list)

    @classmethod
    def of_answer(cls, prompt_ids: Sequence[int], images: Sequence[Path], answer: Answer
                  ) -> Sample:
        """A prompt and one engine answer after it."""
        return cls([*prompt_ids, *answer.token_ids],
                   [False] * len(prompt_ids) + [True] * len(answer.token_ids),
                   list(answer.logprobs), list(answer.versions), answer.truncated, list(images))

    @property
    def completion_ids(self) -> list[int]:
        """The sampled tokens, in order."""
        return [t for t, sampled in zip(self.token_ids, self.sampled) if sampled]


def version_spans(sampled: Sequence[bool], versions: Sequence[int]) -> list[dict[str, int]]:
    """`policy_versions` spans over the positions of the sampled tokens (`versions`: one per
    sampled token, in order)."""
    spans: list[dict[str, int]] = []
    found = iter(versions)
    for t, is_sampled in enumerate(sampled):
        if not is_sampled:
            continue
        version = next(found)
        if spans and spans[-1]["version"] == version and spans[-1]["end"] == t:
            spans[-1]["end"] += 1
        else:
            spans.append({"version": version, "start": t, "end": t + 1})
    return spans


def _aligned(sampled: Sequence[bool], values: Sequence[Any]) -> list[Any]:
    """Per-sampled-token `values` spread over every position (null elsewhere)."""
    found = iter(values)
    return [next(found) if is_sampled else None for is_sampled in sampled]


def rollout_line(sample: Sample, advantage: float, temperature: float, **record: Any
                 ) -> dict[str, Any]:
    """The tokens-format line of one sample (see the module docstring); `record`: the keys
    that say where its advantage came from (reward, rewards, prompt_position)."""
    sampled = sample.sampled
    line = {
        "input_ids": list(sample.token_ids),
        "labels": [t if s else -100 for t, s in zip(sample.token_ids, sampled)],
        "advantages": [advantage if s else None for s in sampled],
        "old_logprobs": _aligned(sampled, sample.logprobs),
        "inference_logprobs": _aligned(sampled, sample.logprobs),
        "temperatures": [temperature if s else None for s in sampled],
        "policy_versions": version_spans(sampled, sample.versions),
        **record,
    }
    if sample.images:
        line["images"] = [str(Path(p).resolve()) for p in sample.images]
    return line


@dataclass
class StepRecord:
    """What meta.json says about a written step beside its data."""

    policy_step: int
    position_start: int
    position_end: int
    consumed: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        return {"policy_step": self.policy_step, "written_by": WRITTEN_BY,
                "prompt_position": [self.position_start, self.position_end],
                "prompts": self.consumed, "kept": self.kept, "dropped": self.dropped,
                "skipped": self.skipped}


def write_samples(path: Path, groups: Sequence[dict[str, Any]]) -> None:
    """OUTPUT_DIR/rl/samples/step_N.jsonl: every group a step decided, kept or not (its
    answers' token ids, rewards and status), for whoever checks what the orchestrator did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for group in groups:
            out.write(json.dumps(group) + "\n")


def write_step(rollouts: Path, number: int, lines: Sequence[dict[str, Any]],
               record: StepRecord) -> Path:
    """ROLLOUTS/step_`number`, written under a temporary name, STABLE last, renamed into place."""
    final = step_dir(rollouts, number)
    tmp = rollouts / f"{_TMP}{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with (tmp / DATA_FILE).open("w") as out:
        for line in lines:
            out.write(json.dumps(line) + "\n")
    (tmp / META).write_text(json.dumps(record.meta()) + "\n")
    (tmp / STABLE).write_text(json.dumps({"written_by": WRITTEN_BY}) + "\n")
    os.rename(tmp, final)
    return final


def written_steps(rollouts: Path) -> list[int]:
    """The numbers of the complete steps in `rollouts`, ascending."""
    if not rollouts.is_dir():
        return []
    found = []
    for path in rollouts.iterdir():
        name = path.name
        if name.startswith("step_") and name[5:].isdigit() and is_complete(path):
            found.append(int(name[5:]))
    return sorted(found)


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: the next step to write and the prompt stream position."""

    step: int
    position: int


def resume_point(rollouts: Path, resume: bool) -> ResumePoint:
    """The orchestrator's state from the steps in `rollouts` (see the module docstring); removes
    a step it left half-written. A fresh run (`resume` false) refuses a directory that already
    holds steps; a resumed one needs them numbered 1..N without a gap, the newest written by
    `vlmcp rl`."""
    for tmp in rollouts.glob(f"{_TMP}step_*") if rollouts.is_dir() else ():
        shutil.rmtree(tmp)
    steps = written_steps(rollouts)
    if not steps:
        return ResumePoint(1, 0)
    if not resume:
        raise OrchestratorError([f"rollouts.dir {rollouts} already holds rollout steps "
                                 f"(step_{steps[0]}..step_{steps[-1]}) but train.resume is false: "
                                 "resume that run, or give a fresh rollouts.dir"])
    if steps != list(range(1, len(steps) + 1)):
        raise OrchestratorError([f"rollouts.dir {rollouts}: steps {steps} are not numbered "
                                 "1..N without a gap"])
    meta = read_meta(step_dir(rollouts, steps[-1])).fields
    position = meta.get("prompt_position")
    if meta.get("written_by") != WRITTEN_BY or not isinstance(position, list):
        raise OrchestratorError([f"{step_dir(rollouts, steps[-1]) / META}: not written by "
                                 f"{WRITTEN_BY} (no prompt_position): cannot continue its prompt "
                                 "stream"])
    return ResumePoint(steps[-1] + 1, int(position[1]))
