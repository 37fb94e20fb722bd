"""The engine client against a real vLLM server in its own process (the engine venv, `make
engine`): 3 RL steps trained at SP 2 and published, each served in place, the engine's sampled
logprobs held to transformers' on the same WEIGHTS/step_N within bf16's own error, an in-flight
reload labelling tokens of two versions, a prompt whose prefix the engine cached before an
in-flight (keep-mode) reload computed with the new weights, and each failure one clear error. One
server for the module (about 20-50 s to start on 2 cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.engine_reference import (NEEDS_ENGINE, NEW_TOKENS, SAMPLES, TAU, Prompt,
                                            demo_allowed_ids, image_request,
                                            reference_logprobs, text_prompt_ids)
from tests.helpers.in_flight import in_flight
from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, write_job
from tests.helpers.parity import assert_within_bf16_error, bf16_allowance, rel_err
from tests.helpers.rollout_producer import rollout_line, write_step
from vlmcp.data.policy_versions import target_version_range, token_versions
from vlmcp.data.processor import load_processor
from vlmcp.data.rollouts import STABLE, step_dir
from vlmcp.demo.image import DEMO_MODEL
from vlmcp.engine.venv import engine_python
from vlmcp.engine.vllm_http import CPU_ARGS, VllmHttpClient, VllmServer
from vlmcp.errors import EngineError
from vlmcp.model.tiny import VLLM_CPU_HEADS, build_tiny_checkpoint
from vlmcp.parallel.comm import free_local_port

ENGINE = engine_python()
pytestmark = [pytest.mark.e2e, NEEDS_ENGINE]

STEPS = 3
#: A user turn of 445 prompt tokens: more than one block of the engine's prefix cache (384 tokens
#: for this model on a CPU, where the attention block is sized to the DeltaNet state), and with
#: NEW_TOKENS within the server's --max-model-len 512.
LONG_TEXT = " ".join(f"Describe picture {i} in detail." for i in range(32))


@pytest.fixture(scope="module")
def published(tmp_path_factory, digits_jsonl):
    """An engine-compatible tiny Qwen3.5 VLM, 3 rollout steps from it, and the weights of the 3
    optimizer steps `vlmcp train` published from them at SP 2 (AdamW at a rate that moves the
    logprobs well beyond bf16's error)."""
    root = tmp_path_factory.mktemp("engine")
    checkpoint = build_tiny_checkpoint(root / "checkpoint", seed=0,
                                       **{**DEMO_MODEL, **VLLM_CPU_HEADS})
    processor = load_processor(checkpoint)
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(checkpoint),
                                                            dtype=torch.float32).eval()
    records = [json.loads(t) for t in (digits_jsonl / "train.jsonl").read_text().splitlines()]
    generator = torch.Generator().manual_seed(0)
    for number in range(1, STEPS + 1):
        lines = [rollout_line(model, processor, records[i], f"train.jsonl:{i + 1}",
                              digits_jsonl, generator) for i in range(8 * number - 8, 8 * number)]
        write_step(step_dir(root / "rollouts", number), lines, 0, 0.0)
    job = tiny_job(checkpoint, Path("unused"), root / "out",
                   data={"max_seq_len": 256, "num_workers": 0}, parallel={"sp_size": 2},
                   loss={"type": "policy_gradient"}, optimizer={"type": "adamw", "lr": 2e-2},
                   rollouts={"dir": str(root / "rollouts"), "timeout_s": 60, "poll_s": 0.1},
                   publish={"dir": str(root / "weights"), "every": 1, "keep": STEPS},
                   train={"max_steps": STEPS})
    del job["data"]["train"]
    assert_ok(run_vlmcp(["train", str(write_job(root / "job.json", job))], launcher="torchrun",
                        nproc=2, timeout=900))
    return {"root": root, "checkpoint": checkpoint, "weights": root / "weights",
            "processor": processor, "digits": digits_jsonl, "records": records}


@pytest.fixture(scope="module")
def server(published):
    """One vLLM server (the engine venv's Python) on the base checkpoint, for the module."""
    engine = VllmServer(ENGINE, published["checkpoint"], published["root"] / "server.log",
                        args=(*CPU_ARGS, "--max-model-len", "512", "--seed", "0",
                              "--enable-prompt-tokens-details"))
    engine.start()
    yield engine
    engine.stop()


def _sample(client, published) -> dict[str, tuple[Prompt, list[list[int]], torch.Tensor]]:
    """Image and text prompts, SAMPLES completions each: (prompt, token ids, engine logprobs)."""
    allowed = demo_allowed_ids(published["processor"])
    params = {"model": str(published["checkpoint"]), "max_tokens": NEW_TOKENS,
              "temperature": TAU, "n": SAMPLES, "return_token_ids": True,
              "allowed_token_ids": allowed}
    messages, image_prompt = image_request(published["records"][0], "train.jsonl:1",
                                           published["digits"], published["processor"],
                                           NEW_TOKENS)
    out = client.post("/v1/chat/completions", {"messages": messages, **params, "logprobs": True})
    assert out["prompt_token_ids"] == image_prompt.input_ids  # vLLM renders vlmcp's prompt
    image = [(c["token_ids"], [t["logprob"] for t in c["logprobs"]["content"]])
             for c in out["choices"]]
    text_ids = text_prompt_ids(published["processor"])
    out = client.post("/v1/completions", {**params, "prompt": text_ids, "logprobs": 0})
    text = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in out["choices"]]
    return {kind: (prompt, [t for t, _ in found],
                   torch.tensor([v for _, lp in found for v in lp], dtype=torch.float64))
            for kind, prompt, found in (("image", image_prompt, image),
                                        ("text", Prompt(text_ids), text))}


def test_each_published_step_served_in_place_gives_transformers_logprobs_within_bf16_error(
        published, server):
    client = VllmHttpClient(server.url, published["weights"], published["checkpoint"])
    assert client.version == 0 and client.engine_version == "0"
    allowed = demo_allowed_ids(published["processor"])
    for step in range(1, STEPS + 1):
        served = client.serve(step)
        assert served.step == client.version == int(client.engine_version) == step
        for kind, (prompt, tokens, engine) in _sample(client, published).items():
            ref64, ref_bf16 = reference_logprobs(published["weights"] / f"step_{step}", prompt,
                                                 tokens, TAU, allowed)
            assert_within_bf16_error(engine, ref_bf16, ref64, name=f"step {step} {kind}")
            # The reload changed them: the previous weights' logprobs of these very tokens lie
            # beyond the allowance (so serving stale weights would fail the check above).
            before = published["checkpoint"] if step == 1 else \
                published["weights"] / f"step_{step - 1}"
            stale64, _ = reference_logprobs(before, prompt, tokens, TAU, allowed)
            assert rel_err(stale64, ref64) > 2 * bf16_allowance(ref_bf16, ref64), (step, kind)


def test_an_in_flight_reload_labels_each_token_with_the_version_that_sampled_it(
        published, server):
    client = VllmHttpClient(server.url, published["weights"], published["checkpoint"],
                            version=STEPS, pause_mode="keep")
    client.serve(STEPS)
    prompt = text_prompt_ids(published["processor"])
    thread, answer = in_flight(server.url, prompt, 400)
    client.serve(STEPS - 1)
    thread.join(timeout=300)
    assert len(answer["token_ids"]) == 400
    spans = answer["weight_versions"]
    assert [span["version"] for span in spans] == [str(STEPS), str(STEPS - 1)], spans
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 400
    # As a rollout line writes them: output spans shifted by the prompt's length.
    line_spans = [{"version": int(s["version"]), "start": len(prompt) + s["start"],
                   "end": len(prompt) + s["end"]} for s in spans]
    versions = token_versions(line_spans, len(prompt) + 400, "line")
    labels = [-100] * len(prompt) + answer["token_ids"]
    assert target_version_range(versions, labels, "line") == (STEPS - 1, STEPS)


def test_after_an_in_flight_reload_a_prompt_whose_prefix_was_cached_gets_the_new_weights_logprobs(
        published, server):
    """vLLM keeps its prefix cache over a reload unless it is reset, and the frozen request of a
    keep-mode pause holds blocks, so that a plain reset fails: the client resets with the frozen
    requests preempted. With a plain reset instead, its failure ignored (the client before, with
    the pause's own cache clearing off), this prompt reused step 1's KV of its first 384 tokens:
    measured 0.038 relative off step 2's logprobs against an allowance of 0.0030. (With that
    clearing on, vLLM 0.32's default, the keep-mode pause itself preempts and resets, and the old
    client passed; the parameter is deprecated, so the client no longer leans on it.)"""
    client = VllmHttpClient(server.url, published["weights"], published["checkpoint"],
                            pause_mode="keep")
    client.serve(1)
    allowed = demo_allowed_ids(published["processor"])
    prompt = text_prompt_ids(published["processor"], LONG_TEXT)
    params = {"model": str(published["checkpoint"]), "prompt": prompt, "max_tokens": NEW_TOKENS,
              "temperature": TAU, "return_token_ids": True, "allowed_token_ids": allowed,
              "logprobs": 0}
    for _ in range(2):
        out = client.post("/v1/completions", params)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # step 1's KV, cached
    thread, answer = in_flight(server.url, text_prompt_ids(published["processor"]), 400)
    client.serve(2)
    thread.join(timeout=300)
    assert len(answer["token_ids"]) == 400  # the frozen request went on after the reload
    out = client.post("/v1/completions", {**params, "n": SAMPLES})
    tokens = [choice["token_ids"] for choice in out["choices"]]
    engine = torch.tensor([v for c in out["choices"] for v in c["logprobs"]["token_logprobs"]],
                          dtype=torch.float64)
    ref64, ref_bf16 = reference_logprobs(published["weights"] / "step_2", Prompt(prompt), tokens,
                                         TAU, allowed)
    assert_within_bf16_error(engine, ref_bf16, ref64, name="cached prefix after the reload")
    stale64, _ = reference_logprobs(published["weights"] / "step_1", Prompt(prompt), tokens, TAU,
                                    allowed)
    assert rel_err(stale64, ref64) > 2 * bf16_allowance(ref_bf16, ref64)


def test_each_failure_to_serve_a_step_is_one_clear_error_and_the_engine_serves_on(
        published, server, tmp_path):
    with pytest.raises(EngineError, match="is unreachable"):
        VllmHttpClient(f"http://127.0.0.1:{free_local_port()}", published["weights"],
                       published["checkpoint"])
    bad = tmp_path / "weights"
    shutil.copytree(published["weights"] / "step_1", bad / "step_1")
    (bad / "step_1" / STABLE).unlink()
    shutil.copytree(published["weights"] / "step_1", bad / "step_2")
    for shard in (bad / "step_2").glob("*.safetensors"):  # one file, or one shard per rank
        shard.write_bytes(b"\0" * 64)
    build_tiny_checkpoint(bad / "step_3", seed=0, **{**DEMO_MODEL, **VLLM_CPU_HEADS,
                                                      "hidden_size": 64})
    (bad / "step_3" / STABLE).write_text("")
    client = VllmHttpClient(server.url, bad, published["checkpoint"])
    for step, message in [(1, "has no STABLE marker: it is not completely published"),
                          (7, "does not exist .* publish.keep"),
                          (3, "not the model the engine serves .*hidden_size: 128 -> 64"),
                          (2, "reloading .*step_2 into the vLLM server failed")]:
        with pytest.raises(EngineError, match=message) as info:
            client.serve(step)
        assert len(info.value.problems) == 1
    good = VllmHttpClient(server.url, published["weights"], published["checkpoint"])
    good.serve(1)
    assert _sample(good, published)["image"][2].isfinite().all()
