"""The job: one JSON file describes a whole training run.

    schema.py      the sections, their keys, defaults and help texts (`JobConfig`)
    checks.py      a raw job dict against the schema: types, ranges, rules across keys
    loss_checks.py the loss section: which option applies to which objective, its terms
    overrides.py   ``--set key.path=value``
    launch_env.py  what a launcher (accelerate) exported to the processes
    load.py        a job file -> a checked `JobConfig`

An unknown key, a value of the wrong type or a value out of range is a `ConfigError`
(`vlmcp.errors`) that names the full key path.
"""

from vlmcp.config.load import job_from_dict, load_job
from vlmcp.config.overrides import apply_overrides, parse_override
from vlmcp.config.schema import (DataSection, EvalSection, JobConfig, LoraSection, LossSection,
                                 LossTerm, ModelSection, OptimizerSection, ParallelSection,
                                 SchedulerSection, TrainSection, schema_fields)

__all__ = ["DataSection", "EvalSection", "JobConfig", "LoraSection", "LossSection", "LossTerm",
           "ModelSection", "OptimizerSection", "ParallelSection", "SchedulerSection", "TrainSection",
           "apply_overrides", "job_from_dict", "load_job", "parse_override", "schema_fields"]
