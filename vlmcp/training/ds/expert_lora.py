"""LoRA on the routed experts (`lora.target_parameters`) under expert parallelism: each rank trains
the adapter pairs of the experts it holds.

Why vlmcp's own code and not PEFT's: PEFT adapts the fused expert weights with a `ParamWrapper`
around transformers' experts module (one rank-r pair per expert, added to the weight while the
module runs). DeepSpeed's AutoEP replaces the whole MoE block inside `deepspeed.initialize`: it
copies the experts' base weights (this rank's slice) into a `GroupedExperts` and drops the wrapper,
adapters and all (the run then trains nothing on the experts). And `GroupedExperts.forward` reads
its `w1`/`w2`/`w3` parameters directly, so no wrapper or hook can add a delta to them. So:

* `take_expert_adapters`, before the replacement: every PEFT wrapper's factors, all experts, in
  per-expert form: A [E, r, in], B [E, out, r] (every rank holds the same; adapters are small),
  and the wrapper swapped for the experts module it wraps (AutoEP detects a MoE block by it);
* `attach_expert_adapters`, after it: each `GroupedExperts` gets this rank's slice as its own
  parameters `lora_A_<weight>` [E_local, r, in] and `lora_B_<weight>` [E_local, out, r], tagged as
  expert parameters of the layer's EP group (ZeRO partitions and reduces them in their
  expert-data-parallel group, like `w1`), and its class becomes `LoraGroupedExperts`, whose forward
  adds scaling * B @ A (the delta PEFT adds) to each projection in low rank, split back into
  AutoEP's w1 (gate) / w3 (up) rows of `gate_up_proj` [E, 2I, H] and w2 = `down_proj` [E, H, I];
* `peft_expert_tensors`: the factors back in PEFT's own layout, for the adapter files.

PEFT's layout (peft/tuners/lora/layer.py, `ParamWrapper.get_delta_weight`, PEFT 0.21): for a
parameter [E, d1, d2], `lora_A.weight` is [r*E, in] (expert e's A in rows e*r..(e+1)*r) and
`lora_B.weight` is [out, r*E] (expert e's column j at j*E + e). Transformers' experts hold
[E, out, in] (`_did_swap_in_out_features`: delta_e = B_e A_e); the other order gives (B_e A_e)^T.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlmcp.parallel import comm

#: Attributes DeepSpeed reads off an expert parameter (set by AutoEP on `w1`/`w2`/`w3`):
#: reduction (`allreduce`, `group_name`) and ZeRO placement.
_EXPERT_TAGS = ("allreduce", "group_name", "ds_zero_placement_family", "ds_zero_partition_group_name",
                "ds_zero_partition_process_group")
_PEFT_WRAPPED = ".base_layer"
#: A checkpoint's file of one EP rank's expert adapter factors (training/checkpoint.py).
EXPERT_ADAPTER_FILE = "expert_adapters_ep_rank_{rank}.pt"


@dataclass(frozen=True)
class ExpertAdapter:
    """What one PEFT adapter pair on one fused expert weight is (its factors live elsewhere).

    Factors A [E', r, in] and B [E', out, r] give the weight's delta scaling * B_e @ A_e,
    transposed when `transposed` (a weight held as [E, in, out]). `peft_name`: the PEFT wrapper's
    module name in the training module (its `lora_A.<adapter>.weight` and `lora_B.<adapter>.weight`
    are the adapter file's keys); `num_experts`: E, over every EP rank."""

    parameter: str
    scaling: float
    transposed: bool
    peft_name: str
    adapter: str
    num_experts: int

    def delta(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """The weight delta [E', d1, d2] of factors A [E', r, in], B [E', out, r]."""
        product = torch.bmm(lora_b, lora_a) * self.scaling
        return product.transpose(-2, -1) if self.transposed else product


#: An adapter and its factors for every expert: A [E, r, in], B [E, out, r].
Captured = dict[str, list[tuple[ExpertAdapter, torch.Tensor, torch.Tensor]]]


def _experts_path(name: str) -> str:
    while name.endswith(_PEFT_WRAPPED):
        name = name[:-len(_PEFT_WRAPPED)]
    return name


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (gathered when ZeRO-3 partitioned it), detached on its device."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()
    return param.detach().clone()


def take_expert_adapters(module: nn.Module) -> Captured:
    """{experts module name: its adapters} of every PEFT `ParamWrapper` in `module` (the routed
    experts adapted by `lora.target_parameters`), each wrapper then replaced by the transformers
    experts module it wraps (AutoEP recognises a MoE block by its plain experts module). Call on
    every rank, before AutoEP's replacement (a ZeRO-3 partitioned factor is gathered)."""
    captured = _captured_adapters(module)
    for path in captured:
        owner, _, attribute = path.rpartition(".")
        wrapper = module.get_submodule(path)
        setattr(module.get_submodule(owner), attribute, wrapper.get_base_layer())
    return captured


def _captured_adapters(module: nn.Module) -> Captured:
    """{experts module name: its adapters}, as `take_expert_adapters` returns them."""
    captured: Captured = {}
    for name, wrapper in module.named_modules():
        if not (hasattr(wrapper, "parameter_name") and hasattr(wrapper, "lora_A")):
            continue
        adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if len(adapters) != 1:
            raise ValueError(f"{name}: expected one active LoRA adapter on the routed experts, "
                             f"found {adapters}")
        adapter = adapters[0]
        experts = wrapper.num_experts
        weight_a = _full(wrapper.lora_A[adapter].weight)                     # [r*E, in]
        weight_b = _full(wrapper.lora_B[adapter].weight)                     # [out, r*E]
        adapter_info = ExpertAdapter(
            parameter=wrapper.parameter_name, scaling=float(wrapper.scaling[adapter]),
            transposed=not wrapper._did_swap_in_out_features, peft_name=name, adapter=adapter,
            num_experts=experts)
        captured.setdefault(_experts_path(name), []).append((
            adapter_info, weight_a.reshape(experts, -1, weight_a.shape[-1]),
            weight_b.reshape(weight_b.shape[0], -1, experts).permute(2, 0, 1).contiguous()))
    return captured


def peft_expert_tensors(adapter: ExpertAdapter, lora_a: torch.Tensor, lora_b: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
    """PEFT's two weights of `adapter` from every expert's factors A [E, r, in], B [E, out, r],
    under the training module's names: A [r*E, in], B [out, r*E]."""
    prefix = f"{adapter.peft_name}.lora_"
    return {f"{prefix}A.{adapter.adapter}.weight": lora_a.reshape(-1, lora_a.shape[-1]),
            f"{prefix}B.{adapter.adapter}.weight": lora_b.permute(1, 2, 0).reshape(lora_b.shape[1], -1)}


class LoraGroupedExperts(nn.Module):
    """The class an adapted AutoEP `GroupedExperts` instance takes (`attach_expert_adapters`):
    its parameters and settings stay; its forward adds the LoRA deltas to the local experts'
    projections in low rank, x @ (W + s B A)^T = x @ W^T + s (x @ A^T) @ B^T, never forming
    W + s B A: backward then keeps x and the [T, r] products, not a merged copy of every local
    expert's weights. The base projections run as the experts module runs them: torch's grouped
    GEMM (`use_grouped_mm`, AutoEP's default: the call DeepSpeed's `_run_experts_grouped_mm`
    makes) or expert by expert; the rank-r products expert by expert (a grouped GEMM wants
    16-byte-aligned strides, which a small r does not give). Never constructed;
    `expert_adapters` ({transformers weight name: ExpertAdapter}) is set on the instance."""

    expert_adapters: dict[str, ExpertAdapter]

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [T, H] (rows grouped by local expert, then padding rows), num_tokens_per_expert
        [E_local] -> [T, H] (zeros on padding rows)."""
        from deepspeed.moe.ep_experts import apply_expert_activation

        sizes = num_tokens_per_expert.tolist()
        grouped = self.use_grouped_mm and not getattr(self, "use_triton_grouped_mm", False)
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)

        def project(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            """rows [T, in] -> [T, out], each expert's rows through its weight [E', out, in]."""
            if grouped:
                return torch._grouped_mm(rows, weight.to(rows.dtype).transpose(-2, -1),
                                         offs=offsets)
            return per_expert(rows, sizes, lambda e, part: part @ weight[e].to(rows.dtype).T)

        gate, up = project(x, self.w1), project(x, self.w3)
        adapter = self.expert_adapters.get("gate_up_proj")
        if adapter is not None:   # [E', 2I, H]: gate rows, then up rows
            delta = self.low_rank(x, sizes, adapter, "gate_up_proj")
            gate = gate + delta[:, :gate.shape[1]]
            up = up + delta[:, gate.shape[1]:]
        hidden = apply_expert_activation(gate, up, self.activation, self.activation_alpha,
                                         self.activation_limit, fused=False)
        out = project(hidden, self.w2)
        adapter = self.expert_adapters.get("down_proj")
        if adapter is not None:   # [E', H, I]
            out = out + self.low_rank(hidden, sizes, adapter, "down_proj")
        return out

    def low_rank(self, rows: torch.Tensor, sizes: list[int], adapter: ExpertAdapter,
                 weight: str) -> torch.Tensor:
        """rows [T, in] -> [T, out]: each expert's rows times its delta's transpose, s (B A)^T
        (A [E', r, in], B [E', out, r]; held transposed, s B A: A [E', r, out], B [E', in, r]),
        through the r-wide product only."""
        lora_a, lora_b = getattr(self, f"lora_A_{weight}"), getattr(self, f"lora_B_{weight}")
        scaling = adapter.scaling

        def one(expert: int, part: torch.Tensor) -> torch.Tensor:
            a, b = lora_a[expert].to(part.dtype), lora_b[expert].to(part.dtype)
            if adapter.transposed:
                return (part @ b) @ a * scaling
            return (part @ a.T) @ b.T * scaling

        return per_expert(rows, sizes, one)


def per_expert(rows: torch.Tensor, sizes: list[int],
               step: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """rows [T, in] grouped by expert (`sizes` rows each), padding rows last -> [T, out]:
    `step(e, expert e's rows)` for each expert, zeros on the padding rows."""
    used = sum(sizes)
    out = torch.cat([step(expert, part)
                     for expert, part in enumerate(torch.split(rows[:used], sizes))])
    return torch.cat([out, out.new_zeros(rows.shape[0] - used, out.shape[1])])


@functools.cache
def _adapted_class(base: type) -> type:
    """`LoraGroupedExperts` over AutoEP's experts class `base` (one class per base)."""
    return type(f"Lora{base.__name__}", (LoraGroupedExperts, base), {})


def attach_expert_adapters(module: nn.Module, captured: Captured) -> int:
    """Give each AutoEP `GroupedExperts` of `module` named in `captured` this rank's slice of its
    adapters (see the module docstring); returns how many experts modules were adapted. The
    experts a rank holds are its EP rank's contiguous block (AutoEP's uniform placement)."""
    for path, adapters in captured.items():
        experts = module.get_submodule(path)
        layer = module.get_submodule(path.rpartition(".")[0])
        local = slice(layer.ep_rank * layer.num_local_experts,
                      (layer.ep_rank + 1) * layer.num_local_experts)
        for adapter, lora_a, lora_b in adapters:
            for factor, full in (("A", lora_a), ("B", lora_b)):
                param = nn.Parameter(full[local].to(experts.w1.device).contiguous())
                for tag in _EXPERT_TAGS:
                    if hasattr(experts.w1, tag):
                        setattr(param, tag, getattr(experts.w1, tag))
                experts.register_parameter(f"lora_{factor}_{adapter.parameter}", param)
        experts.expert_adapters = {adapter.parameter: adapter for adapter, _, _ in adapters}
        experts.__class__ = _adapted_class(type(experts))
    return len(captured)


def adapter_factors(experts: nn.Module) -> dict[str, tuple[ExpertAdapter, nn.Parameter, nn.Parameter]]:
    """{weight: (adapter, A [E_local, r, in], B [E_local, out, r])} of an adapted experts module;
    empty for any other module."""
    return {weight: (adapter, getattr(experts, f"lora_A_{weight}"), getattr(experts, f"lora_B_{weight}"))
            for weight, adapter in getattr(experts, "expert_adapters", {}).items()}


def gathered_expert_adapters(module: nn.Module) -> tuple[dict[str, torch.Tensor], set[int]]:
    """(PEFT's weights of every expert adapter of `module`, every expert, under the training
    module's names; the ids of the local factor parameters they stand for). Call on every rank:
    each factor [E_local, ...] is gathered from the world (ZeRO-3 partitions first), and EP group
    0's ranks (global ranks 0..E-1, AutoEP's layout) hold the experts in order."""
    state: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for _, experts in module.named_modules():
        for adapter, lora_a, lora_b in adapter_factors(experts).values():
            taken.update((id(lora_a), id(lora_b)))
            full = []
            for local in (lora_a, lora_b):
                value = _full(local).cpu()                                 # [E_local, ...]
                ep_size = adapter.num_experts // value.shape[0]
                full.append(comm.all_gather_world(value)[:ep_size].flatten(0, 1))
            state.update(peft_expert_tensors(adapter, *full))
    return state, taken


def local_adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """{training-module name: this rank's factor [E_local, ...]} of every expert adapter of
    `module` (on CPU; empty without any). The factors are whole on every rank (ZeRO 1/2)."""
    return {f"{path}.{name}": param.detach().cpu().clone()
            for path, experts in module.named_modules() if adapter_factors(experts)
            for name, param in experts.named_parameters(recurse=False) if name.startswith("lora_")}


def peft_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (names of `model`, a transformers model with PEFT's expert adapters) with every
    per-expert factor `<experts>.lora_A_<weight>` [E, r, in] / `lora_B_<weight>` [E, out, r]
    replaced by the PEFT weights of `model`'s wrapper of that weight."""
    out = dict(state)
    for path, adapters in _captured_adapters(model).items():
        for adapter, _, _ in adapters:
            lora_a = out.pop(f"{path}.lora_A_{adapter.parameter}", None)
            lora_b = out.pop(f"{path}.lora_B_{adapter.parameter}", None)
            if lora_a is not None and lora_b is not None:
                out.update(peft_expert_tensors(adapter, lora_a, lora_b))
    return out


def restore_local_adapters(module: nn.Module, tag_dir: Path) -> None:
    """Load this rank's experts' adapter factors from the checkpoint `tag_dir` (the file its EP
    rank's writer saved) into `module`'s adapted experts, in place; nothing without any. DeepSpeed
    loads every rank's module from rank 0's model states, which hold rank 0's experts' factors."""
    adapted = [(path, experts) for path, experts in module.named_modules() if adapter_factors(experts)]
    if not adapted:
        return
    layer = module.get_submodule(adapted[0][0].rpartition(".")[0])
    saved = torch.load(tag_dir / EXPERT_ADAPTER_FILE.format(rank=layer.ep_rank),
                       map_location="cpu", weights_only=True)
    with torch.no_grad():
        for path, experts in adapted:
            for name, param in experts.named_parameters(recurse=False):
                if name.startswith("lora_"):
                    param.copy_(saved[f"{path}.{name}"])
