"""Routing replay by its definition on plain transformers (no vlmcp model code): the reference of
the replay parity tests.

`force_routes(model, routes)` hooks a plain `Qwen3_5MoeForConditionalGeneration` (or a PEFT model
around one, or a copy of either: the hooks travel with `copy.deepcopy`) so that every forward of a
sample whose input_ids are a key of `routes` replaces each MoE router's output: at (token t, layer l)
with a route (K ids >= 0) the selection becomes the route and the gates the router's own softmax
probabilities there, divided by their sum, cast to the logits' dtype; -1 rows keep the router's own
top-k. A sample not in `routes` routes natively. The per-sample references of tests/helpers/parity.py
and objective_reference.py then run unchanged, in fp32 or in float64 (`float64_reference`).

Also here: random routes, routes in the data's two forms, and host routes for a `PackedBatch`.
"""

from __future__ import annotations

import base64

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

from vlmcp.data.routes import RouteSpec, no_route


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, Qwen3_5MoeTopKRouter)]


def force_routes(model: torch.nn.Module, routes: dict[tuple[int, ...], torch.Tensor]) -> None:
    """Hook `model` (see the module docstring). routes: input_ids (as a tuple) -> [T, L_moe, K]
    long, -1 rows for no route."""
    current: dict[str, torch.Tensor | None] = {"routes": None}

    def pick(module, args, kwargs):
        ids = kwargs.get("input_ids")
        current["routes"] = routes.get(tuple(ids[0].tolist())) if ids is not None else None

    def replace(layer: int):
        def hook(module, args, output):
            given = current["routes"]
            if given is None:
                return output
            logits, _, native = output
            route = given[:, layer].to(native.device)
            chosen = torch.where((route >= 0).all(-1, keepdim=True), route, native)
            probs = F.softmax(logits, dim=-1, dtype=torch.float)
            picked = probs.gather(-1, chosen)
            return logits, (picked / picked.sum(-1, keepdim=True)).to(logits.dtype), chosen
        return hook

    top = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeForConditionalGeneration")
    top.register_forward_pre_hook(pick, with_kwargs=True)
    for layer, router in enumerate(_routers(model)):
        router.register_forward_hook(replace(layer))


def native_routes(model: torch.nn.Module, sample) -> torch.Tensor:
    """[T, L_moe, K] long: plain transformers' own top-k of every MoE layer for `sample` alone."""
    chosen = []
    handles = [r.register_forward_hook(lambda m, a, out: chosen.append(out[2].detach().clone()))
               for r in _routers(model)]
    from tests.helpers.parity import vision_kwargs

    with torch.no_grad():
        model(input_ids=sample.input_ids[None], use_cache=False, **vision_kwargs(sample, model.config))
    for handle in handles:
        handle.remove()
    return torch.stack(chosen, dim=1)


def random_routes(gen: torch.Generator, length: int, spec: RouteSpec) -> torch.Tensor:
    """[length, L_moe, K] long: K distinct random experts per (token, layer)."""
    scores = torch.rand(length, spec.layers, spec.num_experts, generator=gen)
    return scores.argsort(dim=-1)[..., :spec.top_k]


def host_routes(routes: torch.Tensor, spec: RouteSpec) -> torch.Tensor:
    """[T, L_moe, K] long with -1 rows -> the data path's host routes (NO_ROUTE rows)."""
    empty = (routes < 0).all(-1, keepdim=True)
    return torch.where(empty, no_route(spec.dtype), routes).to(spec.dtype)


def nested_form(routes: torch.Tensor) -> list:
    """The nested-list form of [T, L_moe, K] long routes (-1 rows stay -1 rows)."""
    return routes.tolist()


def compact_form(routes: torch.Tensor, start: int, dtype: str = "int16") -> dict:
    """The compact form of rows `start`.. of [T, L_moe, K] long routes."""
    kinds = {"uint8": "<u1", "uint16": "<u2", "int16": "<i2", "int32": "<i4"}
    data = np.ascontiguousarray(routes[start:].numpy().astype(kinds[dtype])).tobytes()
    return {"data": base64.b64encode(data).decode(), "shape": list(routes[start:].shape),
            "dtype": dtype, "start": start}
