"""Engine clients: load each published WEIGHTS/step_N into a running inference engine.

`client.EngineClient` is the interface (serve a published step, report the policy version it
serves); `vllm_http` drives vLLM's OpenAI server over HTTP (and starts one from the engine venv),
`vllm_local` vLLM's in-process `LLM`; `venv` finds the engine venv (one whose build finished).
Orchestrators use them; the trainer does not.
"""
