"""The layout a checkpoint was saved at, and what a resume at another one keeps, converts or refuses.

Every checkpoint's manifest records what a resume needs to compare (`checkpoint_record`):

    layout     world_size, sp_size, dp_size, ep_size, zero_stage, precision, grad_accum
    trained    which parameters train: lora.r, its target_modules, target_parameters and
               modules_to_save, model.freeze_vision
    data       the data position's inputs: "train" (data.train; a step is a function of the step
               number and these) or "rollouts" (rollout step N trains step N, whatever the rest)
               global_batch (data-parallel size x train.grad_accum), max_seq_len, shuffle, seed,
               sp_dynamic and the SP size its degree plan was made for, the data.train files and
               a fingerprint of the samples' lengths, file sizes and weights

A resume (`plan_resume`, in `vlmcp validate` and at every rank's start, before anything loads):

* the layout (world size, SP, DP, EP, ZeRO stage, precision) may change. DeepSpeed's own files
  load where they hold what the new layout reads: the same world size, ZeRO stage, EP size and
  precision (ZeRO 0 in fp32 at any world size: its one model-states file holds the whole optimizer
  state). Anything else loads through DeepSpeed's universal checkpoint, converted once beside the
  checkpoint (training/weights/universal.py);
* the trained parameters may not change (the optimizer state is theirs): one line naming the key;
* the data position (`data_position_problems`) follows the global batch, not the layout: optimizer
  step k trains the global batch's slots [k*G, (k+1)*G) of its epoch's slot list, whatever
  the split of G into data-parallel ranks x train.grad_accum (`vlmcp.data.pack`). What would
  change which samples a step trains is refused, one line naming the key: the global batch,
  data.max_seq_len (another packing), data.train's samples, data.shuffle, parallel.sp_dynamic
  (another slot plan), parallel.sp_size while sp_dynamic is on (the degree plan is made for it),
  and train.seed while data.shuffle is on (another permutation). Allowed, with a logged line:
  data.train naming other files that hold the same samples, and train.seed without shuffle
  (then it seeds only the RNGs of ranks that find no saved RNG state of their own). A rollout job
  trains rollout step N at step N whatever the layout, packing or seed, so only its layout and
  trained parameters are compared.

A checkpoint saved before vlmcp recorded these has only "ep_size" in its manifest: its layout is
read from DeepSpeed's file names (ZeRO stage, data-parallel files, bf16), and its data position
is not compared (logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlmcp.config import JobConfig
from vlmcp.data.sources import data_files
from vlmcp.training.ds.config import zero_stage

logger = logging.getLogger(__name__)

#: The manifest's keys of a checkpoint's record.
LAYOUT, TRAINED, DATA = "layout", "trained", "data"


def precision_of(ds_config: dict[str, Any]) -> str:
    """"bf16", "fp16" or "fp32": what a (filled) DeepSpeed config trains in."""
    for flag in ("bf16", "fp16"):
        if ds_config.get(flag, {}).get("enabled") is True:
            return flag
    return "fp32"


def layout_of(job: JobConfig, world_size: int, ds_config: dict[str, Any]) -> dict[str, Any]:
    """The layout a run of `job` over `world_size` ranks trains at."""
    return {"world_size": world_size, "sp_size": job.parallel.sp_size,
            "dp_size": world_size // job.parallel.sp_size, "ep_size": job.parallel.ep_size,
            "zero_stage": zero_stage(ds_config), "precision": precision_of(ds_config),
            "grad_accum": job.train.grad_accum}


def trained_of(job: JobConfig) -> dict[str, Any]:
    """Which parameters a run of `job` trains (the keys that choose them)."""
    lora = job.lora
    return {"lora.r": lora.r,
            "lora.target_modules": lora.target_modules if lora.r else None,
            "lora.target_parameters": list(lora.target_parameters) if lora.r else None,
            "lora.modules_to_save": list(lora.modules_to_save) if lora.r else None,
            "model.freeze_vision": job.model.freeze_vision}


def data_fingerprint(lengths: np.ndarray, file_sizes: list[int], weights: list[float]) -> str:
    """A digest of what packing reads of data.train: every sample's length in file order, each
    file's sample count and its weight."""
    digest = hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    digest.update(json.dumps([list(file_sizes), list(weights)]).encode())
    return digest.hexdigest()[:32]


def data_of(job: JobConfig, world_size: int, lengths: np.ndarray | None = None,
            file_sizes: list[int] | None = None, weights: list[float] | None = None
            ) -> dict[str, Any]:
    """The data position's inputs of a run of `job` over `world_size` ranks (module docstring);
    `lengths`, `file_sizes`, `weights`: data.train's length index (None in a rollout job)."""
    if job.rollouts.dir:
        return {"source": "rollouts"}
    dp_size = world_size // job.parallel.sp_size
    return {"source": "train", "global_batch": dp_size * job.train.grad_accum,
            "max_seq_len": job.data.max_seq_len, "shuffle": job.data.shuffle,
            "seed": job.train.seed, "sp_dynamic": job.parallel.sp_dynamic,
            "plan_sp_size": job.parallel.sp_size if job.parallel.sp_dynamic else None,
            "train_files": [f.path for f in data_files(job.data.train, "data.train")],
            "fingerprint": None if lengths is None else data_fingerprint(lengths, file_sizes,
                                                                         weights)}


def checkpoint_record(job: JobConfig, world_size: int, ds_config: dict[str, Any],
                      data: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run that saves it (module docstring)."""
    return {LAYOUT: layout_of(job, world_size, ds_config), TRAINED: trained_of(job), DATA: data}


_ZERO3_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt")
_ZERO_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def legacy_layout(tag_dir: Path, ep_size: int) -> dict[str, Any]:
    """The layout of a checkpoint saved without a record, read from DeepSpeed's file names:
    ZeRO-3 model-states files or ZeRO optimizer files per data-parallel rank (their count is the
    world size, "bf16_" their precision), else ZeRO 0. ZeRO 1 and 2 write the same files
    (stage 2 is assumed); SP, DP and grad_accum are unknown (None)."""
    names = [p.name for p in Path(tag_dir).iterdir()]
    zero3 = [m for m in map(_ZERO3_FILE.fullmatch, names) if m]
    optim = [m for m in map(_ZERO_OPTIM_FILE.fullmatch, names) if m]
    found = zero3 or optim
    stage = 3 if zero3 else 2 if optim else 0
    bf16 = any(m.group(1) for m in found)
    return {"world_size": len({m.group(2) for m in found}) if found else None,
            "sp_size": None, "dp_size": None, "ep_size": ep_size, "zero_stage": stage,
            "precision": "bf16" if bf16 else None, "grad_accum": None}


@dataclass
class ResumePlan:
    """How a resume loads the newest complete checkpoint `tag_dir` (saved after `step` steps).

    universal: through DeepSpeed's universal checkpoint beside it (converted at the start when
               not there yet); else DeepSpeed's own files.
    problems:  what refuses the resume, one line each naming its key.
    notes:     what changed and is allowed, logged once at the start.
    saved:     the checkpoint's record (`checkpoint_record`; a legacy one's layout from its files).
    """

    tag_dir: Path
    step: int
    universal: bool
    saved: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _shown(layout: dict[str, Any]) -> str:
    parts = [f"world {layout['world_size']}"]
    for key, name in (("sp_size", "SP"), ("dp_size", "DP"), ("ep_size", "EP")):
        if layout.get(key) is not None:
            parts.append(f"{name} {layout[key]}")
    parts.append(f"ZeRO {layout['zero_stage']}")
    if layout.get("precision"):
        parts.append(layout["precision"])
    return ", ".join(parts)


def _whole_optimizer_file(layout: dict[str, Any]) -> bool:
    """ZeRO 0 in fp32: the model states hold the torch optimizer's whole state, read at any world."""
    return layout["zero_stage"] == 0 and layout.get("precision") == "fp32"


def needs_universal(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint saved at layout `saved` loads at layout `now` only through DeepSpeed's
    universal checkpoint (module docstring)."""
    if any(saved.get(key) != now[key] for key in ("zero_stage", "ep_size", "precision")):
        return True
    return saved.get("world_size") != now["world_size"] and not _whole_optimizer_file(now)


def _layout_problems(saved: dict[str, Any], now: dict[str, Any], tag_dir: Path) -> list[str]:
    """What DeepSpeed's universal checkpoint cannot do between the two layouts: ZeRO 0 in fp32
    keeps the torch optimizer's state in a file the conversion does not read, and a ZeRO-0 fp32
    engine has no ZeRO optimizer to load one."""
    fp32_zero0 = [side for side, layout in (("saved", saved), ("now", now))
                  if _whole_optimizer_file(layout)]
    if not fp32_zero0:
        return []
    return [f"config key 'deepspeed.zero_optimization.stage': {now['zero_stage']}, but checkpoint "
            f"{tag_dir} was saved at {_shown(saved)}; DeepSpeed's universal checkpoint does not "
            "convert between ZeRO 0 in fp32 and other stages or EP sizes: resume at ZeRO "
            f"{saved['zero_stage']} with parallel.ep_size={saved['ep_size']}"]


def _trained_problems(saved: dict[str, Any], job: JobConfig, tag_dir: Path) -> list[str]:
    """One line per key that changes which parameters train; the other lora keys follow lora.r
    (null without LoRA), so a change of lora.r is its line alone."""
    now = trained_of(job)
    changed = [key for key in now if key in saved and saved[key] != now[key]]
    if "lora.r" in changed:
        changed = [key for key in changed if not key.startswith("lora.") or key == "lora.r"]
    return [f"config key '{key}': {json.dumps(now[key])}, but checkpoint {tag_dir} trained with "
            f"{json.dumps(saved[key])}; its optimizer state is that of other parameters (set it "
            "back, or start a new run from an exported model)" for key in changed]


def plan_resume(tag_dir: Path, manifest: dict[str, Any], job: JobConfig, world_size: int,
                ds_config: dict[str, Any]) -> ResumePlan:
    """How `job` over `world_size` ranks resumes from the complete checkpoint `tag_dir` whose
    manifest is `manifest` (module docstring). The data position is compared once the length
    index is there (`data_position_problems`)."""
    now = layout_of(job, world_size, ds_config)
    saved = manifest.get(LAYOUT) or legacy_layout(tag_dir, manifest.get("ep_size", 1))
    universal = needs_universal(saved, now)
    plan = ResumePlan(Path(tag_dir), int(manifest["step"]), universal,
                      {**manifest, LAYOUT: saved})
    if universal:
        plan.problems += _layout_problems(saved, now, Path(tag_dir))
    plan.problems += _trained_problems(manifest.get(TRAINED, {}), job, Path(tag_dir))
    if saved != now:
        how = ("through DeepSpeed's universal checkpoint (converted once, beside it)"
               if universal else "from DeepSpeed's own files")
        plan.notes.append(f"resuming checkpoint {tag_dir} (saved at {_shown(saved)}) at "
                          f"{_shown(now)}, {how}")
    if manifest.get(LAYOUT) is None:
        plan.notes.append(f"checkpoint {tag_dir} was saved without its layout record (an earlier "
                          "vlmcp): its data position is not compared with this run's")
    return plan


def _keep_global_batch(saved_batch: int, dp_size: int) -> str:
    if saved_batch % dp_size == 0:
        return f"set train.grad_accum={saved_batch // dp_size} to keep it"
    return (f"no train.grad_accum keeps it at data-parallel size {dp_size}: choose a world size "
            "and parallel.sp_size whose data-parallel size divides it")


def data_position_problems(plan: ResumePlan, now: dict[str, Any], dp_size: int
                           ) -> tuple[list[str], list[str]]:
    """(problems, notes) of resuming the data position `plan.saved["data"]` with this run's `now`
    (`data_of`) at data-parallel size `dp_size`: module docstring."""
    saved = plan.saved.get(DATA)
    if saved is None or saved["source"] != now["source"]:
        if saved is not None:
            return [f"config key 'rollouts.dir': checkpoint {plan.tag_dir} was saved by a "
                    f"{saved['source']} job, this one is a {now['source']} job"], []
        return [], []
    if now["source"] == "rollouts":
        return [], []
    where = f"checkpoint {plan.tag_dir} was saved with"
    problems, notes = [], []
    if saved["global_batch"] != now["global_batch"]:
        problems.append(
            f"config key 'train.grad_accum': the global batch would be {now['global_batch']} "
            f"(data-parallel size {dp_size} x train.grad_accum "
            f"{now['global_batch'] // dp_size}), but {where} {saved['global_batch']}: step k "
            "trains the k-th global batch of its epoch, so another size would skip or repeat "
            f"samples; {_keep_global_batch(saved['global_batch'], dp_size)}")
    for key, section, why in (
            ("max_seq_len", "data", "another packing of the epoch"),
            ("shuffle", "data", "another sample order"),
            ("sp_dynamic", "parallel", "another slot plan of the epoch")):
        if saved[key] != now[key]:
            problems.append(f"config key '{section}.{key}': {json.dumps(now[key])}, but {where} "
                            f"{json.dumps(saved[key])}: {why} would skip or repeat samples")
    if saved["sp_dynamic"] and now["sp_dynamic"] and saved["plan_sp_size"] != now["plan_sp_size"]:
        problems.append(f"config key 'parallel.sp_size': {now['plan_sp_size']} with "
                        f"parallel.sp_dynamic, but {where} {saved['plan_sp_size']}: the degree "
                        "plan's slots depend on it, so another size would skip or repeat "
                        "samples; resume at that sp_size, or turn sp_dynamic off for the whole run")
    if saved["seed"] != now["seed"]:
        if now["shuffle"] or saved["shuffle"]:
            problems.append(f"config key 'train.seed': {now['seed']}, but {where} "
                            f"{saved['seed']}: with data.shuffle every epoch's order comes from "
                            "it, so another seed would skip or repeat samples")
        else:
            notes.append(f"train.seed changed from {saved['seed']} to {now['seed']}: without "
                         "data.shuffle the data order does not depend on it; it seeds the RNGs "
                         "of the ranks that find no saved RNG state")
    if saved["fingerprint"] is not None and now["fingerprint"] is not None:
        if saved["fingerprint"] != now["fingerprint"]:
            problems.append(f"config key 'data.train': its samples differ from those {where} "
                            f"({', '.join(saved['train_files'])}; their lengths, counts or "
                            "weights): the data position would point at other samples; resume "
                            "with that data, or start a new run from an exported model")
        elif saved["train_files"] != now["train_files"]:
            notes.append(f"data.train names {', '.join(now['train_files'])} instead of "
                         f"{', '.join(saved['train_files'])}: the same samples (lengths, counts "
                         "and weights), so the run continues at its data position")
    return problems, notes
