"""Engine clients: load each published WEIGHTS/step_N into a running inference engine.

`client.EngineClient` is the interface (serve a published step, report the policy version it
serves); `vllm_http` drives vLLM's OpenAI server over HTTP (and starts one from the engine venv),
`vllm_local` vLLM's in-process `LLM`; `venv` finds the engine venv (one whose build finished).
Orchestrators use them. `vllm_api` is one vLLM server's HTTP API (requests, errors, pause, cache
reset) under `vllm_http` and `weight_push_http`, the HTTP side of a weight push that the trainer
drives (standard library only: the trainer never imports vLLM). `vllm_gloo` and `vllm_plugin`
run inside vLLM only: the receiving side of that push, vlmcp's weight-transfer backend.
"""
