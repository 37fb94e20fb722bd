"""The vLLM server client (`vllm_http.VllmHttpClient`) against a stand-in server, without vLLM:
the calls of a reload and their order (wait and keep mode, dense and MoE), the keep mode's prefix
cache reset, and every failure as one EngineError line naming the server: an HTTP error with
vLLM's message and status, a refused connection, a request that hangs past the client's
timeout, a reload or a reset the server refused (the server stays paused, the version unchanged),
a repack answer that is not a count.

The stand-in is `tests.helpers.fake_vllm.FakeVllm`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.fake_vllm import HANG, VLLM_ERROR, FakeVllm
from vlmcp.data.rollouts import STABLE
from vlmcp.engine.vllm_http import VllmHttpClient
from vlmcp.errors import EngineError
from vlmcp.parallel.comm import free_local_port


def _published(root: Path, moe: bool = False) -> tuple[Path, Path]:
    """(model_dir, weights_dir): a served model's config.json and WEIGHTS/step_1 of the same
    model, marked STABLE (the client reads only config.json; the server would load the rest)."""
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": {"hidden_size": 64, **({"num_experts": 4} if moe else {})}}
    for folder in (root / "model", root / "weights" / "step_1"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
    (root / "weights" / "step_1" / STABLE).write_text("")
    return root / "model", root / "weights"


@contextmanager
def _client(tmp_path: Path, answers: dict[str, Any] | None = None, moe: bool = False,
            **kwargs: Any) -> Iterator[tuple[VllmHttpClient, FakeVllm]]:
    """A client built on a FakeVllm (its constructor's calls already made and forgotten)."""
    model, weights = _published(tmp_path, moe)
    with FakeVllm(answers) as fake:
        client = VllmHttpClient(fake.url, weights, model, **kwargs)
        fake.calls.clear()
        yield client, fake


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_a_reload_pauses_loads_resets_both_caches_labels_and_resumes_in_that_order(
        tmp_path, mode, moe):
    with _client(tmp_path, moe=moe, pause_mode=mode) as (client, fake):
        served = client.serve(1)
    reset = "/reset_prefix_cache" + ("?reset_running_requests=true" if mode == "keep" else "")
    assert fake.paths() == [f"/pause?mode={mode}",
                            "/collective_rpc:reload_weights",
                            *(["/collective_rpc:repack_cpu_moe_experts"] if moe else []),
                            reset, "/reset_encoder_cache", "/update_weight_version", "/resume"]
    assert fake.calls[1][1]["kwargs"] == {"weights_path": str(tmp_path / "weights" / "step_1")}
    assert fake.calls[-2][1] == {"new_version": "1"}
    assert (served.step, served.repacked_layers, client.version) == (1, 4 if moe else 0, 1)


@pytest.mark.parametrize("mode", ["wait", "keep"])
@pytest.mark.parametrize("answer", [(200, {"success": False}), (500, VLLM_ERROR)],
                         ids=["success-false", "http-500"])
def test_a_prefix_cache_reset_that_fails_is_an_error_and_the_server_stays_paused_on_the_old_label(
        tmp_path, mode, answer):
    with _client(tmp_path, {"/reset_prefix_cache": answer}, pause_mode=mode) as (client, fake):
        with pytest.raises(EngineError) as info:
            client.serve(1)
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {fake.url}/reset_prefix_cache")
    assert "the server stays paused, still labelled version 0" in message
    assert "prefix cache may hold KV of the old weights" in message
    assert client.version == 0
    assert fake.paths()[-1].startswith("/reset_prefix_cache")  # no label, no resume after it


def test_a_reload_the_server_refuses_is_an_error_with_its_message_and_the_server_stays_paused(
        tmp_path):
    with _client(tmp_path, {"/collective_rpc:reload_weights": (500, VLLM_ERROR)}) as (client,
                                                                                     fake):
        with pytest.raises(EngineError) as info:
            client.serve(1)
    (message,) = info.value.problems
    assert f"vLLM server {fake.url}/collective_rpc: HTTP 500: Failed to reload: weights_path " \
           "has no safetensors; the server stays paused" in message
    assert fake.paths()[-1] == "/collective_rpc:reload_weights" and client.version == 0


@pytest.mark.parametrize("results", [["None"], ["four"], "4"], ids=["none", "text", "no-list"])
def test_a_repack_answer_that_is_not_a_count_per_worker_is_an_error_naming_it(tmp_path, results):
    answers = {"/collective_rpc:repack_cpu_moe_experts": (200, {"results": results})}
    with _client(tmp_path, answers, moe=True) as (client, fake):
        with pytest.raises(EngineError) as info:
            client.serve(1)
    (message,) = info.value.problems
    assert f"repack_cpu_moe_experts answered {json.dumps({'results': results})}, not one layer " \
           "count per worker" in message
    assert "the server stays paused" in message and fake.url in message


@pytest.mark.parametrize("status, body, expected", [
    (400, {"error": {"message": "max_tokens must be at least 1", "type": "Bad Request",
                     "param": None, "code": 400}}, "HTTP 400: max_tokens must be at least 1"),
    (500, {"error": "Failed to pause generation: engine dead"},
     "HTTP 500: Failed to pause generation: engine dead"),
    (404, {"detail": "Not Found"}, "HTTP 404: Not Found (the development endpoints need the "
                                   "server started with VLLM_SERVER_DEV_MODE=1)"),
    (502, "Bad gateway\n  upstream\nclosed", "HTTP 502: Bad gateway upstream closed"),
], ids=["openai-400", "pause-500", "no-route-404", "text-502"])
def test_an_http_error_is_one_line_with_vllms_message_and_the_status(tmp_path, status, body,
                                                                      expected):
    with _client(tmp_path, {"/pause": (status, body)}) as (client, fake):
        with pytest.raises(EngineError) as info:
            client.post("/pause?mode=wait")
    assert info.value.problems == [f"vLLM server {fake.url}/pause?mode=wait: {expected}"]


def test_a_refused_connection_is_reported_unreachable(tmp_path):
    model, weights = _published(tmp_path)
    url = f"http://127.0.0.1:{free_local_port()}"
    with pytest.raises(EngineError) as info:
        VllmHttpClient(url, weights, model)
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {url} is unreachable (")
    assert "on /update_weight_version" in message


def test_a_hung_pause_is_a_timeout_error_within_the_clients_timeout_not_unreachable(tmp_path):
    with _client(tmp_path, {"/pause": HANG}, timeout_s=0.5) as (client, fake):
        started = time.perf_counter()
        with pytest.raises(EngineError) as info:
            client.serve(1)
        seconds = time.perf_counter() - started
    (message,) = info.value.problems
    assert message.startswith(f"vLLM server {fake.url}: POST /pause?mode=wait "
                              "timed out after 0.5 s; the server may still be doing it")
    assert "POST /resume" in message and "unreachable" not in message
    assert 0.5 <= seconds < 3.0 and client.version == 0
