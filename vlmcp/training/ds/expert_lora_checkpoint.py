"""The routed experts' LoRA factors (training/ds/expert_lora.py) in a checkpoint: each expert's
factors and optimizer state, in files of their own, readable at any layout.

DeepSpeed's checkpoint of an expert-parallel run holds these factors in forms no other layout
reads: its model states only EP rank 0's, its optimizer partitions each EP rank's over its
expert-data-parallel group, and its universal conversion knows AutoEP's `w1`/`w2`/`w3` as experts
but not them. So, at every save, the ranks of EP group 0 (global ranks 0..E-1, AutoEP's layout)
each write their experts' share:

    expert_adapters_ep_rank_<r>.pt        {training-module name: fp32 factor [E_local, ...]}
    expert_adapter_states_ep_rank_<r>.pt  {training-module name: {optimizer state key (exp_avg,
                                          exp_avg_sq, ...): [E_local, ...]}, "step": optimizer step}

with `E_local` = E / ep_size experts each, in EP-rank order. `vlmcp export` stacks the first
files into every expert's factors; a resume at the saved layout restores this rank's factors
from them (`restore_expert_adapters`: DeepSpeed loads every rank's module from rank 0's model
states); a resume at another layout gets them whole through the universal checkpoint
(`saved_expert_adapter_states`, training/weights/universal.py), which DeepSpeed slices for each
new EP rank.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmcp.parallel import comm
from vlmcp.training.ds.expert_lora import adapter_factors, expert_adapters_of

#: A checkpoint's file of one EP rank's expert adapter factors (fp32).
EXPERT_ADAPTER_FILE = "expert_adapters_ep_rank_{rank}.pt"
#: A checkpoint's file of one EP rank's expert adapter optimizer states.
EXPERT_ADAPTER_STATE_FILE = "expert_adapter_states_ep_rank_{rank}.pt"
#: A checkpoint's description of the routed experts' adapters (any EP size): {experts module
#: name: [{"parameter", "peft_name", "adapter", "num_experts"}]}, the names PEFT gives the
#: factors at EP 1 and vlmcp's under EP (training/weights/universal.py maps one to the other).
EXPERT_ADAPTERS_JSON = "expert_adapters.json"


def _factor_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(training-module name, parameter) of every expert adapter factor of `module`, in order."""
    return [(f"{path}.{name}", param)
            for path, experts in module.named_modules() if adapter_factors(experts)
            for name, param in experts.named_parameters(recurse=False) if name.startswith("lora_")]


def _base_state(optimizer: Any) -> dict[str, Any]:
    """One state entry of the torch optimizer under DeepSpeed's wrapper (any: every parameter of a
    run steps together), or {} before its first step."""
    base = getattr(optimizer, "optimizer", optimizer)
    return next(iter(base.state.values()), {})


def _full_fp32(param: nn.Parameter) -> torch.Tensor:
    """The parameter's whole fp32 value: ZeRO's master copy gathered (a collective of its
    partition group under ZeRO 1-3), else the parameter itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    return (param.detach() if value is None else value).float().cpu().clone()


def _full_state(param: nn.Parameter, key: str, optimizer: Any) -> torch.Tensor:
    """The parameter's whole optimizer state `key`, gathered like `_full_fp32`."""
    from deepspeed.utils import safe_get_full_optimizer_state

    value = safe_get_full_optimizer_state(param, key)
    if value is None:
        value = getattr(optimizer, "optimizer", optimizer).state[param][key]
    return value.float().cpu().clone()


def _link_optimizer_states(optimizer: Any) -> None:
    """Point every ZeRO-1/2 parameter's view of the optimizer state at its param group's state.

    DeepSpeed 0.19.8 links the views once, after the first param group's first step, when the
    other groups (the expert groups under EP) have no state yet, and never again; reading an
    expert parameter's moments (`safe_get_full_optimizer_state`) then fails with "exp_avg not
    found in optimizer state fragment". This is the link DeepSpeed makes, made for every group
    (each has state by now)."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for lp_group, flat in zip(getattr(optimizer, "bit16_groups", ()),
                              getattr(optimizer, "single_partition_of_fp32_groups", ())):
        lazy_init_hp_params_optimizer_state(lp_group, flat, optimizer.optimizer.state)


def save_expert_adapters(engine: Any, directory: Path, ep_size: int) -> None:
    """Write this EP rank's expert adapter files into `directory` when this rank is in EP group 0
    (module docstring), and on rank 0 their description (`EXPERT_ADAPTERS_JSON`, at any EP
    size); call on every rank (the gathers are collectives); nothing without expert adapters."""
    described = {path: [{"parameter": a.parameter, "peft_name": a.peft_name,
                         "adapter": a.adapter, "num_experts": a.num_experts} for a in adapters]
                 for path, adapters in expert_adapters_of(engine.module).items()}
    params = _factor_params(engine.module)
    if not params:
        _write_description(described, directory)
        return
    _link_optimizer_states(engine.optimizer)
    state = _base_state(engine.optimizer)
    keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() > 1)
    values = {name: _full_fp32(param) for name, param in params}
    states: dict[str, Any] = {name: {key: _full_state(param, key, engine.optimizer) for key in keys}
                              for name, param in params}
    step = state.get("step", 0)
    states["step"] = int(step.item() if torch.is_tensor(step) else step)
    # every gather above is done before any write: a write that fails leaves no peer waiting
    _write_description(described, directory)
    if comm.rank() < ep_size:
        torch.save(values, directory / EXPERT_ADAPTER_FILE.format(rank=comm.rank()))
        torch.save(states, directory / EXPERT_ADAPTER_STATE_FILE.format(rank=comm.rank()))


def _write_description(described: dict[str, list[dict[str, Any]]], directory: Path) -> None:
    """Rank 0: the adapters' description (`EXPERT_ADAPTERS_JSON`), when there are any."""
    if described and comm.rank() == 0:
        (directory / EXPERT_ADAPTERS_JSON).write_text(json.dumps(described, indent=1))


def restore_expert_adapters(module: nn.Module, tag_dir: Path) -> None:
    """Load this rank's experts' adapter factors from the checkpoint `tag_dir` (its EP rank's file)
    into `module`'s adapted experts, in place; nothing without any. ZeRO 0-2 hold the factors whole
    on every rank (ZeRO-3 partitions restore from DeepSpeed's own optimizer files)."""
    params = _factor_params(module)
    if not params or hasattr(params[0][1], "ds_id"):
        return
    layer = module.get_submodule(params[0][0].rsplit(".", 2)[0])
    saved = torch.load(tag_dir / EXPERT_ADAPTER_FILE.format(rank=layer.ep_rank),
                       map_location="cpu", weights_only=True)
    with torch.no_grad():
        for name, param in params:
            param.copy_(saved[name])


def _stacked(tag_dir: Path, pattern: str) -> list[dict[str, Any]]:
    """The EP ranks' files of `pattern` in `tag_dir`, in rank order."""
    found = []
    for rank in itertools.count():
        path = tag_dir / pattern.format(rank=rank)
        if not path.is_file():
            return found
        found.append(torch.load(path, map_location="cpu", weights_only=True))


def saved_expert_factors(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Every expert's adapter factors of the checkpoint `tag_dir` ([E, ...], the EP ranks' files
    stacked), under the training module's names; empty without any."""
    parts = _stacked(tag_dir, EXPERT_ADAPTER_FILE)
    return {name: torch.cat([part[name].float() for part in parts]) for name in parts[0]} \
        if parts else {}


def saved_expert_adapter_states(tag_dir: Path) -> dict[str, dict[str, Any]]:
    """{training-module name: {"fp32": [E, ...], each optimizer state key: [E, ...], "step": n}} of
    every expert adapter factor of the checkpoint `tag_dir`; empty without any. Raises ValueError
    for a checkpoint with factors but no optimizer states (saved by an earlier vlmcp)."""
    factors = saved_expert_factors(tag_dir)
    if not factors:
        return {}
    parts = _stacked(tag_dir, EXPERT_ADAPTER_STATE_FILE)
    if not parts:
        raise ValueError(f"{tag_dir} holds the routed experts' LoRA factors without their "
                         f"optimizer states ({EXPERT_ADAPTER_STATE_FILE.format(rank=0)}: saved by "
                         "an earlier vlmcp), which a resume at another layout needs")
    step = parts[0]["step"]
    return {name: {"fp32": value, "step": step,
                   **{key: torch.cat([part[name][key] for part in parts])
                      for key in parts[0][name]}}
            for name, value in factors.items()}


def saved_adapter_descriptions(tag_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The checkpoint's `EXPERT_ADAPTERS_JSON` (empty without LoRA on the routed experts)."""
    path = Path(tag_dir) / EXPERT_ADAPTERS_JSON
    return json.loads(path.read_text()) if path.is_file() else {}
