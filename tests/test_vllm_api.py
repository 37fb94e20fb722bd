"""The vLLM API vlmcp speaks is the one the engine venv's vLLM (0.32, constraints-engine.txt)
serves: every route vlmcp's clients call (vlmcp/engine, vlmcp/rl, vlmcp/bench) is registered
there with the method vlmcp uses, every query parameter vlmcp sends is one the route declares and
none its docstring calls deprecated, and vlmcp's gloo backend implements every method of vLLM's
`WeightTransferEngine`. The contract is read from vLLM's own routers, in the engine venv; the
routes named in vlmcp's sources are checked against the list below, so that a new call cannot
go unchecked.

vlmcp does not use vLLM's trainer side (`WeightTransferTrainerFactory`, vLLM 0.28+): it needs
vLLM in the trainer's environment, and its engines send from rank 0 alone, while every vlmcp
rank sends the share it holds (docs/rl-loop.md)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.engine_reference import NEEDS_ENGINE
from vlmcp.engine.venv import named_engine_python

pytestmark = [pytest.mark.e2e, NEEDS_ENGINE]

ROOT = Path(__file__).resolve().parent.parent
#: Where vlmcp calls a vLLM server.
CALLERS = ("vlmcp/engine", "vlmcp/rl", "vlmcp/bench")
#: (method, path): the query parameters vlmcp sends. The contract.
SPOKEN = {
    ("POST", "/pause"): {"mode"},
    ("POST", "/resume"): set(),
    ("GET", "/is_paused"): set(),
    ("POST", "/init_weight_transfer_engine"): set(),
    ("POST", "/start_weight_update"): set(),
    ("POST", "/update_weights"): set(),
    ("POST", "/finish_weight_update"): set(),
    ("POST", "/shutdown_weight_transfer_engine"): set(),
    ("POST", "/update_weight_version"): set(),
    ("GET", "/weight_info"): set(),
    ("GET", "/get_world_size"): {"include_dp"},
    ("POST", "/reset_prefix_cache"): {"reset_running_requests"},
    ("POST", "/reset_encoder_cache"): set(),
    ("POST", "/collective_rpc"): set(),
    ("GET", "/health"): set(),
    ("POST", "/v1/chat/completions"): set(),
    ("POST", "/v1/completions"): set(),
    ("POST", "/inference/v1/generate"): set(),
}
ROUTERS = ("vllm.entrypoints.rl.online.api_router", "vllm.entrypoints.serve.dev.cache.api_router",
           "vllm.entrypoints.serve.dev.rpc.api_router",
           "vllm.entrypoints.serve.instrumentator.health",
           "vllm.entrypoints.openai.chat_completion.api_router",
           "vllm.entrypoints.openai.completion.api_router",
           "vllm.entrypoints.scale_out.token_in_token_out.api_router")
#: A path in a string literal of vlmcp's sources ("/pause?mode=...", f"/reset_...{q}"), and the
#: paths that are not a server's (files of procfs).
ROUTE_LITERAL = re.compile(r"[\"'](/(?:v1/|inference/v1/)?[a-z_]+(?:/[a-z_]+)*)[\"'?{]")
NOT_ROUTES = ("/proc/",)


@pytest.fixture(scope="module")
def served() -> dict:
    """vLLM's routes and the backend's abstract methods, read in the engine venv."""
    result = subprocess.run([str(named_engine_python()), str(ROOT / "tests/helpers/vllm_routes.py"),
                             *ROUTERS], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_route_vlmcp_calls_is_served_by_the_engines_vllm_with_no_deprecated_parameter(
        served):
    routes = {(method, r["path"]): r for r in served["routes"] for method in r["methods"]}
    for (method, path), sent in SPOKEN.items():
        route = routes.get((method, path))
        assert route is not None, f"{method} {path}: not a route of the engine venv's vLLM"
        assert sent <= set(route["query"]), (path, sent, route["query"])
        for name in sent:
            assert not re.search(rf"\b{name}\b[^\n]*deprecated", route["doc"], re.IGNORECASE), \
                (path, name, route["doc"])


def test_the_contract_lists_every_route_named_in_vlmcps_callers():
    named = {match for folder in CALLERS for path in sorted((ROOT / folder).glob("*.py"))
             for match in ROUTE_LITERAL.findall(path.read_text())
             if not match.startswith(NOT_ROUTES)}
    assert named, "no route found: the pattern no longer matches vlmcp's calls"
    assert named <= {path for _, path in SPOKEN}, sorted(named - {path for _, path in SPOKEN})


def test_vlmcps_gloo_backend_leaves_no_method_of_vllms_weight_transfer_engine_abstract(served):
    assert served["abstract"] == []
