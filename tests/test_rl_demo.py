"""The online RL demo's orchestrator, in this process: group-relative advantages; the sampled
tokens' logprobs read from the generation scores equal plain transformers' log_softmax of those
tokens; a written rollout step is complete (renamed into place with STABLE), holds only the
informative groups, and loads as training samples with targets on the answers only and their
per-token arrays; a reloaded policy generates from the published weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForConditionalGeneration

from tests.helpers.parity import assert_within_fp32_error, float64_reference
from vlmcp.data.dataset import load_samples
from vlmcp.data.rollouts import STABLE, is_complete, read_meta, step_dir
from vlmcp.demo.orchestrator import (DATA_FILE, Orchestrator, Policy, group_advantages,
                                     load_prompts)


def test_group_advantages_are_standardised_rewards():
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([3**0.5, -(3**-0.5)] + [-(3**-0.5)] * 2)
    assert group_advantages([0.0, 0.0]) == [0.0, 0.0]


@pytest.fixture
def prompts(digits_jsonl, tiny_processor):
    return load_prompts(digits_jsonl / "eval.jsonl", tiny_processor)


def _sampled_logprobs(model, prompt, completion, never) -> torch.Tensor:
    """[tokens] plain log_softmax of the sampled tokens, one forward of prompt + completion."""
    ids = torch.cat([prompt.input_ids, torch.tensor([completion.tokens])], dim=1)
    mm = torch.cat([prompt.mm_token_type_ids, torch.zeros_like(ids[:, prompt.input_ids.shape[1]:])], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=mm, pixel_values=prompt.pixel_values,
                       image_grid_thw=prompt.image_grid_thw, use_cache=False).logits[0]
    start = prompt.input_ids.shape[1] - 1
    logits = logits[start:start + len(completion.tokens)].clone()
    logits[:, never] = float("-inf")  # what the sampling distribution excludes
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.tokens)[:, None])[:, 0]


def test_sampled_token_logprobs_are_plain_log_softmax_of_the_sampled_tokens(
        tiny_checkpoint, tiny_processor, prompts):
    """Held to the float64 forward with fp32's own error (the fp32 forward's distance from it)
    as the allowance: generation's cached steps sum in another order than one whole forward."""
    policy = Policy(tiny_checkpoint, tiny_processor)
    answers = policy.sample(prompts[:3], group=4, seed=0)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_checkpoint),
                                                            dtype=torch.float32).eval()
    assert [len(group) for group in answers] == [4, 4, 4]
    for prompt, group in zip(prompts[:3], answers):
        for completion in group:
            assert 1 <= len(completion.tokens) <= 2 and len(completion.logprobs) == len(completion.tokens)
            assert not set(completion.tokens) & set(policy.never)
            want32 = _sampled_logprobs(model, prompt, completion, policy.never)
            want64 = float64_reference(_sampled_logprobs, model, prompt, completion, policy.never)
            assert_within_fp32_error(torch.tensor(completion.logprobs), want32, want64,
                                     at_least=1e-5, name="sampled logprobs")


def test_a_rollout_step_is_renamed_into_place_complete_and_loads_as_training_samples(
        tiny_checkpoint, tiny_processor, prompts, tmp_path):
    rollouts, weights = tmp_path / "rollouts", tmp_path / "weights"
    orchestrator = Orchestrator(Policy(tiny_checkpoint, tiny_processor), prompts, rollouts,
                                weights, prompts_per_step=6, group=8)
    report = orchestrator.step(1, alive=lambda: True, on_new_policy=lambda policy: None)
    step = step_dir(rollouts, 1)
    assert is_complete(step) and sorted(p.name for p in rollouts.iterdir()) == ["step_1"]
    assert read_meta(step).policy_step == 0 and report.policy_step == 0
    samples = load_samples(step / DATA_FILE, tiny_processor, max_seq_len=512)
    lines = [json.loads(text) for text in (step / DATA_FILE).read_text().splitlines()]
    assert len(samples) == len(lines) == report.lines
    groups: dict[str, list[dict]] = {}
    for sample, line in zip(samples, lines):
        answer = [t for t, label in enumerate(sample.labels) if label != -100]
        assert answer == list(range(len(sample.labels) - len(answer), len(sample.labels)))
        assert set(sample.token_arrays) == {"advantages", "old_logprobs", "inference_logprobs",
                                            "temperatures"}
        assert line["old_logprobs"] == line["inference_logprobs"]
        groups.setdefault(line["images"][0], []).append(line)
    assert len(groups) == report.groups_kept
    for group in groups.values():
        # distinct answers of one prompt, their advantages zero-sum; all zero only when no
        # group carried a signal (then every group is kept)
        answers = [tuple(line["input_ids"][-2:]) for line in group]
        assert len(set(answers)) == len(answers)
        advantages = [line["advantages"][-1] for line in group]
        assert abs(sum(advantages)) < 1e-9
        assert any(a != 0 for a in advantages) or report.groups_kept == 6


def test_a_reloaded_policy_generates_from_the_published_weights(tiny_checkpoint, tiny_processor,
                                                                prompts, tmp_path):
    policy = Policy(tiny_checkpoint, tiny_processor)
    published = tmp_path / "step_3"
    published.mkdir()
    state = {k: torch.zeros_like(v) if k == "lm_head.weight" else v
             for k, v in policy.model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, published / "model.safetensors")
    (published / STABLE).write_text("")
    policy.reload(published, 3)
    assert policy.version == 3 and float(policy.model.lm_head.weight.detach().abs().max()) == 0.0
    # Zero logits: greedy answers the first token of the vocabulary, never a digit.
    assert policy.accuracy(prompts[:4]) == 0.0
