"""`vlmcp bench --saved-bytes`: the bytes each module saves for backward, per token.

One forward of the packed training module on a synthetic pack runs under
`torch.autograd.graph.saved_tensors_hooks`. Every tensor autograd saves is charged to the innermost
module whose forward is running (forward pre/post hooks keep the stack) at its storage's full size,
once per storage (a view of a storage already charged costs nothing more), and never for a
parameter's storage: the one a parameter holds when the tensor is saved (under ZeRO-3 a gathered
weight's storage exists only while its module runs). Saved tensors stay alive until backward, so no storage is freed and its
address reused while the pass counts.

This is the part of a GPU's activation memory that a CPU run measures exactly: what autograd keeps
between forward and backward, not the transients of either pass.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Owner of what is saved outside every module's forward (the loss, the embedding merge).
OUTSIDE = "<outside modules>"


@dataclass
class SavedBytes:
    """Saved-for-backward storage bytes charged to each module name (`OUTSIDE` for none)."""

    by_module: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    module_types: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_module.values())

    def per_token(self, tokens: int) -> list[dict[str, Any]]:
        """Rows {module, type, bytes, bytes_per_token}, largest first, modules that saved nothing
        left out."""
        rows = [{"module": name, "type": self.module_types.get(name, ""), "bytes": size,
                 "bytes_per_token": size / tokens}
                for name, size in self.by_module.items() if size]
        return sorted(rows, key=lambda row: -row["bytes"])


@contextmanager
def counting_saved_bytes(model: nn.Module) -> Iterator[SavedBytes]:
    """Charge every tensor autograd saves inside the block to the innermost running module of
    `model` (module names as `named_modules` gives them). Yields the running count."""
    counts = SavedBytes()
    stack: list[str] = []
    params = list(model.parameters())
    seen: set[int] = set()
    handles = []
    for name, module in model.named_modules():
        counts.module_types[name or "<root>"] = type(module).__name__
        handles.append(module.register_forward_pre_hook(_push(stack, name or "<root>")))
        handles.append(module.register_forward_hook(_pop(stack), always_call=True))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if (key not in seen and storage.nbytes() and not isinstance(tensor, nn.Parameter)
                and key not in {p.untyped_storage().data_ptr() for p in params}):
            seen.add(key)
            counts.by_module[stack[-1] if stack else OUTSIDE] += storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield counts
    finally:
        for handle in handles:
            handle.remove()


def _push(stack: list[str], name: str):
    def hook(*_: Any) -> None:
        stack.append(name)

    return hook


def _pop(stack: list[str]):
    def hook(*_: Any) -> None:
        stack.pop()

    return hook


def layer_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-token bytes summed by module type and the module's path with layer indices dropped
    (`layers.3.linear_attn.norm` -> `layers.*.linear_attn.norm`), averaged over the layers that
    have it: what one layer of each kind keeps. Rows {module, type, layers, bytes_per_token}."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        parts = ["*" if part.isdigit() else part for part in row["module"].split(".")]
        groups[(".".join(parts), row["type"])].append(row["bytes_per_token"])
    summary = [{"module": name, "type": kind, "layers": len(values),
                "bytes_per_token": sum(values) / len(values)}
               for (name, kind), values in groups.items()]
    return sorted(summary, key=lambda row: -row["bytes_per_token"])


@dataclass(frozen=True)
class SavedBytesTask:
    """One forward of the packed module on a synthetic pack of `seq_len` tokens (every rank of an
    SP group of `sp_size`), counting what autograd saves; then its backward, to free it."""

    model_dir: str
    dtype: str
    sp_size: int
    deltanet_cp: str
    seq_len: int
    samples: int
    module_options: dict[str, Any] = field(default_factory=dict)

    def run(self, device: torch.device, sp: Any = None) -> dict[str, Any]:
        """This rank's counts (the caller reports rank 0's): per module and per layer kind."""
        from vlmcp.bench.inputs import synthetic_pack
        from vlmcp.model.load import load_model
        from vlmcp.model.packed import PackedVLM
        from vlmcp.parallel.groups import SequenceParallel

        sp = sp or SequenceParallel.initialize(self.sp_size)
        module = PackedVLM(load_model(self.model_dir, self.dtype).to(device), sp=sp,
                           deltanet_cp=self.deltanet_cp, **self.module_options)
        module.train()
        batch = synthetic_pack(self.seq_len, self.samples, module.hf_model.config)
        with counting_saved_bytes(module) as counts:
            loss, _, _ = module(batch)
        loss.backward()
        local = module.plan(batch).local_len
        rows = counts.per_token(local)
        return {"seq_len": self.seq_len, "local_tokens": local, "dtype": self.dtype,
                "total_bytes_per_token": counts.total / local, "per_layer_kind": layer_summary(rows),
                "per_module": rows}
