"""`parallel.ep_size`: the routed experts split over an expert-parallel (EP) group by DeepSpeed's
AutoEP, and what the rest of vlmcp needs to know about it.

The layout (docs/expert-parallelism.md draws it). World W = P (SP) x DP. DeepSpeed builds the EP
groups from consecutive global ranks (`groups._create_expert_and_data_parallel(E, mp_size=P,
mp_mode="sp")`): EP group g = ranks [g*E, (g+1)*E), expert-data-parallel (EDP) group j = the ranks
j, j+E, j+2E, ... (W / E of them). So E = P puts the EP group on the SP group, E = k*P spans k SP
groups (k DP ranks), E < P lies inside an SP group. Any layout is exact: a rank's shard tokens are
tokens like any others to the experts, and every rank of the world runs the same MoE layers in the
same order (the packs of a step are equal in number on every rank, repeats included).

EP rank r of a group holds experts [r*E_local, (r+1)*E_local), E_local = num_experts / E, in each
MoE layer; the router, the shared expert and everything else are replicated as without EP.

What AutoEP does (DeepSpeed 0.19.8, `deepspeed/module_inject/auto_ep*.py`): inside
`deepspeed.initialize` it replaces each `Qwen3_5MoeSparseMoeBlock` by an `AutoEPMoELayer`: a
`TokenChoiceTopKRouter` (softmax, top-k, the top-k renormalised: Qwen3.5-MoE's routing), grouped
experts holding this rank's E_local experts as `w1` [E_local, I, H] (gate), `w3` [E_local, I, H]
(up) and `w2` [E_local, H, I] (down), and the shared expert and its gate as they were. Tokens go
to their experts' ranks and back by a dropless all-to-all (no capacity: every token is computed,
whatever the imbalance). Expert parameters are marked for their EDP group, so ZeRO partitions and
reduces them there; dense parameters are reduced over all W ranks as without EP.

Why the section names the structure instead of `preset_model: "qwen3_5_moe"`: with transformers
5.x, the preset's adapter fails while it retargets transformers' output recorders
(`_CanRecordRegistry.get() takes 2 positional arguments but 3 were given`, in
`auto_ep_presets/base.py`), and it matches only the text backbone's `model_type`. The explicit
patterns select the same modules of vlmcp's training module (its `language_model.layers.N.mlp`)
with the same routing, and skip that adapter.

Why the optimizer is built after the replacement (`moe_optimizer_factory`): ZeRO 1/2 needs the
expert parameters in their own param groups (`split_params_into_different_moe_groups_for_optimizer`)
and the new `w1`/`w2`/`w3` exist only once AutoEP has run; DeepSpeed calls a callable optimizer
with the parameters it holds after the replacement.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vlmcp.training.ds.edits import ABSENT, DeepSpeedEdits, get_path, shown

#: The structure AutoEP is told to replace in vlmcp's training module (`PackedVLM`), and how
#: Qwen3.5-MoE routes (see the module docstring for why no preset).
_AUTOEP_STRUCTURE: dict[str, Any] = {
    "moe_layer_pattern": r"language_model\.layers\.\d+\.mlp",
    "router_pattern": "gate",
    "expert_pattern": "experts",
    "expert_w1": "gate_up_proj",
    "expert_w2": "down_proj",
    "has_shared_experts": True,
    "shared_experts_pattern": "shared_expert",
    "shared_experts_gate_pattern": "shared_expert_gate",
    "score_func": "softmax",
    "score_apply": "post",
    "route_norm": True,
    "route_scale": 1.0,
}

#: AutoEP keys that change the routing or drop tokens: set them and Qwen3.5-MoE's routing is gone.
_ROUTING_KEYS = ("num_expert_groups", "num_limited_groups", "load_balance_coeff",
                 "routed_scaling_factor", "top_k", "expert_w3", "num_experts_attr", "top_k_attr",
                 "expert_activation")


def fill_expert_parallel(config: dict[str, Any], ep_size: int, top_k: int,
                         edits: DeepSpeedEdits) -> None:
    """Fill the DeepSpeed config's `expert_parallel` section for `parallel.ep_size` = `ep_size`.

    With ep_size > 1 the section is enabled with `autoep_size` = ep_size and the structure above;
    a section the user wrote is honoured where it agrees (its other keys, e.g. `comm_backend`, go
    to DeepSpeed as written) and refused where it does not: `autoep_size` != ep_size, a preset, a
    structure or routing key that differs, `enabled: true` at ep_size 1. A disabled section at
    ep_size 1 stays as it is.
    """
    section = config.get("expert_parallel", ABSENT)
    if section is not ABSENT and not isinstance(section, dict):
        edits.problem("config key 'deepspeed.expert_parallel': expected an object")
        return
    if ep_size == 1:
        if section is not ABSENT and section.get("enabled", False) is not False:
            edits.problem("config key 'deepspeed.expert_parallel.enabled' is "
                          f"{shown(section.get('enabled'))} but 'parallel.ep_size' is 1; set "
                          "parallel.ep_size to the expert-parallel size instead (vlmcp fills "
                          "the section)")
        return
    if section is ABSENT:
        edits.set(config, "expert_parallel", {}, "parallel.ep_size > 1 runs DeepSpeed's AutoEP")
    for key, wanted in (("enabled", True), ("autoep_size", ep_size)):
        value = get_path(config, f"expert_parallel.{key}")
        if value is ABSENT or value == "auto":
            edits.set(config, f"expert_parallel.{key}", wanted, f"from parallel.ep_size={ep_size}")
        elif value != wanted:
            edits.problem(f"config key 'deepspeed.expert_parallel.{key}': {shown(value)} "
                          f"disagrees with parallel.ep_size={ep_size}; set it to \"auto\" or make "
                          "them equal")
    preset = get_path(config, "expert_parallel.preset_model")
    if preset not in (ABSENT, None):
        edits.remove(config, "expert_parallel.preset_model",
                     f"{shown(preset)}: vlmcp names the Qwen3.5-MoE structure itself "
                     "(training/ds/expert_parallel.py says why)")
    for key, wanted in _AUTOEP_STRUCTURE.items():
        value = get_path(config, f"expert_parallel.{key}")
        if value is ABSENT:
            edits.set(config, f"expert_parallel.{key}", wanted, "Qwen3.5-MoE in vlmcp's module")
        elif value != wanted:
            edits.problem(f"config key 'deepspeed.expert_parallel.{key}': {shown(value)}; vlmcp's "
                          f"Qwen3.5-MoE needs {shown(wanted)} (remove the key)")
    for key in _ROUTING_KEYS:
        value = get_path(config, f"expert_parallel.{key}")
        if value not in (ABSENT, None) and not (key == "top_k" and value == top_k):
            edits.problem(f"config key 'deepspeed.expert_parallel.{key}': {shown(value)} changes "
                          "Qwen3.5-MoE's routing, which vlmcp trains exactly; remove the key")
    edits.set(config, "expert_parallel.top_k", top_k, "the model's num_experts_per_tok")


def moe_param_groups(params: Iterable[nn.Parameter]) -> list[dict[str, Any]]:
    """`params` as DeepSpeed's MoE param groups: the dense ones in one group, each EP group's
    expert parameters in a group of their own (`moe: True`, named by their group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": list(params),
                                                                 "name": "dense"})


def moe_optimizer_factory(build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
                          ) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """A callable for `deepspeed.initialize(optimizer=...)`: DeepSpeed calls it with the trainable
    parameters after AutoEP's replacement; it builds the optimizer over their MoE param groups."""

    def factory(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return build(moe_param_groups(p for p in params if p.requires_grad))

    return factory


#: AutoEP's names inside a MoE layer -> Qwen3.5-MoE's (transformers) names.
_RENAMED = (("router.gate.weight", "gate.weight"), ("shared_experts_gate.", "shared_expert_gate."),
            ("shared_experts.", "shared_expert."))
_EXPERT_WEIGHT = re.compile(r"(.*\.mlp\.experts)\.(w1|w2|w3)$")


def hf_name(name: str) -> str:
    """A non-expert parameter name of an AutoEP MoE layer under transformers' naming (other
    names come back unchanged)."""
    for autoep, hf in _RENAMED:
        if f".mlp.{autoep}" in name:
            return name.replace(f".mlp.{autoep}", f".mlp.{hf}")
    return name


def autoep_name(name: str) -> str:
    """A non-expert parameter name of a transformers MoE layer under AutoEP's naming (the inverse
    of `hf_name`; other names come back unchanged)."""
    for autoep, hf in _RENAMED:
        if f".mlp.{hf}" in name:
            return name.replace(f".mlp.{hf}", f".mlp.{autoep}")
    return name


def expert_weight(name: str) -> tuple[str, str] | None:
    """(the experts module's name, "w1" | "w2" | "w3") for an AutoEP grouped-experts weight,
    else None."""
    found = _EXPERT_WEIGHT.fullmatch(name)
    return (found.group(1), found.group(2)) if found else None


def hf_expert_tensors(module_name: str, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
                      ) -> dict[str, torch.Tensor]:
    """transformers' fused expert weights from AutoEP's, for the experts they hold:
    gate_up_proj [E', 2I, H] = cat(w1 [E', I, H], w3 [E', I, H]) on dim 1, down_proj [E', H, I]
    = w2. Keys are `{module_name}.gate_up_proj` and `{module_name}.down_proj`."""
    return {f"{module_name}.gate_up_proj": torch.cat([w1, w3], dim=1),
            f"{module_name}.down_proj": w2}


def hf_expert_states(module_name: str, w1: dict[str, torch.Tensor], w2: dict[str, torch.Tensor],
                     w3: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`hf_expert_tensors` for each state of the weights ({state key: tensor} each: the fp32
    value and the optimizer's moments, which move elementwise with it): {transformers weight
    name: {state key: tensor}}."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key in w1:
        for name, value in hf_expert_tensors(module_name, w1[key], w2[key], w3[key]).items():
            states.setdefault(name, {})[key] = value
    return states


def autoep_expert_states(module_name: str, gate_up: dict[str, torch.Tensor],
                         down: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of `hf_expert_states`: AutoEP's `w1` (gate rows of gate_up_proj [E, 2I, H]),
    `w3` (its up rows) and `w2` (= down_proj) of each state: {AutoEP weight name: {state key:
    tensor}}."""
    half = next(iter(gate_up.values())).shape[1] // 2
    return {f"{module_name}.w1": {k: v[:, :half] for k, v in gate_up.items()},
            f"{module_name}.w3": {k: v[:, half:] for k, v in gate_up.items()},
            f"{module_name}.w2": dict(down)}
