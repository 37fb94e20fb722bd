"""Writing LoRA runs: the PEFT adapter directory (`OUTPUT_DIR/final`, `vlmcp export`) and the
merged Hugging Face model (`vlmcp export --merge`).

An adapter directory holds PEFT's `adapter_config.json` (its `base_model_name_or_path` is the
job's `model.path`) and `adapter_model.safetensors`, written by `PeftModel.save_pretrained`, plus
the tokenizer and processor files of the base checkpoint; `PeftModel.from_pretrained(base,
directory)` loads it onto the plain transformers model. Directories are written under a temporary
name and renamed into place when complete.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from torch import nn

from vlmcp.config import JobConfig
from vlmcp.model.load import load_model
from vlmcp.model.lora import apply_lora
from vlmcp.parallel import comm
from vlmcp.training.ds.expert_lora import gathered_expert_adapters, peft_layout
from vlmcp.training.ds.expert_parallel import hf_name
from vlmcp.training.weights.hf_format import (copy_processor_files, hf_key_prefixes, save_hf,
                                              state_bytes, to_hf_keys, write_dir_atomically,
                                              write_on_rank0)

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
#: Prefix of the HF model's names inside a PeftModel's state dict.
PEFT_PREFIX = "base_model.model."


def trained_state_dict(module: nn.Module, hf_model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The trainable parameters of the live training module (adapters, modules_to_save copies)
    under the HF model's names, on rank 0 (None elsewhere). Call on every rank: a ZeRO-3
    partitioned parameter is gathered one at a time, in the same order everywhere; under expert
    parallelism the routed experts' adapters are gathered from the ranks holding them, in PEFT's
    layout (training/ds/expert_lora.py), and AutoEP's names of the shared expert are
    transformers' (`expert_parallel.hf_name`)."""
    prefixes = hf_key_prefixes(module, hf_model)
    state, experts = gathered_expert_adapters(module)
    for name, param in module.named_parameters():
        if not param.requires_grad or id(param) in experts:
            continue
        if hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                value = param.detach().cpu().clone()
        else:
            value = param.detach().cpu().clone()
        state[hf_name(name)] = value
    if comm.rank() != 0:
        return None
    return to_hf_keys(state, prefixes)


def save_adapter(peft_model: PeftModel, state: dict[str, torch.Tensor], source_dir: str | Path,
                 out_dir: str | Path) -> Path:
    """Write the adapter directory: `state` holds the trainable tensors under HF model names.

    Written by `write_dir_atomically`: an earlier adapter in `out_dir` is replaced, any other
    non-empty directory is refused, CheckpointError on a failed write.
    """
    return write_dir_atomically(
        out_dir, ADAPTER_CONFIG, "adapter",
        lambda tmp: write_adapter_files(peft_model, state, source_dir, tmp), state_bytes(state))


def write_adapter_files(peft_model: PeftModel, state: dict[str, torch.Tensor],
                        source_dir: str | Path, out_dir: Path) -> None:
    """PEFT's adapter files of `state` (trainable tensors under HF model names) and the processor
    files of `source_dir` into the existing directory `out_dir`."""
    _saving_model(peft_model).save_pretrained(str(out_dir), state_dict={
        PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()})
    copy_processor_files(source_dir, out_dir)


def _saving_model(peft_model: PeftModel) -> PeftModel:
    """The PeftModel whose `save_pretrained` writes the adapter: `peft_model`, or, where AutoEP
    replaced its MoE blocks (expert parallelism), a twin with its config and adapter config on
    the meta device: PEFT picks the keys it saves by the model's own adapter modules, which
    AutoEP's blocks no longer hold."""
    base = peft_model.base_model.model
    if not any(getattr(module, "_is_autoep_layer", False) for module in base.modules()):
        return peft_model
    with torch.device("meta"):
        twin = type(base)._from_config(base.config)
    return get_peft_model(twin, copy.deepcopy(peft_model.peft_config[peft_model.active_adapter]))


def save_final_adapter(module: nn.Module, peft_model: PeftModel, source_dir: str | Path,
                       out_dir: str | Path) -> Path:
    """Write the run's adapter to `out_dir` (rank 0 writes; call on every rank). Every rank raises
    CheckpointError when rank 0 could not write it."""
    state = trained_state_dict(module, peft_model.base_model.model)

    def write() -> None:
        save_adapter(peft_model, state, source_dir, out_dir)
        logger.info("saved the LoRA adapter (PEFT format) to %s", out_dir)

    write_on_rank0(state, write, out_dir)
    return Path(out_dir)


def export_lora(job: JobConfig, state: dict[str, torch.Tensor], out: Path, merge: bool) -> Path:
    """Write a LoRA checkpoint's module `state` (training-module keys already mapped to HF
    names; the routed experts' adapters of an expert-parallel run per expert, put back into
    PEFT's layout here) as an adapter directory, or with `merge` as a merged HF model
    (`merge_and_unload`). The base weights come from `model.path`."""
    model_dir = job.resolve_input(job.model.path)
    model = load_model(model_dir, job.model.dtype, freeze_vision=True)
    peft_model = apply_lora(model, job.lora, model_dir)
    state = peft_layout(model, state)
    trained = {k for k, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trained - set(state))
    if missing:
        raise ValueError(f"the checkpoint holds no adapter weights for {missing[:5]} (was it "
                         "trained with this job's lora section?)")
    model.load_state_dict({k: state[k] for k in trained}, strict=False)
    if not merge:
        return save_adapter(peft_model, {k: state[k] for k in trained}, model_dir, out)
    merged = peft_model.merge_and_unload()
    return save_hf(merged, merged.state_dict(), model_dir, out)

