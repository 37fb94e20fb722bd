"""A checkpoint in DeepSpeed's universal format, converted once, beside it: what a resume at
another layout (training/layout.py) and `vlmcp export` of a ZeRO-3 expert-parallel checkpoint read.

    OUTPUT_DIR/checkpoints/step6/                  DeepSpeed's files at the saving layout
    OUTPUT_DIR/checkpoints/step6/universal/        its universal checkpoint + manifest.json (last)
    OUTPUT_DIR/checkpoints/step6/.tmp-universal-*/ a conversion running or interrupted: never read

The conversion is DeepSpeed's own (`deepspeed.checkpoint.ds_to_universal`, which knows ZeRO 1-3,
bf16 and AutoEP's expert layouts): one folder per parameter under `universal/zero/`, each holding
the parameter's fp32 value and every optimizer state of it (`fp32.pt`, `exp_avg.pt`,
`exp_avg_sq.pt`, `step.pt`) whole, plus the optimizer's global state and the model states file
(LR schedule, step counters, client state). A DeepSpeed engine at any world size, ZeRO stage 1-3
or expert-parallel size loads its own partitions from it (`checkpoint.load_universal`).

What vlmcp adds, where DeepSpeed 0.19.8's converter or loaders cannot do it:

* a folder every ZeRO stage's loader reads, whatever stage saved it (`_readable_at_every_stage`);
* the routed experts in the form the loading engine holds them (`set_expert_form`): AutoEP's
  `w1`/`w2`/`w3` under expert parallelism, transformers' fused `gate_up_proj`/`down_proj` at EP 1
  and for `vlmcp export`; a conversion is reused only in the form asked for;
* LoRA on the routed experts (training/ds/expert_lora.py): the adapter factors live in the
  optimizer as expert parameters [E_local, ...] of each EP rank, which DeepSpeed's conversion
  does not know as experts (its AutoEP metadata names `w1`/`w2`/`w3` only). DeepSpeed's converter
  reads the checkpoint without them (`_conversion_input`), and vlmcp's own files of them (every
  expert's factor and optimizer state, written at save by EP group 0) give their folders, the
  whole [E, ...] tensors marked as expert parameters of E experts, which DeepSpeed's loader slices
  per EP rank (`load_hp_checkpoint_state`).

Atomic: the conversion writes into `.tmp-universal-<pid>/` (the converter's `latest_universal`
file lands there too), then `manifest.json` ({"files": {relative path: bytes}, "seconds",
"bytes", "expert_form"}) last, then one rename to `universal/`. A crash at any point leaves no
`universal/`; the next conversion removes the stale temporary directory and starts over. A
`universal/` whose manifest is missing or disagrees with its files is never read
(`incomplete_reason` says why).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from vlmcp.training.atomic import (dir_size, file_sizes, fsync_tree, manifest_problem,
                                   remove_quietly)
from vlmcp.training.ds.expert_lora import ExpertAdapter, peft_expert_tensors
from vlmcp.training.ds.expert_lora_checkpoint import (saved_adapter_descriptions,
                                                      saved_expert_adapter_states,
                                                      saved_expert_factors)
from vlmcp.training.ds.expert_parallel import (autoep_expert_states, autoep_name, expert_weight,
                                               hf_expert_states, hf_name)

logger = logging.getLogger(__name__)

UNIVERSAL = "universal"
MANIFEST = "manifest.json"
#: How a universal checkpoint holds the routed experts of a MoE model (`set_expert_form`).
AUTOEP, FUSED = "autoep", "fused"
_TMP_PREFIX = ".tmp-universal-"
#: DeepSpeed's per-expert model-states files of a ZeRO 0-2 checkpoint under EP.
_EXPERT_FILE = re.compile(r"layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt")


def universal_dir(tag_dir: Path) -> Path:
    """Where the conversion of the checkpoint `tag_dir` lives."""
    return Path(tag_dir) / UNIVERSAL


def incomplete_reason(tag_dir: Path) -> str | None:
    """Why the conversion of `tag_dir` cannot be read (absent, or not whole), None when it can."""
    out = universal_dir(tag_dir)
    return f"{out} does not exist" if not out.exists() else manifest_problem(out, MANIFEST)


def _saved_form(tag_dir: Path) -> str | None:
    return json.loads((universal_dir(tag_dir) / MANIFEST).read_text()).get("expert_form")


def convert(tag_dir: Path, expert_form: str = FUSED) -> Path:
    """The universal checkpoint of the complete DeepSpeed checkpoint `tag_dir`, its routed experts
    (if any) in `expert_form` (AUTOEP for a load under expert parallelism, FUSED for one at EP 1
    and for export): the one beside it when complete and in that form, else converted now
    (module docstring). Call on one process. DeepSpeed's converter runs in this process, without
    its worker pools: they fork the process, and a training rank's fork inherits the process
    group's sockets. Raises what the conversion raises (OSError on a full disk, DeepSpeed's
    errors on a checkpoint it cannot read)."""
    tag_dir = Path(tag_dir)
    out = universal_dir(tag_dir)
    if incomplete_reason(tag_dir) is None and _saved_form(tag_dir) in (None, expert_form):
        logger.info("reusing the universal checkpoint %s (converted before)", out)
        return out
    for stale in [out, *tag_dir.glob(f"{_TMP_PREFIX}*")]:
        remove_quietly(stale)
    started = time.perf_counter()
    tmp = tag_dir / f"{_TMP_PREFIX}{os.getpid()}"
    scratch = tmp / UNIVERSAL
    _deepspeed_conversion(_conversion_input(tag_dir, tmp / "input"), scratch)
    _readable_at_every_stage(scratch)
    add_expert_adapters(tag_dir, scratch)
    form = set_expert_form(scratch / "zero", expert_form, saved_adapter_descriptions(tag_dir))
    seconds = time.perf_counter() - started
    files = file_sizes(scratch)
    (scratch / MANIFEST).write_text(json.dumps(
        {"files": files, "seconds": round(seconds, 3), "bytes": dir_size(scratch),
         "expert_form": form}, indent=1))
    fsync_tree(scratch)
    scratch.rename(out)
    remove_quietly(tmp)
    logger.info("converted %s to DeepSpeed's universal checkpoint %s in %.1f s (%d bytes, "
                "%.2fx the checkpoint's)", tag_dir, out, seconds, dir_size(out),
                dir_size(out) / max(1, _checkpoint_bytes(tag_dir)))
    return out


def _checkpoint_bytes(tag_dir: Path) -> int:
    """Bytes of the checkpoint's own files (its conversions left out)."""
    return sum(p.stat().st_size for p in tag_dir.iterdir() if p.is_file())


def _conversion_input(tag_dir: Path, view: Path) -> Path:
    """What DeepSpeed's converter reads: `tag_dir`, or for a ZeRO 1/2 checkpoint of LoRA on the
    routed experts under EP, a view of it (`view`: links to its files) that shows it as a dense
    checkpoint. As it is, the converter would fail twice: its merge reshapes each parameter's
    fragments of every rank to the saved shape, and an expert factor's fragments are every EP
    rank's [E_local, ...] (E x the saved numel); and its AutoEP consolidation wants AutoEP's
    `w1`/`w2`/`w3` among the trained parameters, where LoRA freezes them (a LoRA checkpoint
    needs none: they come from model.path). The view's model states list no shapes of the
    factors (nothing is merged for them: `add_expert_adapters` writes them whole) and no AutoEP
    layers, and it holds no per-expert files."""
    from deepspeed.checkpoint.constants import (AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY,
                                                PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO)

    factors = set(saved_expert_factors(tag_dir))
    model_states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not factors or not model_states:
        return tag_dir
    view.mkdir(parents=True)
    for path in tag_dir.iterdir():
        if path.is_file() and path not in model_states and not _EXPERT_FILE.fullmatch(path.name):
            (view / path.name).symlink_to(path.absolute())
    for path in model_states:
        states = torch.load(path, map_location="cpu", weights_only=False)
        states[PARAM_SHAPES] = [{name: shape for name, shape in group.items()
                                 if name not in factors} for group in states[PARAM_SHAPES]]
        for key in (AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY):
            states.pop(key, None)
            (states.get(UNIVERSAL_CHECKPOINT_INFO) or {}).pop(key, None)
        torch.save(states, view / path.name)
    return view


def _deepspeed_conversion(tag_dir: Path, out: Path) -> None:
    """`ds_to_universal` from `tag_dir` into `out`, in this process. vlmcp has no tensor
    parallelism, so the version marker DeepSpeed's converter requires of Megatron-style clients
    is injected."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out),
                              num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        ds_to_universal.main(args)
    logger.debug("deepspeed ds_to_universal on %s:\n%s", tag_dir, printed.getvalue())


_MODEL_STATES = "mp_rank_00_model_states.pt"
_ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq")
#: Param groups a loading engine may have: the dense one and one per expert-parallel size.
_GROUP_SLOTS = 8
#: Keys of a param group that say which group it is, not how it trains.
_GROUP_IDENTITY = ("params", "name", "moe")


def _readable_at_every_stage(out: Path) -> None:
    """Make DeepSpeed's conversion `out` loadable by every ZeRO stage, not only the source's.

    DeepSpeed 0.19.8's universal loaders differ by the loading engine's stage, and its converter
    writes what the source stage's loader reads:

    * the model states (LR schedule, step counters, client state): ZeRO 1/2 read
      `mp_rank_00_model_states.pt`, ZeRO 3 `zero_pp_rank_0_mp_rank_00_model_states.pt`;
    * `zero/optimizer_state.pt`: ZeRO 1/2 read its `param_groups` and `ds_version`, ZeRO 3 the
      torch optimizer's state dict under `optimizer_state_dict` (its first entry's `step`, its
      first group's hyperparameters);
    * each parameter's folder: ZeRO 1/2 read `{"param": tensor}` files and the step from
      `step.pt`; a ZeRO-3 source's conversion writes bare flat tensors and no step.

    This writes each missing form from the one there (the model states linked, not copied),
    and drops rank 0's flat fp32 partitions and optimizer moments that a ZeRO-3 source's
    `optimizer_state.pt` carries and no loader reads.

    The param groups: a ZeRO 1/2 engine restores its group i (its parameters' fp32 values and
    moments too) while zipping its groups with the file's, so a file with fewer groups than the
    engine (EP 1 saved, a dense and an expert group loading) would leave groups unloaded. Every
    group of a vlmcp run has the job's hyperparameters, so the file's list is padded with copies
    of its first group to `_GROUP_SLOTS`, and each group's identity (`name`, `moe`) is left to
    the loading engine's own.
    """
    from deepspeed.checkpoint.constants import (DS_VERSION, FP32_FLAT_GROUPS,
                                                OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS,
                                                PARAM_SHAPES)

    names = [_MODEL_STATES, _ZERO3_MODEL_STATES]
    present = next(out / name for name in names if (out / name).is_file())
    for name in names:
        if not (out / name).exists():
            os.link(present, out / name)
    model_states = torch.load(present, map_location="cpu", weights_only=False)
    zero = out / "zero"
    optim_path = zero / "optimizer_state.pt"
    optim = torch.load(optim_path, map_location="cpu", weights_only=False)
    zero3_source = OPTIMIZER_STATE_DICT in optim
    if zero3_source:
        step = optim[OPTIMIZER_STATE_DICT]["state"][0]["step"]
    else:
        steps = sorted(zero.glob("*/step.pt"))[:1]
        step = torch.load(steps[0], weights_only=False) if steps else torch.tensor(0.0)
    groups = [{k: v for k, v in group.items() if k not in _GROUP_IDENTITY}
              for group in optim[PARAM_GROUPS]]
    optim[PARAM_GROUPS] = groups + [groups[0]] * max(0, _GROUP_SLOTS - len(groups))
    optim[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, PARAM_GROUPS: optim[PARAM_GROUPS]}
    optim.pop(FP32_FLAT_GROUPS, None)
    optim.setdefault(DS_VERSION, model_states[DS_VERSION])
    torch.save(optim, optim_path)
    if not zero3_source:  # ZeRO 1/2's per-parameter files are in the form every stage reads
        return
    shapes = {name: shape for group in model_states.get(PARAM_SHAPES) or []
              for name, shape in group.items()}
    for folder in (p for p in zero.iterdir() if p.is_dir()):
        for key in _STATE_FILES:
            path = folder / f"{key}.pt"
            value = torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
            if torch.is_tensor(value):
                shape = shapes.get(folder.name)
                if shape is not None:  # a ZeRO-3 merge is flat, possibly with its padding
                    value = value.flatten()[:math.prod(shape)].view(shape)
                torch.save({PARAM: value}, path)
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")


def _states(folder: Path) -> dict[str, torch.Tensor]:
    """{state key: tensor} of one parameter's folder (fp32 and the optimizer's), step left out."""
    from deepspeed.checkpoint.constants import PARAM

    return {path.stem: torch.load(path, map_location="cpu", weights_only=False)[PARAM]
            for path in folder.glob("*.pt") if path.stem != "step"}


def _write_states(folder: Path, states: dict[str, torch.Tensor], step: Any,
                  experts: int | None) -> None:
    """One parameter's folder: each state as {"param": tensor} (marked as an expert parameter of
    `experts` experts, which DeepSpeed slices per EP rank, when not None) and `step.pt`."""
    from deepspeed.checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

    folder.mkdir(parents=True, exist_ok=True)
    marks = {} if experts is None else {EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: experts}
    for key, value in states.items():
        torch.save({PARAM: value.contiguous(), CAT_DIM: 0, **marks}, folder / f"{key}.pt")
    torch.save(step, folder / "step.pt")


def _moved(zero: Path, name: str, new_name: str) -> None:
    if name != new_name:
        (zero / name).rename(zero / new_name)


def expert_form_of(zero: Path, adapters: dict[str, list[dict[str, Any]]]) -> str | None:
    """AUTOEP or FUSED: how the routed experts (or, under LoRA, only their adapters, described by
    `adapters`) are held in the universal folder `zero`; None: no routed experts."""
    names = {p.name for p in zero.iterdir() if p.is_dir()}
    ours = {f"{path}.lora_A_{entry['parameter']}" for path, described in adapters.items()
            for entry in described}
    peft = {f"{entry['peft_name']}.lora_A.{entry['adapter']}.weight"
            for described in adapters.values() for entry in described}
    if any(expert_weight(name) for name in names) or names & ours:
        return AUTOEP
    if any(name.endswith((".experts.gate_up_proj", ".experts.down_proj")) for name in names) \
            or names & peft:
        return FUSED
    return None


def set_expert_form(zero: Path, form: str, adapters: dict[str, list[dict[str, Any]]]
                    ) -> str | None:
    """Put the routed experts of the universal folder `zero` (and their LoRA factors, described
    by `adapters`: training/ds/expert_lora_checkpoint.py) into `form`; returns the form they are
    in (None: no routed experts). Every state (fp32 and the optimizer's moments) moves the same
    way, elementwise:

    AUTOEP (AutoEP's `w1`, `w2`, `w3` [E, I, H] / [E, H, I] / [E, I, H], `router.gate`,
    `shared_experts`, vlmcp's LoRA factors A [E, r, in] and B [E, out, r], all marked as expert
    parameters of E experts) <-> FUSED (transformers' `gate_up_proj` [E, 2I, H] = cat(w1, w3),
    `down_proj` = w2, `gate`, `shared_expert`, PEFT's factors A [r*E, in] and B [out, r*E])."""
    current = expert_form_of(zero, adapters)
    if current in (None, form):
        return current
    step = torch.load(next(zero.glob("*/step.pt")), weights_only=False)
    for path, described in adapters.items():
        for entry in described:
            adapter = ExpertAdapter(parameter=entry["parameter"], scaling=1.0, transposed=False,
                                    peft_name=entry["peft_name"], adapter=entry["adapter"],
                                    num_experts=entry["num_experts"])
            _move_expert_adapter(zero, path, adapter, form, step)
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        name = folder.name
        if form == FUSED and expert_weight(name) and name.endswith(".w1"):
            module = name[:-len(".w1")]
            w1, w2, w3 = (_states(zero / f"{module}.{w}") for w in ("w1", "w2", "w3"))
            for weight, states in hf_expert_states(module, w1, w2, w3).items():
                _write_states(zero / weight, states, step, None)
            for w in ("w1", "w2", "w3"):
                remove_quietly(zero / f"{module}.{w}")
        elif form == AUTOEP and name.endswith(".experts.gate_up_proj"):
            module = name[:-len(".gate_up_proj")]
            gate_up, down = _states(folder), _states(zero / f"{module}.down_proj")
            experts = next(iter(gate_up.values())).shape[0]
            for weight, states in autoep_expert_states(module, gate_up, down).items():
                _write_states(zero / weight, states, step, experts)
            remove_quietly(folder)
            remove_quietly(zero / f"{module}.down_proj")
        elif folder.is_dir():
            _moved(zero, name, hf_name(name) if form == FUSED else autoep_name(name))
    return form


def _move_expert_adapter(zero: Path, path: str, adapter: ExpertAdapter, form: str,
                         step: Any) -> None:
    """One adapter's two factor folders from the other form into `form` (`set_expert_form`)."""
    ours = {factor: zero / f"{path}.lora_{factor}_{adapter.parameter}" for factor in "AB"}
    peft = {factor: zero / f"{adapter.peft_name}.lora_{factor}.{adapter.adapter}.weight"
            for factor in "AB"}
    experts = adapter.num_experts
    if form == FUSED:
        a, b = _states(ours["A"]), _states(ours["B"])
        for key in a:
            converted = peft_expert_tensors(adapter, a[key], b[key])
            for factor in "AB":
                a_or_b = converted[f"{adapter.peft_name}.lora_{factor}.{adapter.adapter}.weight"]
                (a if factor == "A" else b)[key] = a_or_b
        _write_states(peft["A"], a, step, None)
        _write_states(peft["B"], b, step, None)
        for folder in ours.values():
            remove_quietly(folder)
        return
    a, b = _states(peft["A"]), _states(peft["B"])
    _write_states(ours["A"], {k: v.reshape(experts, -1, v.shape[-1]) for k, v in a.items()},
                  step, experts)
    _write_states(ours["B"], {k: v.reshape(v.shape[0], -1, experts).permute(2, 0, 1)
                              for k, v in b.items()}, step, experts)
    for folder in peft.values():
        remove_quietly(folder)


def add_expert_adapters(tag_dir: Path, out: Path) -> None:
    """The folders of the routed experts' LoRA factors under `out/zero/`, from vlmcp's whole ones
    (module docstring); nothing without such factors."""
    for name, states in saved_expert_adapter_states(tag_dir).items():
        remove_quietly(out / "zero" / name)
        step = torch.tensor(float(states.pop("step")))  # as DeepSpeed writes a step
        _write_states(out / "zero" / name, states, step, states["fp32"].shape[0])
