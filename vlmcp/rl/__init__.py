"""`vlmcp rl`: the orchestrator of the whole online RL loop, beside the trainer.

It speaks to the trainer only through the rollout-step contract (`vlmcp.data.rollouts`; it writes
ROLLOUTS/step_N) and the policy versions the engines report, so another trainer can take vlmcp's
place. `orchestrator` is the loop (pacing, sampling, writing, evaluation) over `prompts`,
`engines` and `generation`, `rewards` (and `builtin_rewards`), `advantages`, `steps` and
`step_metrics`; `parts` builds the engines and the orchestrator, `launch` starts every part on one
host, `preflight` is what `vlmcp validate` checks of the rl section.
"""
