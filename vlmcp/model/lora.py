"""LoRA adapters (PEFT) on the language model of a Qwen3.5 VLM.

The job's `lora` section names modules the way PEFT does: an entry matches a module whose full
name equals it or ends with "." + entry (`"q_proj"`, `"linear_attn.out_proj"`), and
`"all-linear"` stands for every `nn.Linear` of the decoder layers. An entry that matches modules
of the language model selects only those (`"norm"` never reaches the vision merger's norm). vlmcp resolves the entries
itself, against the whole model, before PEFT sees them, and hands PEFT only full module names of
the language model, so that:

* the vision tower (frozen, replicated outside DeepSpeed), the embeddings and the lm_head are
  never adapted: the fused cross-entropy (model.loss) reads `lm_head.weight` directly, and the
  sharded DeltaNet forward (model.deltanet) reads `conv1d.weight` directly, so an adapter on
  either would be silently skipped; naming them is an error;
* every other adapted module is called as a module by the SP code (the DeltaNet projections by
  model.deltanet, the attention and MLP projections by transformers' own layer code), so PEFT's
  wrappers run under SP exactly as on one rank;
* an entry that matches nothing is an error before any rank starts (`lora_problems`, on a
  meta-device model).

In a `qwen3_5_moe` model the routed experts hold fused 3-D weights (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]), not Linear modules: `target_modules` refuses them
and `gate_proj`/`up_proj`/`down_proj` there adapt the shared expert's Linear layers. The section's
`target_parameters` adapts them instead, through PEFT's `target_parameters` (a `ParamWrapper`
around the experts module: one rank-r pair per expert, added to the weight while the module runs).
Its entries match parameter names the same way, inside the language model, and must land on a
routed-experts module (anything else is a Linear for `target_modules`, or a weight the SP code
reads directly). The experts module is called as a module by transformers' MoE block, so the
wrapper runs under SP as on one rank.

`apply_lora` injects the adapters in place: the transformers model keeps its class and module
paths (wrapped Linear layers become PEFT `LoraLayer`s with a `base_layer`), every base weight is
frozen, and only the adapter weights (and `modules_to_save` copies) require gradients.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from vlmcp.config import LoraSection
from vlmcp.errors import LoraError
from vlmcp.model.flops import AdapterFlops
from vlmcp.model.load import MODEL_CLASSES

logger = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"
#: Where the decoder layers live inside `Qwen3_5(Moe)ForConditionalGeneration`.
LAYERS_PREFIX = "model.language_model.layers."
LANGUAGE_MODEL_PREFIX = "model.language_model."
_FUSED_EXPERTS = ("the routed experts hold fused 3-D weights, not Linear layers: adapt them with "
                  "lora.target_parameters (e.g. [\"mlp.experts.gate_up_proj\", "
                  "\"mlp.experts.down_proj\"]); in lora.target_modules, gate_proj, up_proj and "
                  "down_proj adapt the shared expert")


def _matches(name: str, entry: str) -> bool:
    return name == entry or name.endswith("." + entry)


def _refused(name: str, key: str, entry: str) -> str | None:
    """Why module `name` (matched by `entry` of `lora.<key>`) must not be adapted, or None."""
    where = f"config key 'lora.{key}': {entry!r} matches {name}"
    if name.startswith("model.visual.") or name == "model.visual":
        return f"{where}, in the vision tower, which stays frozen under LoRA"
    if name == "lm_head":
        return (f"{where}: the lm_head stays frozen under LoRA (the fused cross-entropy reads its "
                "weight directly)")
    if name.endswith("embed_tokens"):
        return f"{where}: the embeddings stay frozen under LoRA"
    if not name.startswith(LANGUAGE_MODEL_PREFIX):
        return f"{where}, outside the language model ({LANGUAGE_MODEL_PREFIX}*)"
    if name.endswith(".conv1d"):
        return (f"{where}: the sharded DeltaNet reads the conv1d weight directly, so it cannot be "
                "wrapped")
    return None


def _scoped_matches(modules: dict[str, nn.Module], entry: str, key: str) -> list[str]:
    """Modules `entry` matches: those inside the language model when there are any (matches
    elsewhere, e.g. the vision merger's `norm`, are left out with a log line), else all (which
    `_refused` then names)."""
    found = [n for n in modules if _matches(n, entry)]
    inside = [n for n in found if n.startswith(LANGUAGE_MODEL_PREFIX)]
    if inside and len(inside) < len(found):
        logger.info("lora.%s: %r also matches %d modules outside the language model (e.g. %s); "
                    "only the language model's are used", key, entry, len(found) - len(inside),
                    next(n for n in found if n not in inside))
    return inside or found


def resolve_lora_modules(model: nn.Module, section: LoraSection) -> tuple[list[str], list[str]]:
    """(full names of the Linear modules to adapt, full names of the modules to train whole).

    Raises LoraError listing every entry that matches nothing or matches a module that must stay
    frozen, that is not a Linear (targets) or not a leaf module (modules_to_save).
    """
    modules = dict(model.named_modules())
    parameters = [n for n, _ in model.named_parameters()]
    problems: list[str] = []

    entries = section.target_modules
    if entries == ALL_LINEAR:
        targets = {n for n, m in modules.items()
                   if n.startswith(LAYERS_PREFIX) and isinstance(m, nn.Linear)}
    else:
        targets = set()
        for entry in entries:
            found = _scoped_matches(modules, entry, "target_modules")
            if not found and any(_matches(n, entry) and ".experts." in n for n in parameters):
                problems.append(f"config key 'lora.target_modules': {entry!r} names a parameter "
                                f"of the routed experts: {_FUSED_EXPERTS}")
            elif not found:
                problems.append(f"config key 'lora.target_modules': {entry!r} matches no module "
                                f"of the model (e.g. q_proj, in_proj_qkv, down_proj, or "
                                f"{ALL_LINEAR!r})")
            for name in found:
                problem = _refused(name, "target_modules", entry)
                if problem is None and not isinstance(modules[name], nn.Linear):
                    kind = type(modules[name]).__name__
                    problem = (f"config key 'lora.target_modules': {entry!r} matches {name}, a "
                               f"{kind}; LoRA targets Linear layers"
                               + (f" ({_FUSED_EXPERTS})" if kind.endswith("Experts") else ""))
                if problem:
                    problems.append(problem)
                else:
                    targets.add(name)

    to_save: set[str] = set()
    for entry in section.modules_to_save:
        found = _scoped_matches(modules, entry, "modules_to_save")
        if not found:
            problems.append(f"config key 'lora.modules_to_save': {entry!r} matches no module of "
                            "the model")
        for name in found:
            problem = _refused(name, "modules_to_save", entry)
            if problem is None and (any(True for _ in modules[name].children())
                                    or not any(True for _ in modules[name].parameters())):
                problem = (f"config key 'lora.modules_to_save': {entry!r} matches {name}, which "
                           "is not a leaf module with weights; name norms or Linear layers")
            if problem is None and name in targets:
                problem = (f"config key 'lora.modules_to_save': {name} is also a LoRA target "
                           "(lora.target_modules)")
            if problem:
                problems.append(problem)
            else:
                to_save.add(name)
    if not targets and not problems and not section.target_parameters:
        problems.append("config key 'lora.target_modules': selects no Linear layer of the "
                        "decoder layers")
    if problems:
        raise LoraError(problems)
    return sorted(targets), sorted(to_save)


def _is_experts(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Experts")


def resolve_lora_parameters(model: nn.Module, section: LoraSection) -> list[str]:
    """Full names of the routed experts' fused parameters `lora.target_parameters` selects.

    Raises LoraError listing every entry that matches no parameter, or matches one outside the
    language model or not held by a routed-experts module.
    """
    modules = dict(model.named_modules())
    names = [n for n, _ in model.named_parameters()]
    problems: list[str] = []
    selected: set[str] = set()
    for entry in section.target_parameters:
        found = [n for n in names if _matches(n, entry)]
        inside = [n for n in found if n.startswith(LANGUAGE_MODEL_PREFIX)]
        if not found:
            problems.append(f"config key 'lora.target_parameters': {entry!r} matches no parameter "
                            "of the model (the routed experts' are mlp.experts.gate_up_proj and "
                            "mlp.experts.down_proj, in a qwen3_5_moe model)")
        for name in inside or found:
            owner = name.rpartition(".")[0]
            problem = _refused(owner, "target_parameters", entry)
            if problem is None and not _is_experts(modules[owner]):
                problem = (f"config key 'lora.target_parameters': {entry!r} matches {name}, not a "
                           "weight of the routed experts (mlp.experts.*); adapt Linear layers "
                           "with lora.target_modules")
            if problem:
                problems.append(problem)
            else:
                selected.add(name)
    if problems:
        raise LoraError(problems)
    return sorted(selected)


def _target_pattern(targets: list[str], modules: list[str]) -> str | list[str]:
    """A compact regex over leaf names for PEFT's `target_modules` when it selects exactly
    `targets` among `modules`; else the explicit list of full names."""
    leaves = sorted({t.rsplit(".", 1)[1] for t in targets})
    pattern = rf"{re.escape(LAYERS_PREFIX)}\d+\.(?:.+\.)?(?:{'|'.join(map(re.escape, leaves))})"
    if {n for n in modules if re.fullmatch(pattern, n)} == set(targets):
        return pattern
    return targets


def _resolve(model: nn.Module, section: LoraSection) -> tuple[list[str], list[str], list[str]]:
    """(Linear targets, modules_to_save, fused expert parameters); one LoraError naming the
    problems of all three keys."""
    problems: list[str] = []
    targets, to_save, parameters = [], [], []
    try:
        targets, to_save = resolve_lora_modules(model, section)
    except LoraError as exc:
        problems.extend(exc.problems)
    try:
        parameters = resolve_lora_parameters(model, section)
    except LoraError as exc:
        problems.extend(exc.problems)
    if problems:
        raise LoraError(problems)
    return targets, to_save, parameters


def lora_config(model: nn.Module, section: LoraSection, base_path: str | Path) -> LoraConfig:
    """The PEFT LoraConfig of `section` for `model` (targets resolved to full module names,
    target_parameters to full parameter names)."""
    targets, to_save, parameters = _resolve(model, section)
    names = [n for n, _ in model.named_modules()]
    return LoraConfig(
        r=section.r,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=_target_pattern(targets, names) if targets else None,
        target_parameters=parameters or None,
        modules_to_save=to_save or None,
        bias="none",
        base_model_name_or_path=str(Path(base_path).absolute()),
    )


def apply_lora(model: PreTrainedModel, section: LoraSection, base_path: str | Path) -> PeftModel:
    """Inject `section`'s adapters into `model` in place and return the PeftModel around it.

    After this, `model` (== `peft_model.base_model.model`) holds the LoRA layers under its own
    module paths; only adapter weights and `modules_to_save` copies require gradients. Adapter
    weights are fp32 for a bf16/fp16 base (PEFT's autocast).
    """
    config = lora_config(model, section, base_path)
    if not config.target_parameters and any(_is_experts(m) for m in model.modules()):
        logger.info("LoRA on a MoE model: %s", _FUSED_EXPERTS)
    peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrapped = [m for m in model.modules() if hasattr(m, "lora_A")]
    experts = sum(1 for m in wrapped if hasattr(m, "parameter_name"))
    logger.info("LoRA r=%d alpha=%g on %d modules and %d expert parameters: %d trainable "
                "parameters", section.r, section.alpha, len(wrapped) - experts, experts, trainable)
    return peft_model


def lora_problems(model_config: PretrainedConfig, section: LoraSection) -> list[str]:
    """Problems of `section` against the model `model_config` describes (built on the meta
    device: no weights, no DeepSpeed). Empty when LoRA is off or fits."""
    if not section.r:
        return []
    model_class = MODEL_CLASSES[model_config.model_type]
    with torch.device("meta"):
        model = model_class._from_config(model_config)
    try:
        _resolve(model, section)
    except LoraError as exc:
        return exc.problems
    return []


def adapter_flops(model: nn.Module) -> AdapterFlops:
    """Forward FLOPs of the active LoRA adapters in `model` (`vlmcp.model.flops.AdapterFlops`):
    per text token for those on Linear layers (x A^T, then B), per forward for those on the
    routed experts' fused weights (PEFT's `ParamWrapper` adds B A to the weight, expert by
    expert), and which fused weights carry one."""
    per_token = per_forward = 0
    merged: set[str] = set()
    for module in model.modules():
        if not hasattr(module, "lora_A"):
            continue
        for name in module.active_adapters:
            if name not in module.r:
                continue
            rank = module.r[name]
            if hasattr(module, "parameter_name"):
                per_forward += 2 * rank * module.in_features * module.out_features * module.num_experts
                merged.add(module.parameter_name)
            else:
                per_token += 2 * rank * (module.in_features + module.out_features)
    return AdapterFlops(per_token=per_token, per_forward=per_forward, merged=frozenset(merged))
