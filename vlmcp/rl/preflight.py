"""What `vlmcp validate` checks of an rl job beyond its keys, before anything starts.

Every prompt row of rl.prompts and rl.eval_prompts is read and rendered as the orchestrator
renders it (a row that cannot be: one line naming its file:line), rl.environment is loaded with
its tasks, every reward function of rl.rewards is loaded (a module that does not import, a name it lacks, a built-in's missing
package), and the engine venv must exist when `vlmcp rl` is to start the engines. One line per
problem, as for the rest of the job.
"""

from __future__ import annotations

from vlmcp.config.schema import JobConfig
from vlmcp.data.processor import VLProcessor, load_processor
from vlmcp.data.sources import data_files
from vlmcp.engine.venv import engine_python, missing_engine, named_engine_python
from vlmcp.errors import ConfigError, DataError, JobError
from vlmcp.rl.prompts import read_prompts, render_prompt
from vlmcp.rl.rewards import load_reward, reward_specs


def _prompt_problems(job: JobConfig, processor: VLProcessor | None) -> list[str]:
    problems = []
    for key, spec in (("rl.prompts", job.rl.prompts), ("rl.eval_prompts", job.rl.eval_prompts)):
        if spec is None:
            continue
        paths = [job.resolve_input(f.path) for f in data_files(spec, key, weighted=False)]
        try:
            rows = read_prompts(paths)
        except DataError as exc:
            problems += exc.problems
            continue
        if processor is None:
            continue
        for row in rows:
            try:
                rendered = render_prompt(row, processor)
            except DataError as exc:
                problems += exc.problems
                continue
            if len(rendered.input_ids) + job.rl.max_new_tokens > job.data.max_seq_len:
                problems.append(f"{row.source}: the prompt's {len(rendered.input_ids)} tokens "
                                f"and rl.max_new_tokens={job.rl.max_new_tokens} exceed "
                                f"data.max_seq_len={job.data.max_seq_len}")
    return problems


def rl_problems_before_start(job: JobConfig) -> list[str]:
    """The problems of an rl job's prompts, rewards and engines (see the module docstring)."""
    try:
        processor = load_processor(job.resolve_input(job.model.path),
                                   job.data.chat_template_kwargs, job.data.empty_think)
    except (JobError, OSError, ValueError):
        processor = None  # the trainer's checks name the checkpoint's problem
    problems = _prompt_problems(job, processor)
    if job.rl.environment is not None:
        from vlmcp.rl.environments import load_environment

        try:
            load_environment(job)
        except ConfigError as exc:
            problems += exc.problems
    for spec in reward_specs(job.rl.rewards, job.job_dir):
        try:
            load_reward(spec)
        except ConfigError as exc:
            problems += exc.problems
    if not job.rl.engines and engine_python() is None:
        problems.append(f"rl.engines is empty, so vlmcp rl starts the engines, but "
                        f"{missing_engine(named_engine_python())}")
    return problems
