"""The module state of a DeepSpeed checkpoint saved under expert parallelism (`parallel.ep_size`
> 1), with every expert, in transformers' names and fused expert layout, read on CPU.

ZeRO 0-2: the dense parameters come from rank 0's model states, every expert from DeepSpeed's
per-expert files (`layer_L_expert_E_mp_rank_00_model_states.pt`, keys `...experts.w1.E`). Both
hold the weights the optimizer wrote after its step (for fp32 training the master weights
themselves). LoRA on the routed experts: their adapter factors from vlmcp's per-EP-rank files
(`expert_adapters_ep_rank_R.pt`, stacked in rank order), still per expert.

ZeRO-3: the weights live only in the optimizer's fp32 partitions, the dense ones over all ranks
and each expert tensor over its expert-data-parallel group. DeepSpeed's own universal-checkpoint
conversion (`deepspeed.checkpoint.ds_to_universal`, which knows AutoEP's partition-native ZeRO-3
layout) consolidates them into one fp32 file per parameter; vlmcp's conversion around it
(training/weights/universal.py) puts the experts in transformers' fused form and their LoRA
factors in PEFT's, as an EP-1 run holds them, and this reads those. The conversion (the fp32
weights and the two AdamW moments of every parameter, about 3x the fp32 model) stays beside the
checkpoint, where a resume at another layout reuses it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from vlmcp.training.ds.config import zero_stage
from vlmcp.training.ds.expert_lora_checkpoint import saved_expert_factors
from vlmcp.training.ds.expert_parallel import hf_expert_tensors, hf_name
from vlmcp.training.weights.universal import FUSED, convert

logger = logging.getLogger(__name__)

_EXPERT_FILE = re.compile(r"layer_\d+_expert_\d+_mp_rank_00_model_states\.pt")
_EXPERT_KEY = re.compile(r"(.*\.experts)\.(w1|w2|w3)\.(\d+)")


def expert_parallel_state(tag_dir: Path, saved: dict) -> dict[str, torch.Tensor]:
    """The module state dict (fp32, transformers' names, fused experts) of the checkpoint tag
    directory `tag_dir`, whose rank-0 model states are `saved` (module docstring)."""
    if zero_stage(saved["ds_config"]) == 3:
        return _zero3_state(tag_dir)
    state = {hf_name(k): v.float() for k, v in saved["module"].items()}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for path in sorted(tag_dir.iterdir()):
        if not _EXPERT_FILE.fullmatch(path.name):
            continue
        for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
            found = _EXPERT_KEY.fullmatch(key)
            if found is None:
                raise ValueError(f"{path}: unexpected key {key!r} in an expert file")
            module, weight, expert = found.group(1), found.group(2), int(found.group(3))
            experts.setdefault(module, {}).setdefault(weight, {})[expert] = value.float()
    for module, weights in experts.items():
        stacked = {}
        for weight, by_expert in weights.items():
            if sorted(by_expert) != list(range(len(by_expert))):
                raise ValueError(f"{tag_dir}: the expert files of {module} hold experts "
                                 f"{sorted(by_expert)}, not 0..{len(by_expert) - 1}")
            stacked[weight] = torch.stack([by_expert[e] for e in range(len(by_expert))])
        state.update(hf_expert_tensors(module, stacked["w1"], stacked["w2"], stacked["w3"]))
    state.update(_expert_adapters(tag_dir))
    return state


def _expert_adapters(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The routed experts' LoRA factors of every expert ([E, ...], training/ds/
    expert_lora_checkpoint.py), under transformers' names; empty without LoRA."""
    return {hf_name(key): value for key, value in saved_expert_factors(tag_dir).items()}


def _zero3_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """A ZeRO-3 tag directory's weights under the training module's names, the routed experts
    fused and their LoRA factors in PEFT's layout, as at EP 1: DeepSpeed's universal conversion
    beside it in that form (training/weights/universal.py; converted once, reused by a resume
    at another layout)."""
    from deepspeed.checkpoint.constants import PARAM

    zero = convert(tag_dir, expert_form=FUSED) / "zero"
    return {folder.name: torch.load(folder / "fp32.pt", map_location="cpu",
                                    weights_only=False)[PARAM].float()
            for folder in sorted(p for p in zero.iterdir() if p.is_dir())}
