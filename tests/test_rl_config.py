"""The rl section of a job (`vlmcp rl`): one error per problem naming its key, the rules across
keys, and the trainer's view of an rl job (push targets and the staleness guard filled in)."""

from __future__ import annotations

import json

import pytest

from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.config.rl_checks import trainer_job
from vlmcp.errors import ConfigError

RL = {"model": {"path": "ckpt"}, "rollouts": {"dir": "runs/rl/rollouts"},
      "rl": {"prompts": "prompts.jsonl", "rewards": [{"function": "exact_match"}]}}


def _job(**sections):
    raw = {name: dict(value) for name, value in RL.items()}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _problems(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        job_from_dict(raw)
    return info.value.problems


def test_an_rl_job_loads_with_its_documented_defaults():
    job = job_from_dict(_job())
    assert (job.rl.group_size, job.rl.prompts_per_step, job.rl.advantage) == (8, 32, "grpo")
    assert job.rl.max_off_policy == 1 and job.rl.weights == "push" and job.rl.dynamic_sampling


def test_an_explicit_null_of_a_file_list_key_is_its_default_not_a_crash():
    job = job_from_dict({"model": {"path": "ckpt"}, "data": {"train": "t.jsonl", "eval": None},
                         "rl": {"prompts": None}})
    assert job.data.eval is None and not job.rl.enabled


def test_rl_keys_without_rl_prompts_are_each_named():
    raw = {"model": {"path": "ckpt"}, "data": {"train": "t.jsonl"},
           "rl": {"group_size": 4, "advantage": "rloo"}}
    assert _problems(raw) == [
        "config key 'rl.group_size' is set but neither 'rl.prompts' nor 'rl.environment' is",
        "config key 'rl.advantage' is set but neither 'rl.prompts' nor 'rl.environment' is"]


def test_every_bad_reward_entry_is_one_line_naming_its_index():
    raw = _job(rl={"rewards": [{"function": "exact_match", "weight": "x"},
                               {"function": "no_colon"}, {"weight": 1.0, "extra": 1}]})
    assert _problems(raw) == [
        "config key 'rl.rewards[0].weight': expected a finite number, got \"x\"",
        "config key 'rl.rewards[1].function': 'no_colon' is neither a built-in (exact_match, "
        "math) nor module:function (or path/to/file.py:function)",
        "unknown config key 'rl.rewards[2].extra'",
        "missing required config key 'rl.rewards[2].function'"]


def test_rl_cross_key_rules_name_both_keys():
    raw = _job(data={"train": "t.jsonl"}, rollouts={"dir": None},
               rl={"rewards": [], "eval_every": 5, "max_prompts_per_step": 4,
                   "prompts_per_step": 8, "weights": "files"},
               publish={"every": 2})
    problems = _problems(raw)
    assert "config key 'rl.rewards' is empty: name at least one reward function " \
           "(module:function, or a built-in: exact_match, math)" in problems
    assert any(p.startswith("the rl section needs 'rollouts.dir'") for p in problems)
    assert "config key 'rl.eval_every' is set but 'rl.eval_prompts' is not" in problems
    assert "config key 'rl.max_prompts_per_step' (4) is below 'rl.prompts_per_step' (8)" \
        in problems
    assert any(p.startswith("config key 'publish.every' is 2") for p in problems)


def test_the_weights_ways_need_their_publish_keys():
    assert any("'publish.dir' is not set" in p for p in _problems(_job(rl={"weights": "files"})))
    assert any("differs from 'rl.engines'" in p for p in _problems(
        _job(publish={"engines": ["http://a:1"]}, rl={"engines": ["http://b:1"]})))
    assert any("lora.r=8" in p for p in _problems(_job(lora={"r": 8})))
    assert any("'rollouts.max_staleness' (0) is below 'rl.max_off_policy' (1)" in p
               for p in _problems(_job(rollouts={"dir": "r", "max_staleness": 0})))


def test_an_environment_takes_the_place_of_prompts_and_rewards():
    env = {"model": {"path": "ckpt"}, "rollouts": {"dir": "r"},
           "rl": {"environment": {"id": "my_env", "args": {"max_turns": 3}}}}
    assert job_from_dict(env).rl.enabled
    both = {**env, "rl": {**env["rl"], "prompts": "p.jsonl",
                          "rewards": [{"function": "exact_match"}]}}
    assert _problems(both) == [
        "config key 'rl.prompts' is set with 'rl.environment', whose tasks and rubric take its "
        "place",
        "config key 'rl.rewards' is set with 'rl.environment', whose tasks and rubric take its "
        "place"]
    assert _problems({**env, "rl": {"environment": {"name": "x"}}}) == [
        "unknown config key 'rl.environment.name'",
        "config key 'rl.environment.id': expected an environment's id or the path of its "
        "module file"]


def test_push_keys_are_allowed_where_vlmcp_rl_fills_publish_engines():
    job = job_from_dict(_job(publish={"push_dtype": "bfloat16", "engine_pause": "keep"}))
    assert job.publish.engines == [] and job.publish.push_dtype == "bfloat16"


def test_the_trainers_view_pushes_into_the_engines_and_guards_the_pacing():
    job = job_from_dict(_job(rl={"max_off_policy": 2}))
    trainer = trainer_job(job, ["http://127.0.0.1:8000"])
    assert trainer.publish.engines == ["http://127.0.0.1:8000"]
    assert trainer.rollouts.max_staleness == 2 and job.publish.engines == []
    files = job_from_dict(_job(rl={"weights": "files"}, publish={"dir": "w"},
                               rollouts={"dir": "r", "max_staleness": 3}))
    assert trainer_job(files, ["http://e:1"]).publish.engines == []
    assert trainer_job(files, []).rollouts.max_staleness == 3


def test_vlmcp_train_refuses_an_rl_job_and_names_the_rl_command(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_job()))
    assert main(["train", str(path)]) == 1
    assert "train it with `vlmcp rl JOB.json`" in capsys.readouterr().err


def test_validate_checks_the_rl_prompts_and_rewards_one_line_per_problem(
        tiny_checkpoint, digits_jsonl, make_jsonl, tmp_path, capsys):
    """`vlmcp validate` renders every prompt and loads every reward before anything starts."""
    good = json.loads((digits_jsonl / "train.jsonl").read_text().splitlines()[0])
    good["images"] = [str(digits_jsonl / good["images"][0])]
    prompts = make_jsonl([good, {"text": "no prompt"}, {"question": "2+2?", "answer": "4"}],
                         name="prompts.jsonl")
    job = {"model": {"path": str(tiny_checkpoint)}, "data": {"max_seq_len": 256},
           "rollouts": {"dir": str(tmp_path / "rollouts")},
           "rl": {"prompts": str(prompts), "engines": ["http://127.0.0.1:9"],
                  "rewards": [{"function": "exact_match"},
                              {"function": "no_such_module_here:f"}]},
           "output_dir": str(tmp_path / "out")}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    assert main(["validate", str(path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {prompts}:2: no prompt: a prompt row has one of messages, conversations, "
        "prompt, question, problem (keys ['text'])",
        "error: rl.rewards: cannot load 'no_such_module_here:f': ModuleNotFoundError: No module "
        "named 'no_such_module_here'"]
