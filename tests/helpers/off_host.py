"""A model device that is not the host, on a machine without a GPU: tensors that hold CPU data
but report the `meta` device, and every op on them held to CUDA's device rules.

On CUDA a host tensor indexed by a device tensor, or any op mixing a device tensor with a host
tensor that is not a 0-dim scalar, raises; on a CPU-only machine both sides are the CPU and
nothing ever does, so such a bug passes every CPU test. Under `off_host()`, `OffHost(t)` (or
`t.to(MODEL_DEVICE)`) is a tensor on "the model's device": ops compute on the CPU data, but an
op whose tensors lie on both sides raises `MixedDevices`, as CUDA would. The rules, those of
CUDA kernels:

- every tensor of an op lies on one device, except a 0-dim host tensor (a scalar) beside device
  tensors;
- `index` / `index_put` of a device tensor may take host indices (CUDA copies them over); a host
  tensor indexed by device indices raises;
- `copy_` and `to` / `cpu()` cross devices;
- a factory with `device=MODEL_DEVICE` (`torch.zeros`, `torch.arange`, `torch.tensor`, ...)
  makes a device tensor; a factory without a device makes a host tensor.

Autograd runs on the wrappers, so a backward that mixes devices raises too. Real `meta` tensors
(no data) never appear: a factory on MODEL_DEVICE outside the rules above raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: The device an `OffHost` tensor reports.
MODEL_DEVICE = torch.device("meta")

_aten = torch.ops.aten
#: Ops that move data between devices.
_CROSS_DEVICE = {_aten._to_copy.default, _aten.copy_.default}
#: Ops whose device `self` may take host indices (args[1], a list of tensors or None).
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
             _aten._index_put_impl_.default}
#: Python-level factories that never reach the dispatcher with their device.
_DATA_FACTORIES = (torch.tensor, torch.as_tensor)


class MixedDevices(RuntimeError):
    """An op mixed host and model-device tensors (CUDA raises here)."""


class OffHost(torch.Tensor):
    """CPU data on MODEL_DEVICE: `elem` holds the values."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OffHost:
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=MODEL_DEVICE,
            requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"OffHost({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return _run(func, args, kwargs or {})


def _on_model_device(device: Any) -> bool:
    return device is not None and torch.device(device) == MODEL_DEVICE


def _devices(func: Any, args: tuple, kwargs: dict) -> set[str]:
    """The devices an op's tensors lie on, by CUDA's rules (see the module docstring)."""
    checked: list[Any] = [args, kwargs]
    if func in _INDEXING and args and isinstance(args[0], OffHost):
        checked = [args[:1], [i for i in args[1] if isinstance(i, OffHost)], args[2:], kwargs]
    found = set()
    for leaf in pytree.tree_leaves(checked):
        if isinstance(leaf, OffHost):
            found.add("model")
        elif isinstance(leaf, torch.Tensor):
            if leaf.device == MODEL_DEVICE:
                raise MixedDevices(f"{func}: a real meta tensor (no data) reached an op: a "
                                   "factory made it outside off_host()")
            if leaf.dim() > 0 or leaf.device.type != "cpu":
                found.add(str(leaf.device))
    return found


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    devices = _devices(func, args, kwargs)
    if len(devices) > 1 and func not in _CROSS_DEVICE:
        raise MixedDevices(f"{func}: tensors on {sorted(devices)} (the host is 'cpu', the "
                           "model's device 'model'); on CUDA this op raises")
    leaves = pytree.tree_leaves((args, kwargs))
    if kwargs.get("device") is not None:
        wrap = _on_model_device(kwargs["device"])
        if wrap:
            kwargs = {**kwargs, "device": torch.device("cpu")}
    else:
        wrap = any(isinstance(leaf, OffHost) for leaf in leaves)
    # an in-place op returns its input: the same wrapper, or the same host tensor
    inputs = {id(leaf.elem if isinstance(leaf, OffHost) else leaf): leaf for leaf in leaves
              if isinstance(leaf, torch.Tensor)}
    plain_args, plain_kwargs = pytree.tree_map_only(OffHost, lambda t: t.elem, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)

    def back(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in inputs:
            return inputs[id(value)]
        return OffHost(value) if wrap else value

    return pytree.tree_map(back, out)


class _Factories(TorchDispatchMode):
    """Factories (no tensor inputs) with device=MODEL_DEVICE make `OffHost` tensors."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, OffHost) for t in types):
            return func(*args, **kwargs)
        return _run(func, args, kwargs)


class _DataFactories(TorchFunctionMode):
    """`torch.tensor(data, device=MODEL_DEVICE)` (which builds its tensor below the dispatcher)
    makes an `OffHost` tensor; `tolist()` of one reads its data (as CUDA copies it back)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DATA_FACTORIES and _on_model_device(kwargs.get("device")):
            return OffHost(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        if func is torch.Tensor.tolist and isinstance(args[0], OffHost):
            return args[0].elem.tolist()
        return func(*args, **kwargs)


@contextmanager
def off_host() -> Iterator[None]:
    """While it lasts, `OffHost` tensors and factories on MODEL_DEVICE follow CUDA's device
    rules (the module docstring)."""
    with _DataFactories(), _Factories():
        yield


def to_model_device(tree: Any) -> Any:
    """Every tensor of `tree` as an `OffHost` copy (leaves keep requires_grad)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: OffHost(t.detach().clone()).requires_grad_(t.requires_grad), tree)
