"""The Hugging Face format of a trained model: key names and the directories written.

The training module (`PackedVLM`) registers only the trainable parts of the HF model; its
state-dict keys map back to the HF model's names by module identity (`hf_key_prefixes`,
`to_hf_keys`). A model directory (config.json, safetensors, the tokenizer and processor files of
the base checkpoint) and a LoRA adapter directory are both written under a temporary name beside
their place and renamed into it when complete (`write_dir_atomically`), on rank 0
(`write_on_rank0`), so no reader ever sees a half-written one.

HF's sharded layout, which the rank-parallel writer (training/weights/sharded_write.py) fills one
shard per rank, and which `from_pretrained`, vLLM and SGLang read:

    config.json  generation_config.json            `write_model_config` (as save_pretrained)
    model-00001-of-00002.safetensors               `write_shard`: whole tensors, metadata
    model-00002-of-00002.safetensors                 {"format": "pt"}, as save_pretrained writes
    model.safetensors.index.json                   `index_text`: {"metadata": {"total_size",
                                                     "total_parameters"}, "weight_map"}
With one shard the file is model.safetensors and there is no index. `saved_tensors` names the
tensors save_pretrained would write (tied duplicates and ignored keys dropped); `read_hf_weights`
reads either layout back.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from vlmcp.errors import CheckpointError
from vlmcp.parallel.agree import fail_together
from vlmcp.training.weights.expert_shards import hf_layout
from vlmcp.training.atomic import (fsync_path, fsync_tree, remove_quietly, replace_dir,
                                   write_error)

#: The weights file of a one-shard model directory, and the index of a sharded one.
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: The metadata save_pretrained gives every safetensors file.
_SHARD_METADATA = {"format": "pt"}

#: Files of a checkpoint directory that save_pretrained writes itself or that hold weights.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_NOT_COPIED_NAMES = {"config.json", "generation_config.json"}


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
                         fill: Callable[[Path], None], needed_bytes: int,
                         seal: Callable[[Path], None] | None = None) -> Path:
    """Fill a fresh directory with `fill(tmp)` and rename it into place as `out_dir`.

    The temporary directory lies beside `out_dir`, so `out_dir` is never half-written. Its files
    are flushed to the disk (`fsync_tree`) before `seal(tmp)` writes the marker that says the
    directory is complete (publish's STABLE), and the directory again before the rename; the
    parent is flushed after it. An earlier `what` ("model", "adapter") in `out_dir` (it holds the
    file `marker`) is replaced; any other non-empty directory is refused. On failure the
    temporary directory is removed and CheckpointError says why ("no space left on ..." for a
    full disk, `needed_bytes` of data).
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
        fsync_tree(tmp)
        if seal is not None:
            seal(tmp)
            fsync_path(tmp)
        replace_dir(tmp, out_dir)
        fsync_path(out_dir.parent)
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
        lambda tmp: write_hf_files(hf_model, state_dict, source_dir, tmp), state_bytes(state_dict))


def write_hf_files(hf_model: PreTrainedModel, state_dict: dict[str, torch.Tensor],
                   source_dir: str | Path, out_dir: Path) -> None:
    """save_pretrained(`state_dict`) and the processor files of `source_dir` into the existing
    directory `out_dir` (the filling of a directory that `write_dir_atomically` renames)."""
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


def saved_tensors(hf_model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """{HF key: the live parameter or buffer} of every tensor `save_pretrained` would write, in
    state-dict order: its persistent state without `_keys_to_ignore_on_save` and with one name per
    tied tensor (the one transformers keeps). Under ZeRO-3 the parameters are the partitioned
    ones (their `ds_shape` is the full shape). Under expert parallelism the MoE layers come in
    Hugging Face's per-expert layout, every expert of every layer, this rank's as views
    (training/weights/expert_shards.py).

    transformers decides which tied name it keeps from the tensors' storages
    (`remove_tied_weights_from_state_dict`); it is asked here with one placeholder per distinct
    live tensor, so the rank-parallel writer drops exactly the names save_pretrained drops.
    """
    live = hf_model.state_dict(keep_vars=True)
    for key in hf_model._keys_to_ignore_on_save or ():
        live.pop(key, None)
    placeholders: dict[int, torch.Tensor] = {}
    probe = {key: placeholders.setdefault(id(value), torch.zeros(1)) for key, value in live.items()}
    kept = remove_tied_weights_from_state_dict(probe, hf_model)
    return hf_layout(hf_model, {key: value for key, value in live.items() if key in kept})


def shard_names(count: int) -> list[str]:
    """The weights files of a directory of `count` shards, as save_pretrained names them."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_text(weight_map: Mapping[str, str], total_size: int, total_parameters: int) -> str:
    """model.safetensors.index.json of a sharded directory, formatted as save_pretrained does."""
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
             "weight_map": dict(weight_map)}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def write_model_config(hf_model: PreTrainedModel, source_dir: str | Path, out_dir: Path) -> None:
    """What save_pretrained writes besides the weights (config.json with the model's dtype and
    architecture, generation_config.json), with the source checkpoint's `use_cache`, and the
    processor files of `source_dir`, into the existing directory `out_dir`.

    The rank-parallel writer writes the weights on every rank and these once, on rank 0, so it
    cannot hand both to one save_pretrained call.
    """
    changed = _restore_use_cache(hf_model.config, source_dir)
    try:
        hf_model.config.dtype = str(hf_model.dtype).split(".")[1]
        hf_model.config.architectures = [type(hf_model).__name__]
        hf_model.config.save_pretrained(str(out_dir))
        if hf_model.can_generate():
            hf_model.generation_config.save_pretrained(str(out_dir))
    finally:
        for cfg, value in changed:
            cfg.use_cache = value
    copy_processor_files(source_dir, out_dir)


def write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors shard of whole CPU tensors, flushed to the disk."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata=_SHARD_METADATA)
    fsync_path(path)


def read_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, one-file or sharded (CPU)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if not index.is_file():
        return load_file(str(model_dir / WEIGHTS_NAME))
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(model_dir / name)))
    return state


def write_on_rank0(state: dict[str, torch.Tensor] | None, write: Callable[[], None],
                   target: str | Path) -> None:
    """Run `write` where `state` is not None (rank 0); call on every rank. Every rank raises
    CheckpointError when rank 0's write of `target` failed, whatever it raised (the write itself
    leaves nothing half-written), so no rank is left waiting in a later collective."""
    problems: list[str] = []
    if state is not None:
        try:
            write()
        except CheckpointError as exc:
            problems = exc.problems
        except Exception as exc:  # any failure is agreed, never one rank's alone
            problems = [f"writing {target}: {type(exc).__name__}: {exc}"]
    fail_together(problems, CheckpointError)
