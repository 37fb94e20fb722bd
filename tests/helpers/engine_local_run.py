"""Run in the engine venv (`make engine`): vLLM's in-process `LLM` served through
`vlmcp.engine.vllm_local.VllmLocalClient`, one engine after another in this one process.

    .venv-engine/bin/python tests/helpers/engine_local_run.py SPEC.json OUT.json

with the checkout on PYTHONPATH and the CPU settings of `vlmcp.engine.vllm_http.CPU_ENV` in the
environment. SPEC.json:

    {"sampling": {SamplingParams keyword arguments, a "seed" among them},
     "image_messages": [chat messages of one image prompt], "text_ids": [token ids],
     "engines": [{"name": "dense", "model": "W/step_1", "weights": "W", "version": 1,
                  "serve": [2, 1], "unrepacked": "W/step_1" (optional)}, ...]}

Each engine starts on `model` (policy version `version`), samples the image prompt (`LLM.chat`)
and the text prompt (`LLM.generate`) once, then once more after each `client.serve(step)` of
`serve`; with `unrepacked`, finally once more after reloading that directory with vLLM's own
`reload_weights` alone (no MoE repack: what the client's repack exists to fix). OUT.json holds
per engine name either {"runs": [{"version", "served_s", "repacked_layers", "image_prompt_ids",
"image": [[tokens, logprobs], ...], "text": [...]}, ...]} (one entry per sampling, in order) or
{"error": "..."} when the client refused the engine (an `EngineError`), and "start_s". The test
side (`tests/test_engine_local.py`) holds the numbers to transformers'.

Each engine is shut down before the next starts (`llm.llm_engine.engine_core.shutdown()`: vLLM
0.32's `LLM` has no public shutdown; this is what its own in-process tests call).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

from vllm import LLM, SamplingParams

from vlmcp.engine.vllm_local import VllmLocalClient
from vlmcp.errors import EngineError


def _completions(request_output: Any) -> list[list[list[Any]]]:
    """[[tokens, logprobs of the sampled tokens], ...] of one request's samples."""
    return [[list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)]]
            for o in request_output.outputs]


def _sample(llm: LLM, spec: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
    image = llm.chat(spec["image_messages"], params, use_tqdm=False)[0]
    text = llm.generate([{"prompt_token_ids": spec["text_ids"]}], params, use_tqdm=False)[0]
    return {"image_prompt_ids": list(image.prompt_token_ids), "image": _completions(image),
            "text": _completions(text)}


def _run_engine(engine: dict[str, Any], spec: dict[str, Any], params: SamplingParams
                ) -> dict[str, Any]:
    started = time.perf_counter()
    llm = LLM(model=engine["model"], dtype="bfloat16", enforce_eager=True,
              distributed_executor_backend="uni", logprobs_mode="processed_logprobs",
              max_model_len=512, seed=0)
    result: dict[str, Any] = {"start_s": time.perf_counter() - started}
    try:
        client = VllmLocalClient(llm, engine["weights"], engine["model"],
                                 version=engine["version"])
        runs = [{"version": client.version, **_sample(llm, spec, params)}]
        for step in engine["serve"]:
            served = client.serve(step)
            runs.append({"version": client.version, "served_s": served.seconds,
                         "repacked_layers": served.repacked_layers, **_sample(llm, spec, params)})
        if engine.get("unrepacked"):
            llm.collective_rpc("reload_weights", kwargs={"weights_path": engine["unrepacked"]})
            llm.llm_engine.reset_encoder_cache()
            llm.reset_prefix_cache()
            runs.append({"version": None, **_sample(llm, spec, params)})
        result["runs"] = runs
    except EngineError as exc:
        result["error"] = str(exc)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return result


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    params = SamplingParams(logprobs=0, **spec["sampling"])
    results = {engine["name"]: _run_engine(engine, spec, params) for engine in spec["engines"]}
    with open(out_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
