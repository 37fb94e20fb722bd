"""The online RL demo's orchestrator: its own inference (transformers), rewards, advantages, and
the rollout steps it writes for `vlmcp train` (the contract of docs/rl-loop.md).

Per rollout step N: the policy is the newest published `WEIGHTS/step_k` (k >= N - 2, waited for:
at most one step off-policy), loaded once into a transformers model and then reloaded from each
newer step's safetensors in place, as an inference engine reloads weights from disk. Each of
`prompts_per_step` digit prompts gets `group` answers sampled at temperature 1 from the full
distribution (no top-k or top-p; never the vision tokens, which would be image placeholders
without an image, nor the ids beyond the tokenizer's vocabulary), and each sampled token's
logprob is read from the generation scores.
The reward is 1 for an answer that is exactly the digit and <|im_end|>, else 0; the advantage of
an answer is group-relative, (reward - the group's mean) / its standard deviation, on every token
of the answer. Groups whose answers all got the same reward carry no signal: as in DAPO's dynamic
sampling they are left out, and further prompts are sampled (up to `MAX_ROUNDS` rounds of
`prompts_per_step`) until `prompts_per_step` groups carry one, so that every step trains on about
as many groups (a step that found none keeps its last round). Identical answers of one group are
written once, with their summed advantage scaled by (tokens written / tokens sampled): the
token-normalised loss of `policy_gradient` or `ppo_clip` (without a KL term) is then exactly that
of writing every sampled answer, for a fraction of the trainer's work. The step is written as one
tokens-format file with `advantages`, `old_logprobs` and `inference_logprobs` (both the sampled
tokens' logprobs) and `temperatures` (1), under a temporary name with its STABLE marker, then
renamed to step_N.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5ForConditionalGeneration

from vlmcp.data.formats import parse_record
from vlmcp.data.processor import VLProcessor
from vlmcp.data.rollouts import META, STABLE, step_dir
from vlmcp.training.evaluate import generation_prompt
from vlmcp.training.weights.hf_format import read_hf_weights
from vlmcp.training.weights.publish import published_steps

#: Answers are a digit and <|im_end|>.
MAX_NEW_TOKENS = 2
#: Rounds of prompts a step may sample to find its groups that carry a signal.
MAX_ROUNDS = 3
DATA_FILE = "rollouts.jsonl"


@dataclass
class DigitPrompt:
    """One digit question: its prompt tokens and pixels, the image path, the right answer."""

    input_ids: torch.Tensor          # [1, L]
    mm_token_type_ids: torch.Tensor  # [1, L]
    pixel_values: torch.Tensor       # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor     # [1, 3]
    image: str
    question: str                    # the user's text beside the image
    answer: list[int]                # the digit's token and <|im_end|>


def load_prompts(jsonl: Path, processor: VLProcessor) -> list[DigitPrompt]:
    """The digit prompts of a messages-format file (`vlmcp.demo.assets`), answers included."""
    prompts = []
    for number, text in enumerate(jsonl.read_text().splitlines(), start=1):
        record = json.loads(text)
        sample = parse_record(record, f"{jsonl}:{number}", jsonl.parent, processor, 10**6)
        prompt = generation_prompt(sample, MAX_NEW_TOKENS)
        question = record["messages"][0]["content"].replace("<image>", "")
        prompts.append(DigitPrompt(prompt.input_ids, prompt.mm_token_type_ids,
                                   prompt.pixel_values, prompt.image_grid_thw,
                                   sample.image_paths[0], question, prompt.reference))
    return prompts


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """(reward - mean) / population std of one prompt's group; all zero when the std is 0."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / std if std > 0 else 0.0 for r in rewards]


def _batch(prompts: Sequence[DigitPrompt], repeat: int) -> dict[str, torch.Tensor]:
    """generate's inputs for every prompt `repeat` times (the demo's prompts share one length)."""
    lengths = {p.input_ids.shape[1] for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"the digit prompts have {len(lengths)} lengths; they are batched unpadded")
    chosen = [p for p in prompts for _ in range(repeat)]
    ids = torch.cat([p.input_ids for p in chosen])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": torch.cat([p.mm_token_type_ids for p in chosen]),
            "pixel_values": torch.cat([p.pixel_values for p in chosen]),
            "image_grid_thw": torch.cat([p.image_grid_thw for p in chosen])}


def newest_published(weights: Path) -> int:
    """The newest complete step in the trainer's publish.dir `weights` (0: none yet)."""
    steps = published_steps(weights)
    return steps[0] if steps else 0


@dataclass
class Completion:
    """One sampled answer: its tokens (up to and including <|im_end|>), their logprobs, and the
    policy version that sampled them."""

    tokens: list[int]
    logprobs: list[float]
    version: int


class Policy:
    """The orchestrator's inference engine: a transformers model at one policy version."""

    def __init__(self, model_dir: Path, processor: VLProcessor):
        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()
        self.version = 0
        config = self.model.config
        self.eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        #: Never sampled: the vision tokens, and the ids the model's vocabulary has beyond the
        #: tokenizer's (no text, and no training sample may hold them).
        self.never = [config.image_token_id, config.video_token_id, config.vision_start_token_id,
                      config.vision_end_token_id,
                      *range(len(processor.tokenizer), config.get_text_config().vocab_size)]

    def newest_available(self, weights: Path) -> int:
        """The newest policy version it can serve: the newest step published in `weights`."""
        return newest_published(weights)

    def reload(self, published: Path, version: int) -> None:
        """Load the weights of WEIGHTS/step_`version` (one file or rank shards) into the running
        model."""
        self.model.load_state_dict(read_hf_weights(published), strict=True)
        self.version = version

    @torch.no_grad()
    def sample(self, prompts: Sequence[DigitPrompt], group: int, seed: int
               ) -> list[list[Completion]]:
        """`group` answers per prompt at temperature 1, with each token's logprob from the
        generation scores (the distribution it was sampled from)."""
        torch.manual_seed(seed)
        out = self.model.generate(**_batch(prompts, group), max_new_tokens=MAX_NEW_TOKENS,
                                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  suppress_tokens=self.never, output_scores=True,
                                  return_dict_in_generate=True)
        generated = out.sequences[:, -len(out.scores):]
        logprobs = torch.stack([torch.log_softmax(score.float(), dim=-1).gather(
            1, generated[:, i:i + 1])[:, 0] for i, score in enumerate(out.scores)], dim=1)
        completions = []
        for tokens, values in zip(generated.tolist(), logprobs.tolist()):
            end = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
            completions.append(Completion(tokens[:end], values[:end], self.version))
        return [completions[i * group:(i + 1) * group] for i in range(len(prompts))]

    @torch.no_grad()
    def accuracy(self, prompts: Sequence[DigitPrompt], batch: int = 128) -> float:
        """The fraction of `prompts` whose greedy answer is exactly the right one."""
        right = 0
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            out = self.model.generate(**_batch(chunk, 1), max_new_tokens=MAX_NEW_TOKENS,
                                      do_sample=False)
            answers = out[:, -MAX_NEW_TOKENS:].tolist()
            right += sum(a[:len(p.answer)] == p.answer for a, p in zip(answers, chunk))
        return right / len(prompts)

def rollout_line(prompt: DigitPrompt, completion: Completion, advantage: float
                 ) -> dict[str, Any]:
    """The tokens-format line of one answer: targets on the answer only, its per-token arrays
    aligned with the labels (null on the prompt), and the version of its tokens as one span
    (`vlmcp.data.policy_versions`)."""
    prompt_ids = prompt.input_ids[0].tolist()
    off = [None] * len(prompt_ids)
    return {
        "input_ids": prompt_ids + completion.tokens,
        "labels": [-100] * len(prompt_ids) + completion.tokens,
        "images": [prompt.image],
        "advantages": off + [advantage] * len(completion.tokens),
        "old_logprobs": off + completion.logprobs,
        "inference_logprobs": off + completion.logprobs,
        "temperatures": off + [1.0] * len(completion.tokens),
        "policy_versions": [{"version": completion.version, "start": len(prompt_ids),
                             "end": len(prompt_ids) + len(completion.tokens)}],
    }


def write_step(rollouts: Path, number: int, lines: Sequence[dict], policy_step: int) -> Path:
    """ROLLOUTS/step_`number`: written under a temporary name, STABLE last, renamed into place."""
    final = step_dir(rollouts, number)
    tmp = rollouts / f".writing-{final.name}"
    tmp.mkdir(parents=True)
    (tmp / DATA_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp / META).write_text(json.dumps({"policy_step": policy_step}))
    (tmp / STABLE).write_text("")
    os.rename(tmp, final)
    return final


@dataclass
class StepReport:
    """What the orchestrator did for one rollout step."""

    step: int
    policy_step: int
    reward: float
    prompts: int
    groups_kept: int
    lines: int
    generate_s: float
    wait_s: float
    reload_s: float


class Orchestrator:
    """Writes rollout step after rollout step from the newest published weights."""

    def __init__(self, policy: Policy, prompts: Sequence[DigitPrompt], rollouts: Path,
                 weights: Path, *, prompts_per_step: int, group: int):
        self.policy, self.prompts = policy, list(prompts)
        self.rollouts, self.weights = rollouts, weights
        self.prompts_per_step, self.group = prompts_per_step, group
        self.next_prompt = 0
        self.reload_s = 0.0

    def newest_policy(self, at_least: int, alive: Callable[[], bool],
                      poll_s: float = 0.05) -> bool:
        """Wait until the policy can serve step `at_least` or newer (0: the starting policy:
        published, or pushed into its engine) and take the newest; raises RuntimeError when
        `alive()` turns false first. Returns whether the served version changed."""
        while True:
            newest = self.policy.newest_available(self.weights)
            if newest >= at_least:
                if newest == self.policy.version:
                    return False
                started = time.perf_counter()
                self.policy.reload(self.weights / f"step_{newest}", newest)
                self.reload_s = time.perf_counter() - started
                return True
            if not alive():
                raise RuntimeError(f"the trainer stopped before publishing step {at_least}")
            time.sleep(poll_s)

    def _round(self, number: int, round_: int
               ) -> tuple[list[DigitPrompt], list[list[Completion]], list[list[float]]]:
        """The next `prompts_per_step` prompts, `group` answers each, and their rewards."""
        chosen = [self.prompts[(self.next_prompt + i) % len(self.prompts)]
                  for i in range(self.prompts_per_step)]
        self.next_prompt += self.prompts_per_step
        answers = self.policy.sample(chosen, self.group, seed=number * MAX_ROUNDS + round_)
        rewards = [[float(c.tokens == p.answer) for c in group]
                   for p, group in zip(chosen, answers)]
        return chosen, answers, rewards

    def step(self, number: int, alive: Callable[[], bool],
             on_new_policy: Callable[[Policy], None]) -> StepReport:
        """Generate and write rollout step `number`, at most one step off-policy."""
        started = time.perf_counter()
        self.reload_s = 0.0
        changed = self.newest_policy(max(number - 2, 0), alive)
        reloaded = self.reload_s
        waited = time.perf_counter() - started - reloaded
        if changed:
            on_new_policy(self.policy)
        started = time.perf_counter()
        groups: list[tuple[DigitPrompt, list[Completion], list[float]]] = []
        all_rewards: list[float] = []
        for round_ in range(MAX_ROUNDS):
            chosen, answers, rewards = self._round(number, round_)
            all_rewards += [r for group in rewards for r in group]
            groups += [(p, a, r) for p, a, r in zip(chosen, answers, rewards) if len(set(r)) > 1]
            if len(groups) >= self.prompts_per_step:
                break
        groups = groups[:self.prompts_per_step] or list(zip(chosen, answers, rewards))
        distinct = [_distinct(answers, group_advantages(rewards)) for _, answers, rewards in groups]
        sampled = sum(len(c.tokens) for _, answers, _ in groups for c in answers)
        written = sum(len(c.tokens) for group in distinct for c, _ in group)
        lines = [rollout_line(prompt, completion, advantage * written / sampled)
                 for (prompt, _, _), group in zip(groups, distinct)
                 for completion, advantage in group]
        write_step(self.rollouts, number, lines, self.policy.version)
        return StepReport(number, self.policy.version, statistics.fmean(all_rewards),
                          len(all_rewards) // self.group, len(groups), len(lines),
                          time.perf_counter() - started, waited, reloaded)


def _distinct(answers: Sequence[Completion], advantages: Sequence[float]
              ) -> list[tuple[Completion, float]]:
    """One (answer, summed advantage) per distinct answer of a group, in first-seen order
    (identical answers got the same reward, so their advantages share a sign)."""
    merged: dict[tuple[int, ...], list[Any]] = {}
    for completion, advantage in zip(answers, advantages):
        merged.setdefault(tuple(completion.tokens), [completion, 0.0])[1] += advantage
    return [(completion, advantage) for completion, advantage in merged.values()]
