"""The RL demo's data: every prompt's candidate answers as tokens-format lines whose advantages
are group-relative (zero-mean over the group, +/- by correctness) on the answer's tokens, the
closing <|im_end|> only when positive; the lines load as policy-gradient samples; the choice
accuracy picks each prompt's highest-logprob answer."""

from __future__ import annotations

import json

import pytest

from vlmcp.data.dataset import load_samples
from vlmcp.demo.rl import choice_accuracy, group_advantages, write_rl_dataset


def test_group_advantages_are_standardised_rewards():
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([3**0.5, -(3**-0.5)] + [-(3**-0.5)] * 2)
    assert group_advantages([0.0, 0.0]) == [0.0, 0.0]


def test_rl_lines_carry_group_relative_advantages_on_answer_tokens(digits_jsonl, tiny_checkpoint,
                                                                   tiny_processor, tmp_path):
    records = [json.loads(line) for line in (digits_jsonl / "train.jsonl").read_text().splitlines()[:3]]
    for record in records:
        record["images"] = [str(digits_jsonl / p) for p in record["images"]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "rl.jsonl"
    meta = write_rl_dataset(prompts, tiny_checkpoint, out, candidates=4, shuffle=False)
    assert len(meta) == 12 and {m[0] for m in meta} == {1, 2, 3}
    samples = load_samples(out, tiny_processor, max_seq_len=512)
    for (prompt, answer, correct), sample in zip(meta, samples):
        targets = [t for t, label in enumerate(sample.labels) if label != -100]
        advantages = sample.token_arrays["advantages"][targets].tolist()
        expected = 3**0.5 if answer == correct else -(3**-0.5)
        assert advantages[:-1] == pytest.approx([expected] * (len(targets) - 1))
        assert advantages[-1] == pytest.approx(max(expected, 0.0))
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(
        json.dumps({"index": i, "logprobs": [-0.1, -1.0] if i in (0, 4, 9) else [-5.0, -1.0]}) + "\n"
        for i in range(12)))
    # prompts 1 and 2 rank their correct answer (listed first) highest, prompt 3 a wrong one
    assert choice_accuracy(meta, scores) == pytest.approx(2 / 3)
