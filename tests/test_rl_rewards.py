"""Reward functions of `vlmcp rl` in their worker processes: TRL's signature with the row's
columns, the weighted sum (None counts 0), and every failure one `RewardFailure` naming the
function: one that raises (with its file:line), returns the wrong shape, hangs past its timeout
(its process killed, the next call served by a fresh one) or cannot be loaded."""

from __future__ import annotations

import time

import pytest

from vlmcp.errors import ConfigError
from vlmcp.rl.rewards import RewardFailure, RewardRunner, RewardSpec, load_reward, reward_specs

pytestmark = pytest.mark.e2e

MODULE = '''
import time

def length(prompts, completions, completion_ids, answer, **kwargs):
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    return [float(len(ids)) if a == "keep" else None for ids, a in zip(completion_ids, answer)]

def raises(prompts, completions, **kwargs):
    return [1 / 0 for _ in completions]

def wrong(prompts, completions, **kwargs):
    return [1.0]

def hangs(prompts, completions, answer, **kwargs):
    if answer[0] == "hang":
        time.sleep(600)
    return [0.5 for _ in completions]
'''


def _kwargs(answers=("keep", "keep", "drop")):
    return {"prompts": ["q"] * len(answers), "completions": ["a", "bb", "c"][:len(answers)],
            "completion_ids": [[1], [1, 2], [3]][:len(answers)], "answer": list(answers)}


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(MODULE)
    return path


def test_rewards_run_in_their_processes_with_weights_and_none_counting_zero(rewards_file):
    specs = reward_specs([{"function": f"{rewards_file.name}:length", "weight": 2.0},
                          {"function": "exact_match", "weight": 0.5}], rewards_file.parent)
    runner = RewardRunner(specs, workers=1, timeout_s=60)
    try:
        scored = runner.submit({**_kwargs(), "answer": ["keep", "keep", "c"]}).result()
    finally:
        runner.close()
    assert scored.per_function == {"length": [1.0, 2.0, None], "exact_match": [0.0, 0.0, 1.0]}
    assert scored.total == [2.0, 4.0, 0.5]


def test_each_failing_reward_is_one_failure_naming_the_function(rewards_file):
    specs = [RewardSpec(name, f"{rewards_file}:{name}", 1.0)
             for name in ("raises", "wrong", "hangs")]
    runner = RewardRunner(specs[:1], workers=1, timeout_s=60)
    with pytest.raises(RewardFailure) as info:
        runner.submit(_kwargs()).result()
    runner.close()
    assert info.value.function == "raises"
    assert "ZeroDivisionError: division by zero" in info.value.reason
    assert f"{rewards_file}:9)" in info.value.reason
    runner = RewardRunner(specs[1:2], workers=1, timeout_s=60)
    with pytest.raises(RewardFailure, match="returned list of 1, not a list of 3 rewards"):
        runner.submit(_kwargs()).result()
    runner.close()
    runner = RewardRunner([specs[2]], workers=1, timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(RewardFailure, match=r"timed out after 1 s \(rl.reward_timeout_s\)"):
            runner.submit(_kwargs(("hang", "keep", "keep"))).result()
        assert time.monotonic() - started < 30
        # the hung process was killed; a fresh one serves the next call
        assert runner.submit(_kwargs()).result().total == [0.5, 0.5, 0.5]
    finally:
        runner.close()


def test_a_reward_that_cannot_be_loaded_names_itself(tmp_path):
    with pytest.raises(ConfigError, match="cannot load 'nowhere.py:f': FileNotFoundError"):
        load_reward(RewardSpec("f", "nowhere.py:f", 1.0, str(tmp_path)))
    with pytest.raises(ConfigError, match="cannot load 'json:no_such': AttributeError"):
        load_reward(RewardSpec("no_such", "json:no_such", 1.0))
