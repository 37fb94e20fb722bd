"""What changed since the last push, per rank: the base a sparse push is computed against.

After one optimizer step most elements of a policy round to the same value in the engine's
dtype (an update below half a bf16 ulp is absorbed: vLLM #39451 measured more than 99 %
unchanged in RL), so a push after the first need only carry the elements whose value *in the
dtype the engine holds them in* changed. Each trainer rank keeps `PushBase`: its share's tensors
as last pushed, in that dtype (the engine's report names it per tensor, push_check.py), on the
host: the share's elements at the engine's itemsize (a bf16 engine: 2 bytes per parameter of
the share; the fp32 master copy stays where it is). A push then compares each tensor of the new
share bit for bit with its base (`delta`) and sends, per tensor, the cheapest encoding of
vlmcp/engine/push_patch.py: the changed elements' indices and values, a bitmap and the values,
or the whole tensor; unchanged tensors not at all. The base becomes the new share once an engine
confirmed the push (`advance`); an engine that did not holds another version, and gets a dense
push (the anchor) next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmcp.engine import push_patch
from vlmcp.engine.push_wire import WireBucket, WireTensor, cut_buckets


@dataclass
class Delta:
    """One rank's sparse push: per changed tensor its wire encoding and parts, in share order;
    `changed` and `total` elements over the whole share."""

    encodings: dict[str, list] = field(default_factory=dict)
    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    changed: int = 0
    total: int = 0

    def buckets(self, src: int, bucket_bytes: int) -> list[WireBucket]:
        """The changed tensors cut into buckets of at most `bucket_bytes` (a larger tensor is a
        bucket of its own), each listing its encodings."""
        return cut_buckets(src, [
            WireTensor(name, str(self.dtypes[name]).removeprefix("torch."), self.shapes[name],
                       sum(p.numel() * p.itemsize for p in parts), self.encodings[name])
            for name, parts in self.parts.items()], bucket_bytes)


class PushBase:
    """A rank's share as last pushed, in the dtype each engine holds each tensor in (see the
    module docstring). Empty until the first push an engine confirmed."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.step: int | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes the base holds."""
        return sum(t.numel() * t.itemsize for t in self.tensors.values())

    def ready_for(self, share: dict[str, torch.Tensor]) -> bool:
        """Whether it holds a base of every tensor of `share`."""
        return self.step is not None and share.keys() <= self.tensors.keys()

    def delta(self, share: dict[str, torch.Tensor]) -> Delta:
        """`share` ({name: tensor}, this rank's) against the base: the elements whose value in
        the base's dtype changed, each tensor in its cheapest encoding."""
        delta = Delta()
        for name, tensor in share.items():
            base = self.tensors[name]
            new = tensor.detach().to(base.dtype).reshape(-1)
            changed = push_patch.changed_indices(new, base.reshape(-1))
            delta.total += new.numel()
            count = changed.numel()
            if not count:
                continue
            kind = push_patch.cheapest(new.numel(), count, base.dtype)
            values = new if kind == push_patch.DENSE else new[changed]
            delta.parts[name] = push_patch.encode(kind, values, changed, new.numel())
            delta.encodings[name] = [kind] if kind == push_patch.DENSE else [kind, count]
            delta.dtypes[name] = base.dtype
            delta.shapes[name] = list(tensor.shape)
            delta.changed += count
        return delta

    def advance(self, step: int, share: dict[str, torch.Tensor],
                dtypes: dict[str, torch.dtype]) -> None:
        """Every engine holds `share` of `step` now: it is the base, each tensor in `dtypes`
        (the engine's, from its report)."""
        for name, tensor in share.items():
            dtype = dtypes.get(name, tensor.dtype)
            held = self.tensors.get(name)
            if held is None or held.dtype != dtype or held.shape != tensor.shape:
                self.tensors[name] = tensor.detach().to(dtype).clone()
            else:
                held.copy_(tensor.detach())
        self.step = step
