"""What a sparse push and the delivery check put on the wire, and how either side reads it.

Both sides import this module (standard library and torch only), as they do push_wire.py: the
trainer's ranks to encode what changed and to check the engine's checksums, an engine's workers
(vllm_gloo.py, vllm_held.py) to decode and apply a patch and to compute those checksums.

**Patches.** A tensor of a push travels in one of three encodings (`WireBucket.encodings`), each
in checkpoint coordinates (the flat, row-major index into the HF tensor of `shape`) and with its
values in the dtype the engine holds it in:

    ["dense"]            every value: numel x itemsize bytes (the encoding of a dense push)
    ["index", k]         the k changed elements: their flat indices (int32, int64 when the
                         tensor has 2**31 elements or more), then their values
    ["bitmap", k]        one bit per element, element i in bit i % 8 of byte i // 8 (ceil(numel
                         / 8) bytes), set where the value changed, then the k changed values in
                         index order

The trainer picks the encoding with the fewest bytes for each tensor (`cheapest`); a tensor
with no changed element is not sent at all.

**Regions and checksums.** vLLM's loader writes a checkpoint tensor into the engine's parameters
with `Tensor.copy_` of a strided view of it into a strided view of a parameter (narrowed for a
tensor-parallel shard, at an offset of a fused qkv or gate/up parameter, one expert of a stacked
MoE weight). The engine records each such copy as a pair of `Region`s: where in the checkpoint
tensor (offset, sizes, strides, in elements) and where in the parameter's storage. The delivery
check's checksum of a region (`digest`) is a BLAKE2b of its elements' bytes in the engine's
dtype, read in the region's row-major order: the engine reads them from its parameter, the
trainer from its tensor, and the two agree exactly when the engine holds the trainer's values
there. `Region.locate` maps checkpoint indices to parameter positions, which is how a patch is
applied in place.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

#: The encodings of a tensor in a push (see the module docstring).
DENSE, INDEX, BITMAP = "dense", "index", "bitmap"
#: Bytes of a BLAKE2b checksum.
DIGEST_BYTES = 16


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a tensor's flat indices on the wire: int32 below 2**31 elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def encoded_bytes(kind: str, numel: int, count: int, dtype: torch.dtype) -> int:
    """Bytes of a tensor of `numel` elements of `dtype` with `count` values sent, encoded as
    `kind`."""
    if kind == DENSE:
        return numel * dtype.itemsize
    if kind == INDEX:
        return count * (index_dtype(numel).itemsize + dtype.itemsize)
    if kind == BITMAP:
        return (numel + 7) // 8 + count * dtype.itemsize
    raise ValueError(f"encoding {kind!r} is not one of {DENSE}, {INDEX}, {BITMAP}")


def cheapest(numel: int, count: int, dtype: torch.dtype) -> str:
    """The encoding with the fewest bytes for `count` changed elements of `numel`."""
    return min((DENSE, INDEX, BITMAP), key=lambda kind: encoded_bytes(kind, numel, count, dtype))


def parse_encoding(encoding: Any, numel: int, where: str) -> tuple[str, int]:
    """(kind, count) of a wire encoding (["dense"], ["index", k] or ["bitmap", k]); ValueError
    naming `where` otherwise."""
    if isinstance(encoding, list) and encoding == [DENSE]:
        return DENSE, numel
    if (isinstance(encoding, list) and len(encoding) == 2 and encoding[0] in (INDEX, BITMAP)
            and type(encoding[1]) is int and 0 <= encoding[1] <= numel):
        return encoding[0], encoding[1]
    raise ValueError(f"{where}: encoding {encoding!r} is not [\"dense\"], [\"index\", k] or "
                     f"[\"bitmap\", k] with 0 <= k <= {numel}")


@dataclass
class Patch:
    """One tensor of a push, decoded: `values` (1-D, the engine's dtype) at the flat checkpoint
    positions `indices` (1-D int64, increasing; an index encoding), or where `mask` is true (1-D
    bool over the tensor's elements; a bitmap encoding: no int64 index per element is made
    unless a placement needs one), or every value when both are None."""

    name: str
    shape: tuple[int, ...]
    values: torch.Tensor
    indices: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        return self.indices is None and self.mask is None

    def flat_indices(self) -> torch.Tensor:
        """The changed elements' flat checkpoint positions (1-D int64, increasing)."""
        if self.indices is not None:
            return self.indices
        if self.mask is not None:
            return torch.nonzero(self.mask).reshape(-1)
        return torch.arange(self.numel)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def changed_indices(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices where `new` and `base` (same shape and dtype) differ bit for bit (a
    -0.0 against 0.0 is a change; NaN against the same NaN is not)."""
    if new.dtype != base.dtype or new.shape != base.shape:
        raise ValueError(f"new {new.dtype} {tuple(new.shape)} against base {base.dtype} "
                         f"{tuple(base.shape)}")
    return torch.nonzero(bits(new).reshape(-1) != bits(base).reshape(-1)).reshape(-1)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed as integers of its width (bit-for-bit comparisons)."""
    if tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.itemsize]
    return tensor.contiguous().view(view)


def encode(kind: str, values: torch.Tensor, indices: torch.Tensor, numel: int
           ) -> list[torch.Tensor]:
    """The wire parts of a patch: [values] for dense (all `numel`), else [indices or bitmap,
    values] (`values` 1-D in the engine's dtype at the int64 `indices`)."""
    if kind == DENSE:
        return [values]
    if kind == INDEX:
        return [indices.to(index_dtype(numel)), values]
    mask = torch.zeros(((numel + 7) // 8) * 8, dtype=torch.uint8)
    mask[indices] = 1
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return [(mask.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8), values]


def decode(name: str, kind: str, count: int, shape: tuple[int, ...], dtype: torch.dtype,
           data: torch.Tensor) -> Patch:
    """The Patch that `data` (a `[encoded_bytes]` uint8 buffer of one tensor) holds."""
    numel = math.prod(shape)
    if kind == DENSE:
        return Patch(name, shape, _as(data, dtype))
    if kind == INDEX:
        width = index_dtype(numel).itemsize * count
        indices = _as(data[:width], index_dtype(numel)).to(torch.int64)
        values = _as(data[width:], dtype)
    else:
        width = (numel + 7) // 8
        shifts = torch.arange(8, dtype=torch.uint8)
        mask = ((data[:width, None] >> shifts) & 1).reshape(-1)[:numel].bool()
        values = _as(data[width:], dtype)
        marked = int(mask.sum())
        if marked != count or values.numel() != count:
            raise ValueError(f"{name}: {kind} patch marks {marked} elements and holds "
                             f"{values.numel()} values, not the {count} its encoding says")
        return Patch(name, shape, values, mask=mask)
    if indices.numel() != count or values.numel() != count:
        raise ValueError(f"{name}: {kind} patch holds {indices.numel()} indices and "
                         f"{values.numel()} values, not the {count} its encoding says")
    if count and (int(indices.min()) < 0 or int(indices.max()) >= numel):
        raise ValueError(f"{name}: {kind} patch has an index outside the tensor's {numel} "
                         "elements")
    return Patch(name, shape, values, indices)


def _as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 `data` as 1-D `dtype` (copied first when its offset does not suit the dtype)."""
    if data.storage_offset() % dtype.itemsize:
        data = data.clone()
    return data.view(dtype)


@dataclass(frozen=True)
class Region:
    """A strided view of a flat storage: `offset`, `sizes` and `strides` in elements."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, view: torch.Tensor, base_offset: int = 0) -> Region:
        """The region `view` covers of its storage, from element `base_offset` on."""
        return cls(view.storage_offset() - base_offset, tuple(view.shape), tuple(view.stride()))

    @classmethod
    def from_json(cls, value: Any) -> Region:
        offset, sizes, strides = value
        return cls(int(offset), tuple(int(s) for s in sizes), tuple(int(s) for s in strides))

    def to_json(self) -> list[Any]:
        return [self.offset, list(self.sizes), list(self.strides)]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def whole(self, numel: int) -> bool:
        """Whether it is every element of a contiguous tensor of `numel` elements, in order."""
        return self.offset == 0 and self.numel == numel and self.contiguous()

    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.sizes), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def read(self, flat: torch.Tensor) -> torch.Tensor:
        """The region's elements of `flat` (a 1-D view of the whole storage), as a view."""
        return flat.as_strided(self.sizes, self.strides, flat.storage_offset() + self.offset)

    def locate(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of the flat storage `indices` (int64) lie in the region, their multi-indices
        `[n, ndim]` in it, for those that do). The region must not overlap itself (as any view
        of a contiguous tensor the loader takes does not)."""
        order = sorted(range(len(self.sizes)), key=lambda d: -self.strides[d])
        rest = indices - self.offset
        inside = rest >= 0
        multi = torch.zeros((indices.numel(), len(self.sizes)), dtype=torch.int64)
        for dim in order:
            size, stride = self.sizes[dim], self.strides[dim]
            if size == 1:
                continue
            position = torch.div(rest, stride, rounding_mode="floor")
            inside &= position < size
            multi[:, dim] = position
            rest = rest - position * stride
        inside &= rest == 0
        return inside, multi[inside]

    def positions(self, multi: torch.Tensor) -> torch.Tensor:
        """Flat storage positions of the multi-indices `multi` (`[n, ndim]`) of the region."""
        strides = torch.tensor(self.strides, dtype=torch.int64)
        return self.offset + (multi * strides).sum(dim=1)


def flat_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `tensor`'s whole storage, in its dtype (element 0 at storage offset 0)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, 0, (storage.nbytes() // tensor.itemsize,))


def digest(values: torch.Tensor) -> str:
    """The checksum of `values`: BLAKE2b of its dtype, shape and bytes in row-major order (a
    device tensor is read to the host)."""
    data = bits(values.detach()).contiguous().cpu()
    checksum = hashlib.blake2b(f"{values.dtype}{tuple(values.shape)}".encode(),
                               digest_size=DIGEST_BYTES)
    if data.numel():
        checksum.update(data.reshape(-1).view(torch.uint8).numpy())
    return checksum.hexdigest()


def digest_of(tensor: torch.Tensor, region: Region) -> str:
    """The checksum of `region` of a contiguous checkpoint tensor (the trainer's side)."""
    return digest(region.read(tensor.contiguous().reshape(-1)))
