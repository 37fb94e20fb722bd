"""Writing the trained model in Hugging Face format (config.json, safetensors, tokenizer and
processor files, chat template), from a live engine at the end of training or from a saved
DeepSpeed checkpoint (`vlmcp export`).

The training module (`PackedVLM`) registers only the trainable parts of the HF model (the text
model and lm_head, plus the vision tower when it trains); its state-dict keys are mapped back to
the HF model's names by module identity. A frozen vision tower is not in DeepSpeed's state: the
live export takes it from the model, `vlmcp export` from the base checkpoint at `model.path`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from vlmcp.config import JobConfig
from vlmcp.model.load import load_model
from vlmcp.parallel import comm
from vlmcp.training.atomic import remove_quietly, replace_dir, write_error
from vlmcp.training.checkpoint import CheckpointError, checkpoint_dir, newest_complete

logger = logging.getLogger(__name__)

#: Files of a checkpoint directory that save_pretrained writes itself or that hold weights.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_NOT_COPIED_NAMES = {"config.json", "generation_config.json"}
#: DeepSpeed's model-states file of rank 0: ZeRO 0-2, then ZeRO-3.
_MODEL_STATES_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def hf_key_prefixes(module: nn.Module, hf_model: nn.Module) -> dict[str, str]:
    """{top-level child name of `module`: its dotted name inside `hf_model`}."""
    hf_names = {id(m): name for name, m in hf_model.named_modules()}
    return {name: hf_names[id(child)] for name, child in module.named_children()
            if id(child) in hf_names}


def to_hf_keys(state_dict: dict[str, torch.Tensor], prefixes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Rename `module` state-dict keys to HF model keys; keys outside mapped children are dropped."""
    renamed = {}
    for key, value in state_dict.items():
        child, _, rest = key.partition(".")
        if child in prefixes:
            hf_prefix = prefixes[child]
            renamed[f"{hf_prefix}.{rest}" if hf_prefix else rest] = value
    return renamed


def copy_processor_files(source_dir: str | Path, out_dir: str | Path) -> None:
    """Copy tokenizer, chat template and processor files of a checkpoint directory."""
    for path in Path(source_dir).iterdir():
        if (path.is_file() and path.name not in _NOT_COPIED_NAMES
                and not path.name.endswith(_NOT_COPIED_SUFFIXES)):
            shutil.copy2(path, Path(out_dir) / path.name)


def _restore_use_cache(config: PretrainedConfig,
                       source_dir: str | Path) -> list[tuple[PretrainedConfig, Any]]:
    """Put the source checkpoint's `use_cache` back (training turns it off); returns old values."""
    source = json.loads((Path(source_dir) / "config.json").read_text())
    changed = []
    for cfg, raw in ((config, source), (config.get_text_config(), source.get("text_config", {}))):
        changed.append((cfg, cfg.use_cache))
        cfg.use_cache = raw.get("use_cache", True)
    return changed


def write_dir_atomically(out_dir: str | Path, marker: str, what: str,
                         fill: Callable[[Path], None], needed_bytes: int) -> Path:
    """Fill a fresh directory with `fill(tmp)` and rename it into place as `out_dir`.

    The temporary directory lies beside `out_dir`, so `out_dir` is never half-written. An earlier
    `what` ("model", "adapter") in `out_dir` (it holds the file `marker`) is replaced; any other
    non-empty directory is refused. On failure the temporary directory is removed and
    CheckpointError says why ("no space left on ..." for a full disk, `needed_bytes` of data).
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise CheckpointError([f"exporting the {what}: {out_dir} exists and is not a {what} "
                               f"directory (no {marker}); it would be replaced, so choose a "
                               "new or empty directory"])
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    try:
        remove_quietly(tmp)
        tmp.mkdir(parents=True)
        fill(tmp)
        replace_dir(tmp, out_dir)
    except (OSError, RuntimeError, SafetensorError) as exc:
        message = write_error(exc, tmp, needed_bytes)
        remove_quietly(tmp)
        raise CheckpointError([f"exporting the {what} to {out_dir}: {message}"]) from exc
    return out_dir


def state_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes the tensors of `state_dict` take."""
    return sum(v.numel() * v.element_size() for v in state_dict.values())


def save_hf(hf_model: PreTrainedModel, state_dict: dict[str, torch.Tensor],
            source_dir: str | Path, out_dir: str | Path) -> Path:
    """save_pretrained(`state_dict`) + the processor files of `source_dir` into `out_dir`, written
    by `write_dir_atomically` (an earlier model there, one with config.json, is replaced)."""
    return write_dir_atomically(
        out_dir, "config.json", "model",
        lambda tmp: _write_hf(hf_model, state_dict, source_dir, tmp), state_bytes(state_dict))


def _write_hf(hf_model: PreTrainedModel, state_dict: dict[str, torch.Tensor],
              source_dir: str | Path, out_dir: Path) -> None:
    state_dict = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    changed = _restore_use_cache(hf_model.config, source_dir)
    try:
        # The keys are already the model's own names. save_original_format would "revert" the
        # renamings transformers records while loading, and its ZeRO-3 load path records legacy
        # ones that mangle the keys on the way out.
        hf_model.save_pretrained(str(out_dir), state_dict=state_dict, save_original_format=False)
    finally:
        for cfg, value in changed:
            cfg.use_cache = value
    copy_processor_files(source_dir, out_dir)


def engine_hf_state_dict(engine, module: nn.Module, hf_model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full HF state dict of the live model on rank 0 (None elsewhere). Call on every rank.

    Under ZeRO-3 the partitioned parameters are gathered one layer at a time.
    """
    if engine.zero_optimization_partition_weights():
        trained = engine._zero3_consolidated_16bit_state_dict()
    else:
        trained = module.state_dict() if comm.rank() == 0 else None
    if comm.rank() != 0:
        return None
    state = {k: v for k, v in hf_model.state_dict().items() if v.numel() > 0}
    state.update(to_hf_keys(trained, hf_key_prefixes(module, hf_model)))
    return state


def write_on_rank0(state: dict[str, torch.Tensor] | None, write: Callable[[], None]) -> None:
    """Run `write` where `state` is not None (rank 0); call on every rank. Every rank raises
    CheckpointError when rank 0's write failed (the write itself leaves nothing half-written)."""
    problem = None
    if state is not None:
        try:
            write()
        except CheckpointError as exc:
            problem = exc
    if comm.rank_flags(problem is not None)[0]:
        raise problem or CheckpointError([])


def save_final(engine, module: nn.Module, hf_model: PreTrainedModel, source_dir: str | Path,
               out_dir: str | Path) -> Path:
    """Write the trained model to `out_dir` in HF format (rank 0 writes; call on every rank).

    Every rank raises CheckpointError when rank 0 could not write it (nothing half-written
    stays, and the run's checkpoints are untouched).
    """
    state = engine_hf_state_dict(engine, module, hf_model)

    def write() -> None:
        save_hf(hf_model, state, source_dir, out_dir)
        logger.info("saved the trained model (Hugging Face format) to %s", out_dir)

    write_on_rank0(state, write)
    return Path(out_dir)


def read_checkpoint_state(checkpoint_dir: str | Path, tag: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(module state dict in fp32, client state) of a DeepSpeed checkpoint, read on CPU.

    ZeRO 1-3 checkpoints are consolidated from their fp32 optimizer partitions; a ZeRO-0
    checkpoint holds the whole module state.
    """
    tag_dir = Path(checkpoint_dir) / tag
    candidates = [tag_dir / name for name in _MODEL_STATES_FILES]
    model_states = next((path for path in candidates if path.is_file()), None)
    if model_states is None:
        raise FileNotFoundError(f"{tag_dir} holds no {' or '.join(_MODEL_STATES_FILES)} "
                                "(not a DeepSpeed checkpoint tag?)")
    saved = torch.load(model_states, map_location="cpu", weights_only=False)
    client = {k: v for k, v in saved.items() if k in ("step", "hf_key_prefixes")}
    if saved.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    else:
        state = {k: v.float() for k, v in saved["module"].items()}
    return dict(state), client


def export_checkpoint(job: JobConfig, tag: str | None = None,
                      out_dir: str | Path | None = None, merge: bool = False) -> Path:
    """Convert a DeepSpeed checkpoint of `job` (default: the newest complete) to a HF model dir.

    Parameters the checkpoint does not hold (a frozen vision tower) come from `model.path`.
    Writes to `out_dir`, default OUTPUT_DIR/export-<tag>. A LoRA job (`lora.r` > 0) writes its
    PEFT adapter directory, or with `merge` the HF model with the adapters merged in
    (training.lora_export).
    """
    if merge and not job.lora.r:
        raise ValueError("--merge applies to LoRA jobs (lora.r > 0); this job trains full weights")
    directory = checkpoint_dir(job)
    if tag is None:
        tag, skipped = newest_complete(directory)
        for reason in skipped:
            logger.warning("skipping an incomplete checkpoint: %s", reason)
        if tag is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
    state, client = read_checkpoint_state(directory, tag)
    if "hf_key_prefixes" not in client:
        raise ValueError(f"{directory / tag} was not written by vlmcp (no hf_key_prefixes)")
    out = Path(out_dir) if out_dir else Path(job.output_dir) / f"export-{tag}"
    hf_state = to_hf_keys(state, client["hf_key_prefixes"])
    if job.lora.r:
        from vlmcp.training.lora_export import export_lora

        export_lora(job, hf_state, out, merge)
        logger.info("exported %s (step %s) to %s (%s)", directory / tag, client.get("step"), out,
                    "merged model" if merge else "LoRA adapter")
        return out
    model_dir = job.resolve_input(job.model.path)
    model = load_model(model_dir, job.model.dtype, freeze_vision=job.model.freeze_vision)
    unknown = sorted(set(hf_state) - set(model.state_dict()))
    if unknown:
        raise ValueError(f"checkpoint keys unknown to {model_dir}: {unknown[:5]}")
    model.load_state_dict(hf_state, strict=False)
    save_hf(model, model.state_dict(), model_dir, out)
    logger.info("exported %s (step %s) to %s", directory / tag, client.get("step"), out)
    return out
