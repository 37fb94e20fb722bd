"""vLLM's general plugin for vlmcp: registers the gloo weight-transfer backend "vlmcp_gloo".

vLLM calls every `vllm.general_plugins` entry point in each of its processes before it builds an
engine (pyproject.toml: `vlmcp_gloo = "vlmcp.engine.vllm_plugin:register"`, installed into the
engine venv by `scripts/engine_venv.py`). `register` names the backend lazily, by module path
and class name, so that nothing is imported until a server started with
`--weight-transfer-config '{"backend": "vlmcp_gloo"}'` builds it (`vllm_gloo`, which needs vLLM
and torch); it is idempotent, since vLLM's factory refuses a second registration of a name and a
process may load the plugins more than once. Imports nothing of vLLM at module level: vlmcp's own
environment can import this module without vLLM.
"""

from __future__ import annotations

#: The backend's name, for `--weight-transfer-config '{"backend": "vlmcp_gloo"}'`.
BACKEND = "vlmcp_gloo"
#: Where vLLM finds the engine class when the backend is first used.
ENGINE_MODULE = "vlmcp.engine.vllm_gloo"
ENGINE_CLASS = "GlooWeightTransferEngine"


def register() -> None:
    """Register BACKEND with vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError as exc:  # "Weight transfer engine 'vlmcp_gloo' is already registered."
        if "already registered" not in str(exc):
            raise
