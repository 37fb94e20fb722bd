"""Runs inside vLLM's worker: where each pushed tensor lives in the engine, what it computes with,
and patches applied in place (the engine side of sparse pushes and of the delivery check).

Why it exists: vLLM's loader maps a checkpoint tensor into its own parameters (renamed, stacked
into a fused qkv or gate/up parameter, one expert of a stacked MoE weight, narrowed to a
tensor-parallel shard), and on a CPU the post-load step then repacks many of them into kernel
layouts it computes with: the linear layers' weights go into oneDNN or VNNI packs and the
parameter is emptied, the MoE experts and DeltaNet conv weights are permuted in place. So neither
the parameters as vLLM lists them (`/weight_checker` sees the emptied linear weights) nor vLLM's
loader alone (which needs a whole layer before it repacks) can check a push or patch part of it.

**Placements.** During a dense push, the load runs under `LoadRecorder`, a TorchDispatchMode (as
vLLM's own reload counts copies with one, `reload/meta.py: CopyCounter`) that sees every
`aten.copy_` the loader makes from a pushed tensor into a parameter: a `Placement` (checkpoint
name, the source `Region` in the checkpoint tensor, the target `Region` in the parameter's
storage, its dtype). This is vLLM's own sparse-loader contract (`checkpoint_weight_patch.py`: a
loader's writes are final same-shaped `copy_`s), recorded once per dense load instead of replayed
per patch; a whole-tensor copy of a parameter (the layerwise reload copies each processed layer
into its old storage) carries its placements along. A mode is per thread, so, unlike vLLM's
`load_checkpoint_weight_patches` (which replaces `torch.Tensor.copy_` process-wide while it
loads), nothing the API server's other threads copy meanwhile is touched.

**Held tensors.** Each layer's post-load step (`quant_method.process_weights_after_loading`, and
the CPU experts' prepack) runs through `HeldWeights.process`, which keeps the tensors it replaced
(a new parameter, or new data in the same parameter): the weights as loaded before the repack,
which the repack computed from. The check reads the placements there, and a patch writes there
and runs the layer's post-load step again. On a CPU that holds a second copy of every repacked
weight (about the model's size, in the engine's dtype); on a GPU, where the unquantized weights
are not repacked, nothing.

**Patches** (`apply`): each changed element goes to every place the loader put it, in place:
where a placement holds the whole tensor in order in one contiguous run (a whole parameter, a
fused projection's rows, one expert of a stacked weight) straight by the patch's mask or indices,
elsewhere through the placements' regions (`push_patch.Region.locate`, an int64 multi-index per
changed element); every layer whose post-load step
ran is processed again afterwards, the rest (norms, embeddings a kernel reads directly) is
already current. **Checksums** (`checksums`): per placement, the digest of the target region read
in the source region's order: equal to the trainer's digest of the same source region exactly
when the engine holds the pushed values there.

Standard library and torch; vLLM only where named (imported lazily).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlmcp.engine.push_patch import Patch, Region, bits, digest, flat_storage
from vlmcp.engine.vllm_worker import cpu_moe_experts


@dataclass
class Placement:
    """Where vLLM's loader put one part of a checkpoint tensor: its `source` region (elements of
    the checkpoint tensor, row-major) in the `target` region of the storage of `module`'s tensor
    `param` (its held copy when `held`), of `dtype`."""

    name: str
    source: Region
    target: Region
    dtype: torch.dtype
    module: torch.nn.Module | None = field(default=None, repr=False)
    param: str | None = None
    held: bool = False


class LoadRecorder(TorchDispatchMode):
    """Records the placements of the tensors given to `add_sources` while a load runs under it
    (see the module docstring). Holds no reference to a source or target: a storage that dies
    takes its entries with it."""

    def __init__(self) -> None:
        super().__init__()
        #: {storage address: [(first byte, end byte, name, element offset, dtype)]}
        self._sources: dict[int, list[tuple[int, int, str, int, torch.dtype]]] = {}
        #: {storage address: placements landed in that storage}
        self._landing: dict[int, list[Placement]] = {}

    def add_sources(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Watch for copies out of these checkpoint tensors (views of the received buffers)."""
        for name, tensor in pairs:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address not in self._sources:
                self._sources[address] = []
                weakref.finalize(storage, self._sources.pop, address, None)
            start = tensor.storage_offset() * tensor.itemsize
            self._sources[address].append((start, start + tensor.numel() * tensor.itemsize, name,
                                           tensor.storage_offset(), tensor.dtype))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self._note(args[0], args[1])
        return func(*args, **(kwargs or {}))

    def _note(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if target.is_meta or source.is_meta or target.shape != source.shape:
            return
        found = self._source_of(source)
        if found is not None:
            name, base = found
            self._land(target, [Placement(name, Region.of(source, base), Region.of(target),
                                          target.dtype)])
            return
        moved = self._landing.get(source.untyped_storage().data_ptr())
        if moved and _whole(source) and _whole(target) and source.dtype == target.dtype \
                and source.stride() == target.stride():
            self._land(target, moved)

    def _source_of(self, view: torch.Tensor) -> tuple[str, int] | None:
        ranges = self._sources.get(view.untyped_storage().data_ptr())
        if not ranges:
            return None
        byte = view.storage_offset() * view.itemsize
        for start, end, name, offset, dtype in ranges:
            if start <= byte < end and dtype == view.dtype:
                return name, offset
        return None

    def _land(self, target: torch.Tensor, placements: list[Placement]) -> None:
        storage = target.untyped_storage()
        address = storage.data_ptr()
        if address not in self._landing:
            self._landing[address] = []
            weakref.finalize(storage, self._landing.pop, address, None)
        here = self._landing[address]
        for placement in placements:
            placement = Placement(placement.name, placement.source, placement.target,
                                  target.dtype)
            here[:] = [p for p in here if (p.name, p.target) != (placement.name,
                                                                 placement.target)]
            here.append(placement)

    def landed(self) -> dict[int, list[Placement]]:
        """{storage address: the placements in it} of the tensors still alive."""
        return {address: list(entries) for address, entries in self._landing.items()}


def _in_order(placement: Placement, numel: int) -> bool:
    """Whether `placement` puts the whole checkpoint tensor (`numel` elements, row-major) into
    one contiguous run of its target storage, element i at the run's element i (the usual case:
    a whole parameter, a fused projection's rows, one expert of a stacked weight)."""
    return (placement.source.whole(numel) and placement.target.contiguous()
            and placement.target.numel == numel)


def _write_in_order(flat: torch.Tensor, offset: int, patch: Patch) -> None:
    """Write a sparse `patch` into `flat[offset : offset + numel]` by its mask or indices, with
    no per-element multi-index (what `Region.locate` builds for any other placement)."""
    run = flat[offset:offset + patch.numel]
    values = patch.values.to(flat.dtype).to(flat.device)
    if patch.mask is not None:
        run.masked_scatter_(patch.mask.to(flat.device), values)
    else:
        run[patch.indices.to(flat.device)] = values


def _whole(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is its whole storage, contiguous from its start."""
    return (tensor.storage_offset() == 0 and tensor.is_contiguous()
            and tensor.numel() * tensor.itemsize == tensor.untyped_storage().nbytes())


class HeldWeights:
    """One worker's record of the weights it loaded through pushes (see the module docstring):
    the placements by checkpoint name, the held pre-processing tensors by layer, the layers whose
    post-load step ran, and `applied`, the push token of the complete version it holds (None
    before the first push, and from the start of an update until it finished)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.placements: dict[str, list[Placement]] = {}
        self.held: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        self.processed: set[torch.nn.Module] = set()
        self.applied: str | None = None
        self._sealed: str | None = None
        #: Whether `process` keeps what it replaces (off: the push neither patches nor checks).
        self.keep = True
        #: The modules `process` ran on since the caller last cleared it.
        self.recent: set[torch.nn.Module] = set()

    def forget(self) -> None:
        """Drop everything (the engine's weights stay as they are)."""
        self.placements, self.held, self.processed, self.applied = {}, {}, set(), None
        self._sealed = None

    def seal(self, token: str) -> None:
        """The update is complete: the engine holds push `token`'s version, and a fingerprint of
        its live weights is kept to tell later whether anything else changed them."""
        self.applied, self._sealed = token, self.fingerprint()

    def holds(self, token: str) -> str | None:
        """None when the engine holds push `token`'s version, unchanged since; else why not."""
        if self.applied != token:
            return f"holds {self.applied or 'no version pushed whole'}, not {token}"
        if self.fingerprint() != self._sealed:
            return (f"its weights changed since the push of {token} (reloaded from files or "
                    "another way)")
        return None

    def fingerprint(self) -> str:
        """A checksum of what any reload changes: 16 spread elements of every live parameter,
        and the identity of each CPU linear kernel (a reload builds new ones)."""
        checksum = hashlib.blake2b(digest_size=16)
        for module in self.model.modules():
            kernel = getattr(module, "cpu_linear", None)
            if kernel is not None:
                checksum.update(str(id(kernel)).encode())
            for param in module.parameters(recurse=False):
                flat = param.detach().reshape(-1)
                if flat.numel():
                    picks = torch.linspace(0, flat.numel() - 1, 16).long().to(flat.device)
                    checksum.update(bits(flat[picks]).cpu().numpy().tobytes())
        return checksum.hexdigest()

    # -- a dense load -------------------------------------------------------------------------

    def resolve(self, landed: dict[int, list[Placement]]) -> None:
        """After a dense load under a LoadRecorder: each landed placement's owner (the module
        and parameter whose storage, or held copy, it lies in); the placements of every name
        the load placed replace those recorded before. Placements in a storage no parameter
        owns (a temporary of the loader) are dropped: their names then have no placement."""
        owners: dict[int, tuple[torch.nn.Module, str, bool]] = {}
        for module in self.model.modules():
            for name, param in module.named_parameters(recurse=False):
                owners.setdefault(param.untyped_storage().data_ptr(), (module, name, False))
        for module, tensors in self.held.items():
            for name, tensor in tensors.items():
                owners[tensor.untyped_storage().data_ptr()] = (module, name, True)
        fresh: dict[str, list[Placement]] = {}
        for address, placements in landed.items():
            owner = owners.get(address)
            if owner is None:
                continue
            for placement in placements:
                placement.module, placement.param, placement.held = owner
                fresh.setdefault(placement.name, []).append(placement)
        self.placements.update(fresh)

    # -- post-load steps ----------------------------------------------------------------------

    def process(self, module: torch.nn.Module, step: Callable[[torch.nn.Module], Any]) -> Any:
        """Run a post-load `step` of `module`, keeping every tensor it replaced (a parameter, or
        a parameter's data) as the module's held tensor; the module is then one to process again
        after a patch. Under a recording load, the kept tensors keep their placements."""
        self.recent.add(module)
        if not self.keep:
            return step(module)
        before = {name: (param, param.data) for name, param in
                  module.named_parameters(recurse=False)}
        result = step(module)
        after = dict(module.named_parameters(recurse=False))
        kept = self.held.setdefault(module, {})
        for name, (param, data) in before.items():
            now = after.get(name)
            if now is not param:
                kept[name] = param
            elif now.data.data_ptr() != data.data_ptr() or now.data.shape != data.shape:
                kept[name] = data
        if not kept:
            del self.held[module]
        self.processed.add(module)
        return result

    def watching(self) -> Iterator[None]:
        """Route every layer's `quant_method.process_weights_after_loading` through `process`
        while the context is open (an attribute on each method instance, removed at the end)."""
        return _watching(self)

    def reprocess(self, modules: Iterable[torch.nn.Module]) -> int:
        """After a patch: put each module's held tensors back and run its post-load steps again
        (the CPU experts' prepack after the quantization method's own step, as vllm_worker does
        after a reload); returns how many modules it processed."""
        experts = dict(cpu_moe_experts(self.model))
        count = 0
        for module in modules:
            if module not in self.processed:
                continue
            for name, tensor in self.held.get(module, {}).items():
                if isinstance(tensor, torch.nn.Parameter):
                    module.register_parameter(name, tensor)
                else:
                    module._parameters[name].data = tensor
            if hasattr(module, "_already_called_process_weights_after_loading"):
                delattr(module, "_already_called_process_weights_after_loading")
            method = getattr(module, "quant_method", None)
            if method is not None:
                self.process(module, method.process_weights_after_loading)
            if module in experts:
                self.process(module, experts[module].process_weights_after_loading)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
            count += 1
        return count

    # -- patches and checksums ----------------------------------------------------------------

    def tensor_of(self, placement: Placement) -> torch.Tensor:
        """The tensor a placement lies in: the module's held copy, or its live parameter."""
        if placement.held:
            return self.held[placement.module][placement.param]
        return getattr(placement.module, placement.param)

    def apply(self, patches: Iterable[Patch]) -> set[torch.nn.Module]:
        """Write each patch's values to every placement of its tensor, in place; returns the
        modules holding a written tensor (every module of a tied one). ValueError naming a
        tensor this engine holds no placement of."""
        written: set[int] = set()
        for patch in patches:
            placements = self.placements.get(patch.name)
            if not placements:
                raise ValueError(f"{patch.name}: no parameter of this engine holds it (no dense "
                                 "push placed it)")
            for placement in placements:
                target = self.tensor_of(placement)
                flat = flat_storage(target)
                if patch.dense:
                    values = placement.source.read(patch.values).to(flat.dtype)
                    placement.target.read(flat).copy_(values)
                elif _in_order(placement, patch.numel):
                    _write_in_order(flat, placement.target.offset, patch)
                else:
                    inside, multi = placement.source.locate(patch.flat_indices())
                    if not multi.numel():
                        continue
                    positions = placement.target.positions(multi).to(flat.device)
                    flat[positions] = patch.values[inside].to(flat.dtype).to(flat.device)
                written.add(target.untyped_storage().data_ptr())
        return self._holders(written)

    def _holders(self, addresses: set[int]) -> set[torch.nn.Module]:
        """The modules one of whose parameters or held tensors lies in one of the storages."""
        modules = {module for module, tensors in self.held.items()
                   if any(t.untyped_storage().data_ptr() in addresses for t in tensors.values())}
        for module in self.model.modules():
            if any(p.untyped_storage().data_ptr() in addresses
                   for p in module.parameters(recurse=False)):
                modules.add(module)
        return modules

    def checksums(self, with_digests: bool) -> dict[str, list[list[Any]]]:
        """{name: [[source region, dtype name, digest or None], ...]} of every placement."""
        report: dict[str, list[list[Any]]] = {}
        for name, placements in self.placements.items():
            rows = []
            for placement in placements:
                value = None
                if with_digests:
                    flat = flat_storage(self.tensor_of(placement))
                    value = digest(placement.target.read(flat))
                rows.append([placement.source.to_json(),
                             str(placement.dtype).removeprefix("torch."), value])
            report[name] = rows
        return report


@contextmanager
def _watching(held: HeldWeights) -> Iterator[None]:
    methods = []
    for module in held.model.modules():
        method = getattr(module, "quant_method", None)
        step = getattr(method, "process_weights_after_loading", None)
        if step is None or "process_weights_after_loading" in vars(method):
            continue

        def routed(layer: torch.nn.Module, _step: Any = step) -> Any:
            return held.process(layer, _step)

        method.process_weights_after_loading = routed
        methods.append(method)
    try:
        yield
    finally:
        for method in methods:
            vars(method).pop("process_weights_after_loading", None)
