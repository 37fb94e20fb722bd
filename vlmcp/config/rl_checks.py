"""The `rl` section (`vlmcp rl`): its rules across keys, and the trainer's job it implies.

`vlmcp rl` runs the orchestrator beside `vlmcp train`; both read the same job. The section is on
when `rl.prompts` is set; then the orchestrator writes the rollout steps into `rollouts.dir` and
the weights come back through `publish.engines` (`rl.weights` "push": the engines generating are
the ones pushed into) or `publish.dir` (`rl.weights` "files": the orchestrator reloads each
published step into the engines). `trainer_job` is the trainer's view of such a job: the push
targets and the staleness bound filled in from the section, so that `vlmcp rl --part trainer`
under any launcher trains exactly what `vlmcp rl` would.

Every problem is one line naming its key, as in `vlmcp.config.checks`.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import fields
from typing import Any

from vlmcp.config.schema import BUILTIN_REWARDS, JobConfig, RlSection
from vlmcp.data.sources import required_string_problem

#: The objectives whose token loss is linear in the advantage for a given token (the same sign for
#: identical answers): merging identical answers keeps their loss exactly.
MERGE_EXACT_TYPES = ("policy_gradient", "ppo_clip")
#: The keys of one `rl.rewards` entry.
REWARD_KEYS = ("function", "weight")
#: The `rl` keys that only apply to the engines `vlmcp rl` starts itself.
_STARTED_ENGINE_KEYS = ("num_engines", "engine_args", "engine_start_timeout_s")


def reward_entry_problems(index: int, entry: Any) -> list[str]:
    """Problems of `rl.rewards[index]`: an object with a `function` (a built-in name, or
    `module:function` / `file.py:function`) and an optional finite `weight`."""
    key = f"rl.rewards[{index}]"
    if not isinstance(entry, dict):
        return [f"config key '{key}': expected an object {{\"function\": ..., \"weight\": ...}}, "
                f"got {json.dumps(entry)}"]
    problems = [f"unknown config key '{key}.{name}'" for name in entry if name not in REWARD_KEYS]
    function = entry.get("function")
    problem = required_string_problem(entry, "function", key)
    if problem:
        problems.append(problem)
    elif function not in BUILTIN_REWARDS and function.count(":") != 1:
        problems.append(f"config key '{key}.function': {function!r} is neither a built-in "
                        f"({', '.join(BUILTIN_REWARDS)}) nor module:function (or "
                        "path/to/file.py:function)")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not math.isfinite(weight):
        problems.append(f"config key '{key}.weight': expected a finite number, got "
                        f"{json.dumps(weight)}")
    return problems


def _changed(section: RlSection, names: tuple[str, ...] | None = None) -> list[str]:
    default = RlSection()
    return [f.name for f in fields(section) if (names is None or f.name in names)
            and getattr(section, f.name) != getattr(default, f.name)]


def rl_problems(job: JobConfig) -> list[str]:
    """The `rl` section's rules; none when it is off (and nothing of it is set)."""
    rl = job.rl
    if not rl.enabled:
        return [f"config key 'rl.{name}' is set but neither 'rl.prompts' nor 'rl.environment' is"
                for name in _changed(rl)]
    problems = _source_problems(rl)
    if not job.rollouts.dir:
        problems.append("the rl section needs 'rollouts.dir': the orchestrator writes the "
                        "rollout steps there and the trainer reads them")
    if rl.eval_every and rl.eval_prompts is None:
        problems.append("config key 'rl.eval_every' is set but 'rl.eval_prompts' is not")
    if rl.eval_prompts is not None and not rl.eval_every:
        problems.append("config key 'rl.eval_prompts' is set but 'rl.eval_every' is 0, so no "
                        "evaluation runs")
    if rl.eval_max_prompts is not None and rl.eval_prompts is None:
        problems.append("config key 'rl.eval_max_prompts' is set but 'rl.eval_prompts' is not")
    if rl.max_prompts_per_step is not None:
        if not rl.dynamic_sampling:
            problems.append("config key 'rl.max_prompts_per_step' is set but "
                            "'rl.dynamic_sampling' is false: every step samples exactly "
                            "rl.prompts_per_step prompts")
        elif rl.max_prompts_per_step < rl.prompts_per_step:
            problems.append(f"config key 'rl.max_prompts_per_step' ({rl.max_prompts_per_step}) "
                            f"is below 'rl.prompts_per_step' ({rl.prompts_per_step})")
    if rl.engines:
        problems += [f"config key 'rl.{name}' is set but 'rl.engines' names running servers: "
                     "it applies to the engines `vlmcp rl` starts"
                     for name in _changed(rl, _STARTED_ENGINE_KEYS)]
    if rl.merge_identical_answers and (job.loss.terms or job.loss.normalize != "token" or
                                       job.loss.type not in MERGE_EXACT_TYPES):
        problems.append("config key 'rl.merge_identical_answers' needs one loss.type of "
                        f"{', '.join(MERGE_EXACT_TYPES)} with loss.normalize \"token\" (no "
                        "loss.terms): only there is a merged answer's loss exactly its copies' "
                        f"(loss.type {job.loss.type!r}, normalize {job.loss.normalize!r})")
    problems += _weights_problems(job)
    staleness = job.rollouts.max_staleness
    if staleness is not None and staleness < rl.max_off_policy:
        problems.append(f"config key 'rollouts.max_staleness' ({staleness}) is below "
                        f"'rl.max_off_policy' ({rl.max_off_policy}): the trainer would refuse "
                        "the steps the orchestrator paces to")
    return problems


def _source_problems(rl: RlSection) -> list[str]:
    """Where the prompts and rewards come from: rl.prompts with rl.rewards, or rl.environment
    (its tasks and its rubric) alone."""
    if rl.environment is None:
        problems = [problem for i, entry in enumerate(rl.rewards)
                    for problem in reward_entry_problems(i, entry)]
        if not rl.rewards:
            problems.append("config key 'rl.rewards' is empty: name at least one reward "
                            f"function (module:function, or a built-in: "
                            f"{', '.join(BUILTIN_REWARDS)})")
        return problems
    problems = [f"unknown config key 'rl.environment.{name}'"
                for name in rl.environment if name not in ("id", "args")]
    if not isinstance(rl.environment.get("id"), str) or not rl.environment.get("id"):
        problems.append("config key 'rl.environment.id': expected an environment's id or the "
                        "path of its module file")
    if not isinstance(rl.environment.get("args", {}), dict):
        problems.append("config key 'rl.environment.args': expected an object (the "
                        "environment's config fields)")
    problems += [f"config key 'rl.{name}' is set with 'rl.environment', whose tasks and rubric "
                 "take its place" for name in ("prompts", "rewards", "eval_prompts")
                 if getattr(rl, name)]
    return problems


def _weights_problems(job: JobConfig) -> list[str]:
    """`rl.weights` against the publish section and LoRA."""
    rl, publish = job.rl, job.publish
    problems = [f"config key 'publish.{key}' is {value} but the orchestrator paces every step "
                "by the step before it: the rl section needs every step's weights (1)"
                for key, value in (("every", publish.every), ("dir_every", publish.dir_every))
                if value not in (None, 1)]
    if problems:
        return problems
    if job.lora.r:
        return [f"config key 'rl.prompts' with lora.r={job.lora.r}: the orchestrator serves full "
                "weights (a push, or a reload of publish.dir); it does not load PEFT adapters "
                "into the engines"]
    if rl.weights == "files":
        problems = []
        if not publish.dir:
            problems.append("config key 'rl.weights' is \"files\" but 'publish.dir' is not set: "
                            "the orchestrator reloads each published step from there")
        if publish.engines:
            problems.append("config key 'publish.engines' is set but 'rl.weights' is \"files\": "
                            "the steps reach the engines as files; use rl.weights \"push\"")
        return problems
    if publish.engines and [u.rstrip("/") for u in publish.engines] != \
            [u.rstrip("/") for u in rl.engines]:
        return ["config key 'publish.engines' differs from 'rl.engines': with rl.weights "
                "\"push\" the trainer pushes into the engines that generate; leave "
                "publish.engines empty (vlmcp rl fills it in)"]
    return []


def trainer_job(job: JobConfig, engines: list[str]) -> JobConfig:
    """The trainer's view of an `rl` job whose engines are at `engines` (base URLs): with
    rl.weights "push" they are publish.engines; rollouts.max_staleness is rl.max_off_policy when
    the job leaves it unset (the trainer's own guard of the pacing)."""
    trainer = copy.deepcopy(job)
    if job.rl.weights == "push":
        trainer.publish.engines = list(engines)
    if trainer.rollouts.max_staleness is None:
        trainer.rollouts.max_staleness = job.rl.max_off_policy
    return trainer
