"""vlmcp's vLLM plugin (the `vllm.general_plugins` entry point `vlmcp_gloo` of vlmcp's package,
which `make engine` installs into the engine venv): registers the weight-transfer backend
"vlmcp_gloo" (`vllm_gloo.GlooWeightTransferEngine`) with vLLM's factory, lazily, so that a
server started with `--weight-transfer-config '{"backend": "vlmcp_gloo"}'` can take pushed
weights (docs/rl-loop.md). vLLM may load plugins more than once per process: a second call
changes nothing. Imported by vLLM only.
"""

from __future__ import annotations

#: The backend's name in vLLM's registry (and in --weight-transfer-config).
BACKEND = "vlmcp_gloo"


def register() -> None:
    """Register the backend with vLLM's weight-transfer factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "vlmcp.engine.vllm_gloo",
                                                    "GlooWeightTransferEngine")
    except ValueError as exc:  # registered by an earlier load of the plugins
        if "already registered" not in str(exc):
            raise
