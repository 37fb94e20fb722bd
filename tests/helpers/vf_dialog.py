"""A multi-turn `verifiers` environment for the `vlmcp rl` tests, with its own dataset, rubric and
environment replies (verifiers 0.4's v1 API: a `Taskset` of tasks, a `Task` whose `@vf.reward`
is the rubric, an `Env` whose `run` is the protocol, and a `Harness` that plays the model's
side in this process, every model call through verifiers' interception endpoint).

The dialog: the task's prompt asks for a word, the environment answers every model turn with a
reply of its own ("Now say it again, shorter."), `turns` model turns in all (its config, 3 by
default; 1 is a single-turn environment). The reward is 1.0 when the last token the model
sampled is odd, else 0.0 (random on a random model: groups carry a signal).
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

REPLY = "Now say it again, shorter."


class DialogData(vf.TaskData):
    topic: str = ""


class DialogTask(vf.Task[DialogData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def odd_last_token(self, trace: vf.Trace) -> float:
        branch = trace.branches[-1]
        sampled = [t for t, m in zip(branch.token_ids, branch.sampled_mask) if m]
        return float(bool(sampled) and sampled[-1] % 2 == 1)


class DialogTaskset(vf.Taskset[DialogTask, vf.TasksetConfig]):
    def load(self):
        for i, topic in enumerate(("cats", "rivers", "numbers", "trees", "stars", "boats",
                                   "songs", "roads")):
            yield DialogTask(DialogData(id=str(i), prompt=f"Say a word about {topic}.",
                                        topic=topic), self.config.task)


class InProcessHarness(vf.Harness[vf.HarnessConfig]):
    """The model's side without a program: one chat request per segment to the interception
    endpoint, on the conversation so far."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str], data: vf.TaskData,
                     **kwargs: Any) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class DialogEnvConfig(vf.EnvConfig):
    #: The model's seat: the harness above, in a local runtime (no container, no tunnel).
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    #: Model turns per episode.
    turns: int = 3


class DialogEnv(vf.Env[DialogEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.turns - 1):
                if segment.terminated:
                    break
                segment = await chat.turn(REPLY)


__all__ = ["DialogTaskset", "InProcessHarness", "DialogEnv"]
