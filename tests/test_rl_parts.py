"""The orchestrator's pieces of `vlmcp rl`, in this process: prompt rows of every format, rendered
exactly as training renders the same conversation; the seeded prompt stream; the advantage
estimators' definitions; a rollout line that loads as the training sample it stands for; the
resume point read back from the written steps; the built-in rewards."""

from __future__ import annotations

import json
import random
import struct
from fractions import Fraction

import pytest

from vlmcp.data.dataset import load_samples
from vlmcp.data.formats import parse_record
from vlmcp.data.policy_versions import token_versions
from vlmcp.errors import DataError, OrchestratorError
from vlmcp.rl.advantages import carries_signal, group_advantages
from vlmcp.rl.builtin_rewards import exact_match, math
from vlmcp.rl.prompts import PromptStream, read_prompts, render_prompt
from vlmcp.rl.steps import (Answer, Sample, StepRecord, resume_point, rollout_line,
                            write_step)
from vlmcp.training.evaluate import generation_prompt


def test_prompt_rows_of_every_format_give_messages_answer_and_columns(make_jsonl, digits_jsonl):
    image = str(digits_jsonl / json.loads((digits_jsonl / "train.jsonl").read_text()
                                          .splitlines()[0])["images"][0])
    path = make_jsonl([
        {"messages": [{"role": "user", "content": "<image>Which?"},
                      {"role": "assistant", "content": "7"}], "images": [image], "task": "d"},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
        {"prompt": "2+2?", "answer": "4", "info": {"level": 1}},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "3+3?"}], "answer": "6"},
        {"question": "1+1?", "answer": "2"},
    ])
    rows = read_prompts([path])
    assert [r.columns for r in rows] == [{"task": "d", "answer": "7"}, {"answer": "Yo"},
                                         {"answer": "4", "info": {"level": 1}}, {"answer": "6"},
                                         {"question": "1+1?", "answer": "2"}]
    assert [r.conversational for r in rows] == [True, True, False, True, False]
    assert rows[0].messages == [{"role": "user", "content": "<image>Which?"}]
    assert [str(p) for p in rows[0].images] == [image]
    assert rows[2].reward_prompt() == "2+2?" and rows[3].reward_prompt()[0]["role"] == "system"
    assert [r.source for r in rows] == [f"{path}:{i}" for i in range(1, 6)]


def test_every_bad_prompt_row_is_one_error_naming_its_line(make_jsonl):
    path = make_jsonl([{"text": "no prompt"}, {"prompt": ""}, "{broken",
                       {"messages": [{"role": "assistant", "content": "only an answer"}]}])
    with pytest.raises(DataError) as info:
        read_prompts([path])
    assert [p.split(":")[1] for p in info.value.problems] == ["1", "2", "3", "4"]
    assert "no prompt" in info.value.problems[0]


def test_a_rendered_prompt_is_trainings_own_prompt_before_the_answer(digits_jsonl,
                                                                     tiny_processor):
    """The prompt the engine gets, followed by the answer, is what training tokenizes for the
    whole conversation: the same ids, the answer's tokens the targets."""
    path = digits_jsonl / "train.jsonl"
    records = [json.loads(t) for t in path.read_text().splitlines()[:4]]
    for row, record in zip(read_prompts([path]), records):
        rendered = render_prompt(row, tiny_processor)
        sample = parse_record(record, row.source, digits_jsonl, tiny_processor, 10**6)
        assert rendered.input_ids == generation_prompt(sample, 4).input_ids[0].tolist()
        targets = [t for t, label in zip(sample.input_ids, sample.labels) if label != -100]
        assert sample.input_ids[:len(rendered.input_ids)] == rendered.input_ids
        assert sample.input_ids[len(rendered.input_ids):][:len(targets)] == targets


def test_the_prompt_stream_is_a_seeded_permutation_of_the_rows_every_epoch():
    stream = PromptStream(7, seed=3)
    first, second = [stream.at(p) for p in range(7)], [stream.at(p) for p in range(7, 14)]
    assert sorted(first) == sorted(second) == list(range(7)) and first != second
    assert [PromptStream(7, seed=3).at(p) for p in range(14)] == first + second
    assert [PromptStream(7, seed=4).at(p) for p in range(7)] != first
    assert PromptStream(7, seed=3).at(12) == second[5]  # any position, in any order


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_follow_each_estimators_definition(estimator):
    rng = random.Random(0)
    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.5, 0.25, 2.0], [rng.random() for _ in range(16)]):
        exact = [Fraction(r) for r in rewards]
        g, mean = len(exact), sum(exact) / len(exact)
        if estimator == "dr_grpo":
            want = [float(r - mean) for r in exact]
        elif estimator == "rloo":
            want = [float(r - (sum(exact) - r) / (g - 1)) for r in exact]
        else:
            std = float(sum((r - mean) ** 2 for r in exact) / (g - 1)) ** 0.5
            want = [float(r - mean) / (std + 1e-6) for r in exact]
        assert group_advantages(rewards, estimator) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert group_advantages([0.5] * 4, estimator) == [0.0] * 4
    assert not carries_signal([0.5] * 4) and carries_signal([0.5, 0.5, 1.0])


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def test_a_rollout_line_loads_as_the_training_sample_it_stands_for(digits_jsonl, tiny_processor,
                                                                   tmp_path):
    row = read_prompts([digits_jsonl / "train.jsonl"])[0]
    rendered = render_prompt(row, tiny_processor)
    answer = Answer([40, 41, 2], [-0.5, -1.25, -0.1], [3, 3, 4], truncated=False)
    line = rollout_line(Sample.of_answer(rendered.input_ids, rendered.images, answer), 0.75, 0.8)
    (tmp_path / "step.jsonl").write_text(json.dumps(line) + "\n")
    (sample,) = load_samples(tmp_path / "step.jsonl", tiny_processor, max_seq_len=256)
    prompt = len(rendered.input_ids)
    assert sample.input_ids == rendered.input_ids + [40, 41, 2]
    assert sample.labels == [-100] * prompt + [40, 41, 2]
    arrays = {name: values[prompt:].tolist() for name, values in sample.token_arrays.items()}
    # fp32 in training: the values exactly as float32 holds them
    assert arrays == {"advantages": [0.75] * 3, "old_logprobs": [-0.5, -1.25, _f32(-0.1)],
                      "inference_logprobs": [-0.5, -1.25, _f32(-0.1)],
                      "temperatures": [_f32(0.8)] * 3}
    assert token_versions(line["policy_versions"], len(line["input_ids"]), "line")[prompt:] \
        == [3, 3, 4]
    assert [str(p) for p in sample.image_paths] == [str(rendered.images[0].resolve())]


def test_the_resume_point_is_where_the_newest_written_step_ended(tmp_path):
    rollouts = tmp_path / "rollouts"
    assert resume_point(rollouts, resume=False).step == 1
    line = {"input_ids": [1, 2], "labels": [-100, 2]}
    write_step(rollouts, 1, [line], StepRecord(0, 0, 5, [0, 1, 2, 3, 4], [0, 1], [2, 3], [4]))
    write_step(rollouts, 2, [line], StepRecord(1, 5, 9, [5, 6, 7, 8], [5, 6, 7, 8]))
    (rollouts / ".tmp-step_3").mkdir()
    point = resume_point(rollouts, resume=True)
    assert (point.step, point.position) == (3, 9) and not (rollouts / ".tmp-step_3").exists()
    meta = json.loads((rollouts / "step_1" / "meta.json").read_text())
    assert meta["prompt_position"] == [0, 5] and meta["dropped"] == [2, 3]
    with pytest.raises(OrchestratorError, match="train.resume is false"):
        resume_point(rollouts, resume=False)
    (rollouts / "step_2").rename(rollouts / "step_4")
    with pytest.raises(OrchestratorError, match="without a gap"):
        resume_point(rollouts, resume=True)


def test_the_builtin_rewards_compare_with_the_answer_column():
    assert exact_match(["q"] * 3, [" 7\n", "8", [{"role": "assistant", "content": "7"}]],
                       answer=["7"] * 3) == [1.0, 0.0, 1.0]
    assert math(["q"] * 3, ["The answer is $\\frac{1}{2}$", "0.5", "1/3"],
                answer=["0.5"] * 3) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="\"answer\" column"):
        exact_match(["q"], ["7"], solution=["7"])
