"""Every user-facing error of vlmcp, under one base: `JobError`.

A `JobError` is a problem the user can fix (a job key, a data file or sample, a checkpoint
directory, a launcher setting). `problems` holds one line per problem, each naming what to fix;
the CLI prints each line as ``error: ...`` and exits 1. Anything else that escapes is a bug in
vlmcp and ends with its traceback.

`on_every_rank` marks the errors that every rank of a run raises together: the ranks agreed on
the outcome (`vlmcp.parallel.agree`), or each of them found the same problem before any
collective (a job key, the device). After one of those the process group can be torn down
cleanly; after any other, a rank may be failing alone and must not wait for its peers.

This module imports nothing of vlmcp, so every layer may import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar


class JobError(ValueError):
    """Base of every user-facing error: a job that cannot run as given.

    problems: one line, or a list of lines, each naming the key, file, sample or setting to fix
    (an empty list on the ranks that stay quiet while another rank reports).
    """

    on_every_rank: ClassVar[bool] = False

    def __init__(self, problems: str | Sequence[str] = ()):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(JobError):
    """Problems in the job's keys and values; each line names its key."""

    on_every_rank = True


class DataSpecError(JobError):
    """A `data.train` / `data.eval` value that does not describe files; each line names its config
    key (e.g. ``data.train[1].weight``)."""


class DataError(JobError):
    """A training sample or file that cannot be used; the message starts with its source label
    ("file:line", "file[index] (line N)", or the file alone)."""


class ProcessorError(JobError):
    """A checkpoint directory that cannot give a tokenizer and image processor."""


class VideoConfigError(JobError):
    """A video_preprocessor_config.json (or `data.video` value) vlmcp cannot follow."""


class ModelLoadError(JobError):
    """A checkpoint directory that vlmcp cannot train."""


class KernelError(JobError):
    """`model.deltanet_kernel` asks for a kernel this machine cannot run (the message leaves out
    the key's name)."""


class LoraError(JobError):
    """LoRA settings that cannot apply to the model; one line per problem."""


class DeviceError(JobError):
    """The environment asks for a device or backend this machine or vlmcp cannot use."""

    on_every_rank = True


class PreflightError(JobError):
    """Problems found before training; raised on every rank together (the lowest failing rank
    carries the lines, the others none)."""

    on_every_rank = True


class CheckpointError(JobError):
    """A checkpoint, export or output directory that cannot be written or read back; raised on
    every rank together."""

    on_every_rank = True


class NonFiniteError(JobError):
    """A non-finite step that `train.nonfinite` says must stop the run; raised on every rank
    together."""

    on_every_rank = True


class RolloutError(JobError):
    """A rollout step that cannot be trained (older than rollouts.max_staleness, a sample that
    cannot train, a malformed meta.json), or no step within rollouts.timeout_s; raised on every
    rank together."""

    on_every_rank = True


class EngineError(JobError):
    """An inference engine that cannot serve a published step (`vlmcp.engine`): unreachable, a
    step that is not (or no longer) published, another architecture, a reload that failed."""


class CollectiveError(JobError):
    """A torch.distributed collective that failed on this rank (a peer rank ended, was killed or
    lost its connection); raised by the rank that saw it, which exits without waiting for its
    peers."""


class OrchestratorError(JobError):
    """The RL loop's orchestrator cannot go on (`vlmcp rl`): a prompt that cannot be rendered, a
    reward function that raised or timed out under rl.on_reward_error "error", no engine left to
    generate, the trainer gone."""
