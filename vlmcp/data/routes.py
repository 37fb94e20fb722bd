"""MoE routes in the data: the experts each token was routed to, per MoE layer, for routing
replay (R3: the inference engine's routes; R2: the trainer's own, from `vlmcp score --routes`).

A tokens-format record (and so a rollout step) may carry ``"routed_experts"`` in one of two forms:

* a nested list ``[T][L_moe][K]`` aligned with ``input_ids`` (T == len(input_ids)): entry t holds,
  for every MoE layer l, the K expert ids token t went to. A token entry ``null`` means no route
  for that token; a layer entry ``null`` or K times ``-1``, no route for that (token, layer).
* the compact form that engines and PrimeRL write: ``{"data": base64, "shape": [T, L, K],
  "dtype": "uint8" | "uint16" | "int16" | "int32", "start": S}``: the little-endian bytes of a
  C-order [T, L, K] array of that dtype, covering tokens S .. S+T-1 (``start`` defaults to 0; it
  is PrimeRL's ``routed_experts_prompt_start`` and vLLM's ``SamplingParams.
  routed_experts_prompt_start``). The covered range ends at the last token or at the one before
  it: an engine never forwards the token it sampled last, so it returns no route for it (vLLM
  returns ``num_tokens - 1 - start`` rows). Tokens before ``start`` have no route; ``-1`` rows
  (signed dtypes) are no route.

No route means native routing for that (token, layer): the prompt tokens when an engine returns
completion routes only, or a route the engine lost (preemption).

Checks, each a `DataError` naming the record ("file:line"), in the index pass before any rank
starts: the form; base64 that decodes to exactly shape x itemsize bytes; the shape against the
tokens and the model (L_moe MoE layers, K = num_experts_per_tok); every id in [0, num_experts);
no duplicate id in a row; a row either wholly ``-1`` or wholly ids; routes on a dense checkpoint.

On the host a sample's routes are one [L, L_moe, K] tensor of `RouteSpec.dtype` (uint8 when the
model has at most 255 experts, else uint16; never int64), with `NO_ROUTE` (the dtype's maximum)
on every row without a route; a pack concatenates its samples' (`pack_routes`).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlmcp.errors import DataError

#: The record key of a sample's routes.
ROUTES_KEY = "routed_experts"
#: The compact form's dtypes -> their little-endian numpy types.
COMPACT_DTYPES = {"uint8": "<u1", "uint16": "<u2", "int16": "<i2", "int32": "<i4"}


@dataclass(frozen=True)
class RouteSpec:
    """The routing layout of a MoE checkpoint: `layers` MoE layers (L_moe), each sending a token
    to `top_k` (K) of `num_experts` (E) experts."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        """The host dtype of routes: uint8 when every id and `NO_ROUTE` fit it, else uint16."""
        return torch.uint8 if self.num_experts <= torch.iinfo(torch.uint8).max else torch.uint16


def no_route(dtype: torch.dtype) -> int:
    """The value of a row without a route in host routes of `dtype` (its maximum)."""
    return torch.iinfo(dtype).max


def route_spec(config: dict[str, Any]) -> RouteSpec | None:
    """The routing layout of a checkpoint's config.json (its text_config, or the top level), or
    None for a dense model (no num_experts / num_experts_per_tok). Every decoder layer of a
    Qwen3.5-MoE checkpoint is a MoE layer."""
    text = config.get("text_config") or config
    experts, top_k = text.get("num_experts"), text.get("num_experts_per_tok")
    if not experts or not top_k:
        return None
    if experts > no_route(torch.uint16):
        raise ValueError(f"num_experts {experts} is more than routes can hold "
                         f"({no_route(torch.uint16)})")
    return RouteSpec(layers=int(text["num_hidden_layers"]), top_k=int(top_k),
                     num_experts=int(experts))


def _fail(source: str, message: str) -> DataError:
    return DataError(f'{source}: "{ROUTES_KEY}" {message}')


def parse_routes(value: Any, num_tokens: int, spec: RouteSpec | None, source: str
                 ) -> torch.Tensor:
    """A record's `routed_experts` (either form) -> [num_tokens, L_moe, K] host routes of
    `spec.dtype`, `NO_ROUTE` where there is none. spec: the checkpoint's routing layout (None: a
    dense model, an error). Raises DataError naming `source`."""
    if spec is None:
        raise _fail(source, "needs a mixture-of-experts checkpoint: model.path is a dense model "
                            "(its config.json has no num_experts), it has no routers to replay")
    if isinstance(value, dict):
        ids, start = _compact(value, num_tokens, source)
    elif isinstance(value, list):
        if len(value) != num_tokens:
            raise _fail(source, f"has {len(value)} token entries for {num_tokens} input_ids (one "
                                "per token, null for a token without a route)")
        ids, start = _nested(value, spec, source), 0
    else:
        raise _fail(source, 'must be a nested list [T][L_moe][K] or {"data", "shape", "dtype", '
                            '"start"}')
    _check_ids(ids, spec, start, source)
    host = torch.full((num_tokens, spec.layers, spec.top_k), no_route(spec.dtype),
                      dtype=spec.dtype)
    routed = ~np.all(ids == -1, axis=-1)
    covered = np.where(routed[..., None], ids, no_route(spec.dtype))
    host[start:start + len(ids)] = torch.from_numpy(covered.astype(np.int64)).to(spec.dtype)
    return host


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _compact(value: dict[str, Any], num_tokens: int, source: str) -> tuple[np.ndarray, int]:
    """(ids [T, L, K] int64, start) of the compact form; its shape is checked against the
    tokens here and against the model in `_check_ids`."""
    missing = [key for key in ("data", "shape", "dtype") if key not in value]
    unknown = sorted(set(value) - {"data", "shape", "dtype", "start"})
    if missing or unknown:
        raise _fail(source, "compact form needs data, shape, dtype (and optionally start); "
                            + (f"{missing} missing" if missing else f"unknown keys {unknown}"))
    shape, dtype, start = value["shape"], value["dtype"], value.get("start", 0)
    if not (isinstance(shape, list) and len(shape) == 3 and all(_int(n) and n >= 0 for n in shape)):
        raise _fail(source, f"shape must be [T, L, K] of non-negative integers, got {shape!r}")
    if dtype not in COMPACT_DTYPES:
        raise _fail(source, f"dtype must be one of {list(COMPACT_DTYPES)}, got {dtype!r}")
    if not _int(start) or start < 0:
        raise _fail(source, f"start must be a non-negative integer, got {start!r}")
    if not isinstance(value["data"], str):
        raise _fail(source, "data must be a base64 string")
    try:
        raw = base64.b64decode(value["data"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise _fail(source, f"data is not valid base64 ({e})") from e
    itemsize = np.dtype(COMPACT_DTYPES[dtype]).itemsize
    if len(raw) != math.prod(shape) * itemsize:
        raise _fail(source, f"data decodes to {len(raw)} bytes; shape {shape} of {dtype} needs "
                            f"{math.prod(shape) * itemsize}")
    covered = num_tokens - start
    if shape[0] not in (covered, covered - 1):
        raise _fail(source, f"shape {shape} with start {start} disagrees with the {num_tokens} "
                            f"input_ids: it must cover tokens {start} to the last "
                            f"({covered} rows) or to the one before it ({covered - 1} rows)")
    ids = np.frombuffer(raw, dtype=COMPACT_DTYPES[dtype]).reshape(shape).astype(np.int64)
    return ids, start


def _nested(value: list[Any], spec: RouteSpec, source: str) -> np.ndarray:
    """ids [T, L, K] int64 of the nested form, -1 on rows without a route."""
    ids = np.full((len(value), spec.layers, spec.top_k), -1, dtype=np.int64)
    for t, layers in enumerate(value):
        if layers is None:
            continue
        if not isinstance(layers, list) or len(layers) != spec.layers:
            raise _fail(source, f"[{t}] must be null or one entry per MoE layer "
                                f"({spec.layers} for this model), got "
                                f"{len(layers) if isinstance(layers, list) else repr(layers)}")
        for layer, row in enumerate(layers):
            if row is None:
                continue
            if not isinstance(row, list) or len(row) != spec.top_k or not all(map(_int, row)):
                raise _fail(source, f"[{t}][{layer}] must be null or {spec.top_k} integer expert "
                                    f"ids (num_experts_per_tok), got {row!r}")
            if any(abs(x) > spec.num_experts for x in row):
                raise _fail(source, f"[{t}][{layer}] = {row}: an expert id must lie in "
                                    f"[0, {spec.num_experts}) (-1: no route)")
            ids[t, layer] = row
    return ids


def _check_ids(ids: np.ndarray, spec: RouteSpec, start: int, source: str) -> None:
    """Shape [T, L_moe, K], ids in [0, E) or whole rows of -1, no duplicate in a row."""
    if ids.shape[1:] != (spec.layers, spec.top_k):
        raise _fail(source, f"shape {list(ids.shape)} has {ids.shape[1]} MoE layers of "
                            f"{ids.shape[2]} experts; the model routes {spec.layers} MoE layers "
                            f"to top-{spec.top_k} (shape [T, {spec.layers}, {spec.top_k}])")
    empty = np.all(ids == -1, axis=-1)
    problems = (
        ("a row partly -1", (ids == -1).any(axis=-1) & ~empty),
        ("an id outside [0, num_experts)",
         (((ids < 0) & (ids != -1)) | (ids >= spec.num_experts)).any(axis=-1)),
        ("a duplicate expert id in a row",
         (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any(axis=-1) & ~empty),
    )
    for what, bad in problems:
        if bad.any():
            t, layer = (int(i) for i in np.argwhere(bad)[0])
            raise _fail(source, f"has {what} at token {start + t}, MoE layer {layer}: "
                                f"{ids[t, layer].tolist()} (ids in [0, {spec.num_experts}), "
                                "K distinct per row, or all -1 for no route)")


def pack_routes(routes: Sequence[torch.Tensor | None], lengths: Sequence[int]
                ) -> torch.Tensor | None:
    """The host routes of a pack [S, L_moe, K]: each sample's ([length, L_moe, K], or None for a
    sample without routes: `NO_ROUTE` rows) back to back; None when no sample has routes."""
    like = next((r for r in routes if r is not None), None)
    if like is None:
        return None
    return torch.cat([r if r is not None else
                      torch.full((n, *like.shape[1:]), no_route(like.dtype), dtype=like.dtype)
                      for r, n in zip(routes, lengths)])


def encode_routes(ids: np.ndarray, start: int = 0) -> dict[str, Any]:
    """The compact form of ids [T, L, K] (integers, -1 for no route) covering tokens from
    `start`: the smallest of `COMPACT_DTYPES` that holds them."""
    ids = np.asarray(ids, dtype=np.int64)
    low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if low < 0:
        dtype = "int16" if high <= np.iinfo(np.int16).max else "int32"
    else:
        dtype = "uint8" if high <= np.iinfo(np.uint8).max else "uint16"
    data = np.ascontiguousarray(ids.astype(COMPACT_DTYPES[dtype])).tobytes()
    return {"data": base64.b64encode(data).decode("ascii"), "shape": list(ids.shape),
            "dtype": dtype, "start": start}
