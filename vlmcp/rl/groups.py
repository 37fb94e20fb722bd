"""A prompt's group: its samples and their rewards, from prompts and reward functions.

`Group` is what the orchestrator decides on, whatever made it: `PromptGroups` (single-turn
prompts of rl.prompts: one engine request of n answers, rewards by the functions of rl.rewards)
or `vlmcp.rl.environments.EnvironmentGroups` (a `verifiers` environment's episodes, its rubric).
Both take a row and give a `Group` of n samples, `failure` set when the rewards could not be had.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmcp.config.schema import RlSection
from vlmcp.data.processor import VLProcessor
from vlmcp.errors import DataError, OrchestratorError
from vlmcp.rl.engines import EnginePool
from vlmcp.rl.generation import answers_of, generate_request, sampling_mask
from vlmcp.rl.prompts import PromptRow, render_prompt
from vlmcp.rl.rewards import GroupRewards, RewardFailure, RewardRunner
from vlmcp.rl.steps import Sample


@dataclass
class Group:
    """One row's samples and rewards (`failure`: why its rewards are missing); `position`: its
    place in the prompt stream. The rewards are per answer (an episode, for an environment);
    `owners[k]` is the answer sample k belongs to (a multi-turn episode whose turns do not
    extend each other's tokens is one sample per turn; else one sample per answer)."""

    position: int
    source: str
    samples: list[Sample] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    rewards: GroupRewards | None = None
    failure: str | None = None
    seconds: float = 0.0
    reward_s: float = 0.0


class GroupSource(Protocol):
    """What the orchestrator samples groups from: `names` of the reward functions (or rubric
    entries), `group` (one row's n samples, scored), `close`."""

    names: list[str]

    def group(self, row: Any, position: int, *, n: int, temperature: float,
              seed: int | None) -> Group: ...

    def close(self) -> None: ...


class PromptGroups:
    """Groups of single-turn prompts: the engines answer, the reward functions score."""

    def __init__(self, rl: RlSection, processor: VLProcessor, engines: EnginePool,
                 rewards: RewardRunner):
        self.rl, self.processor, self.engines, self.rewards = rl, processor, engines, rewards
        self.allowed = sampling_mask(processor) if rl.sampling_mask == "text" else None
        self.names = [spec.name for spec in rewards.specs]

    def _reward_kwargs(self, row: PromptRow, answers: Sequence[Sample]) -> dict[str, Any]:
        """TRL's arguments of one group (see `vlmcp.rl.rewards`)."""
        ids = [sample.completion_ids for sample in answers]
        texts = [self.processor.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        completions = ([[{"role": "assistant", "content": t}] for t in texts]
                       if row.conversational else texts)
        count = len(answers)
        return {"prompts": [row.reward_prompt()] * count, "completions": completions,
                "completion_ids": ids,
                **{name: [value] * count for name, value in row.columns.items()}}

    def group(self, row: PromptRow, position: int, *, n: int, temperature: float,
              seed: int | None) -> Group:
        """Generate and score `n` answers to `row` (temperature 0: greedy)."""
        started = time.perf_counter()
        try:
            rendered = render_prompt(row, self.processor)
        except DataError as exc:
            raise OrchestratorError(exc.problems) from exc
        body = generate_request(rendered.input_ids, rendered.images, n=n, temperature=temperature,
                                top_p=self.rl.top_p, top_k=self.rl.top_k,
                                max_tokens=self.rl.max_new_tokens, allowed=self.allowed,
                                seed=seed)
        reply, url = self.engines.generate(body)
        samples = [Sample.of_answer(rendered.input_ids, rendered.images, answer)
                   for answer in answers_of(reply, rendered.input_ids, url, row.source)]
        group = Group(position, row.source, samples, list(range(len(samples))))
        scoring = time.perf_counter()
        try:
            group.rewards = self.rewards.submit(self._reward_kwargs(row, samples)).result()
        except RewardFailure as failure:
            group.failure = f"{row.source}: {failure}"
        group.reward_s = time.perf_counter() - scoring
        group.seconds = time.perf_counter() - started
        return group

    def close(self) -> None:
        """Stop the reward processes."""
        self.rewards.close()
