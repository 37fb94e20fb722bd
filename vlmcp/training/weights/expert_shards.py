"""The routed experts in Hugging Face's layout under expert parallelism, each written by a rank that
holds it.

Under `parallel.ep_size` E each MoE layer of the live model is DeepSpeed's `AutoEPMoELayer`
(training/ds/expert_parallel.py): this rank holds `num_experts / E` experts as `experts.w1`
(gate) [E_local, I, H], `experts.w3` (up) [E_local, I, H] and `experts.w2` (down) [E_local, H, I],
and names its router and shared expert its own way. No rank holds every expert, so no rank can
write transformers' fused `experts.gate_up_proj` [E, 2I, H] of a layer. The weights go out in the
layout of the published Qwen3.5-MoE checkpoints instead, which transformers (its conversion
mapping) and vLLM load as they load those checkpoints: one tensor per expert and projection,

    {layer}.mlp.experts.{e}.gate_proj.weight   [I, H]   = w1[local index of e]
    {layer}.mlp.experts.{e}.up_proj.weight     [I, H]   = w3[...]
    {layer}.mlp.experts.{e}.down_proj.weight   [H, I]   = w2[...]

and the router and shared expert under transformers' names (`gate.weight`, `shared_expert.*`,
`shared_expert_gate.weight`). Which experts a rank holds comes from the layer's own placement
(`expert_placement_descriptor`, DeepSpeed's `autoep_experts_for_rank`), and which ranks hold EP
rank j's experts from the layout (EP groups of consecutive ranks: every rank r with r % E == j).

`hf_layout` rewrites `saved_tensors`' {key: tensor} this way: every expert of every layer gets its
key, so every rank computes the same `SharePlan`; a key this rank holds is a view of its live
weights (ZeRO 0-2), or under ZeRO-3, where the weights are partitioned over the expert-data-parallel
group, a placeholder that `gather_expert_slices` fills; a key it does not hold is a meta-device
placeholder of the right shape and dtype (its size is all the plan reads). `expert_holders` says
which ranks may write each expert key: the plan gives each to one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlmcp.training.ds.expert_parallel import hf_name

#: transformers' per-expert projection names, by AutoEP's weight name.
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class ExpertLayer:
    """One AutoEP MoE layer of the live model: its name inside the HF model, and the global ids
    of the experts this rank holds, in the local order of `w1`/`w2`/`w3`."""

    name: str
    module: nn.Module
    experts: tuple[int, ...]

    @property
    def ep_size(self) -> int:
        return int(self.module.ep_size)

    @property
    def num_experts(self) -> int:
        return int(self.module.num_experts)

    def key(self, expert: int, weight: str) -> str:
        return f"{self.name}.experts.{expert}.{_PROJECTIONS[weight]}.weight"


def expert_layers(hf_model: nn.Module) -> list[ExpertLayer]:
    """The AutoEP MoE layers of `hf_model`, in module order (empty without expert parallelism)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [ExpertLayer(name, module, experts_of(module, module.ep_rank))
            for name, module in hf_model.named_modules() if isinstance(module, AutoEPMoELayer)]


def experts_of(module: nn.Module, ep_rank: int) -> tuple[int, ...]:
    """The global ids of the experts EP rank `ep_rank` holds in the AutoEP layer `module`, in its
    local order: the layer's own placement (DeepSpeed's `autoep_experts_for_rank`)."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return tuple(autoep_experts_for_rank(module.expert_placement_descriptor, ep_rank))


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def _expert_entry(param: nn.Parameter, local: int | None) -> nn.Parameter:
    """The saved-tensor entry of one expert of `param` ([E_local, a, b], possibly ZeRO-3
    partitioned): a view [a, b] of expert `local` when this rank holds it whole, else a
    placeholder [a, b] (`expert_source`/`expert_index` set when this rank holds it partitioned)."""
    shape = tuple(getattr(param, "ds_shape", param.shape))[1:]
    if local is None:
        return _placeholder(shape, param.dtype)
    if hasattr(param, "ds_id"):
        entry = _placeholder(shape, param.dtype)
        entry.expert_source, entry.expert_index = param, local
        return entry
    return nn.Parameter(param.detach()[local], requires_grad=False)


def hf_layout(hf_model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` ({key: live tensor} of `hf_model`, `saved_tensors`' order) in Hugging Face's layout
    (the module docstring): each AutoEP layer's tensors replaced by transformers' names, its
    routed experts by one entry per expert and projection, all experts of the layer, in expert
    order. Unchanged without expert parallelism."""
    layers = expert_layers(hf_model)
    if not layers:
        return tensors
    by_prefix = {f"{layer.name}.": layer for layer in layers}
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for key, value in tensors.items():
        layer = next((by_prefix[p] for p in by_prefix if key.startswith(p)), None)
        if layer is None:
            out[key] = value
            continue
        if not key.startswith(f"{layer.name}.experts."):
            out[hf_name(key)] = value
            continue
        if layer.name in done:
            continue
        done.add(layer.name)
        local = {expert: i for i, expert in enumerate(layer.experts)}
        weights = {name: getattr(layer.module.experts, name) for name in _PROJECTIONS}
        for expert in range(layer.num_experts):
            for name in ("w1", "w3", "w2"):
                out[layer.key(expert, name)] = _expert_entry(weights[name], local.get(expert))
    return out


def expert_holders(hf_model: nn.Module, world: int) -> dict[str, tuple[int, ...]]:
    """{per-expert key: the global ranks holding that expert} over a world of `world` ranks (the
    layer's placement per EP rank, EP groups of consecutive ranks: EP rank j is every rank r with
    r % E == j; the same on every rank); empty without expert parallelism."""
    holders: dict[str, tuple[int, ...]] = {}
    for layer in expert_layers(hf_model):
        for ep_rank in range(layer.ep_size):
            ranks = tuple(r for r in range(world) if r % layer.ep_size == ep_rank)
            for expert in experts_of(layer.module, ep_rank):
                for name in _PROJECTIONS:
                    holders[layer.key(expert, name)] = ranks
    return holders


def is_gathered_slice(tensor: torch.Tensor) -> bool:
    """Whether a saved-tensor entry is an expert this rank holds ZeRO-3 partitioned."""
    return hasattr(tensor, "expert_source")


def gather_expert_slices(tensors: dict[str, torch.Tensor], keys: set[str]
                         ) -> dict[str, torch.Tensor]:
    """{key: CPU tensor} of the entries of `keys` that are ZeRO-3 partitioned experts
    (`is_gathered_slice`). Each source parameter ([E_local, a, b], partitioned over this rank's
    expert-data-parallel group) is gathered with DeepSpeed's `GatheredParameters`, one at a time,
    in `tensors`' order, which is the same layer by layer on every rank: call on every rank (each
    gathers within its own group), also one that writes none of them."""
    import deepspeed

    sources: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for key, entry in tensors.items():
        if is_gathered_slice(entry):
            sources.setdefault(id(entry.expert_source), (entry.expert_source, []))[1].append(key)
    out = {}
    for param, entry_keys in sources.values():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            for key in entry_keys:
                if key in keys:
                    out[key] = param.detach()[tensors[key].expert_index].cpu().clone()
    return out
