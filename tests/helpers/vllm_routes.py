"""Run by the engine venv's Python (vLLM installed): prints, as one JSON line, every HTTP route of
the routers named on the command line (modules of `vllm.entrypoints`): its path, methods, query
parameters and the endpoint's docstring; then whether vlmcp's gloo backend leaves any of vLLM's
`WeightTransferEngine` methods abstract."""

from __future__ import annotations

import importlib
import inspect
import json
import sys

from fastapi import APIRouter
from fastapi.routing import APIRoute


def routes(modules: list[str]) -> list[dict]:
    found = []
    for name in modules:
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, APIRouter):
                found += [{"path": route.path, "methods": sorted(route.methods),
                           "query": [p.name for p in route.dependant.query_params],
                           "doc": inspect.getdoc(route.endpoint) or ""}
                          for route in value.routes if isinstance(route, APIRoute)]
    return found


if __name__ == "__main__":
    from vlmcp.engine.vllm_gloo import GlooWeightTransferEngine

    print(json.dumps({"routes": routes(sys.argv[1:]),
                      "abstract": sorted(GlooWeightTransferEngine.__abstractmethods__)}))
