"""Runs and references of the resume-at-another-layout tests (tests/test_resume_layouts.py).

A case trains `STEPS` optimizer steps at layout A without interruption, checkpointing after step
`SAVED` (`uninterrupted`: vlmcp's own `start_run` and `train_step`, so that the weights after step
`SAVED` and the samples of every step can be read off the live run), and resumes a copy of that
checkpoint at layout B for the last step (`trained`: `vlmcp.training.loop.train`, the path of
`vlmcp train` with `train.resume`). Several runs share one set of ranks (`run_all`).

The reference (`reference_run`) trains the same samples the same steps with plain transformers,
each sample forwarded alone, its loss sum CE / N over the step, torch's AdamW and vlmcp's LR
schedule, DeepSpeed's gradient clipping, in float64 under `Float64Mode` (the truth; the
uninterrupted run is the fp32 computation whose distance from it is fp32's own error,
docs/test-bounds.md). A LoRA run's reference starts from the adapters the uninterrupted run
started from (its step-0 export).
"""

from __future__ import annotations

import gc
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoConfig, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from tests.helpers.parity import RawSample, float64_everywhere, vision_kwargs
from vlmcp.config import job_from_dict
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.dataset import load_samples
from vlmcp.data.processor import load_processor

#: Optimizer steps of a case, and the step after which the resumed run's checkpoint was saved.
STEPS, SAVED = 3, 2
ADAPTER = "adapter_model.safetensors"


def layout_job(model: Path, data: Path, out: Path, *, sp: int = 1, ep: int = 1, stage: int = 2,
               accum: int = 1, lora: dict | None = None, **extra: Any) -> dict:
    """A tiny fp32 AdamW job at one layout: warmup over the first two steps, so that the LR
    schedule's position matters at the resumed step; shuffled data."""
    job: dict[str, Any] = {
        "model": {"path": str(model)},
        "data": {"train": str(data), "max_seq_len": 64, "shuffle": True, "num_workers": 0},
        "optimizer": {"type": "adamw", "lr": 2e-3, "weight_decay": 0.01},
        "scheduler": {"type": "constant", "warmup_steps": 2},
        "parallel": {"sp_size": sp, "ep_size": ep},
        "train": {"max_steps": STEPS, "seed": 3, "grad_accum": accum, "save_every": SAVED},
        "deepspeed": {"zero_optimization": {"stage": stage}},
        "output_dir": str(out),
    }
    if lora:
        job["lora"] = {"r": 4, "alpha": 8, **lora}
    for section, values in extra.items():
        job[section] = {**job.get(section, {}), **values}
    return job


def _fresh_process_state() -> None:
    """What one run leaves in the process that the next run's start would trip on: DeepSpeed's
    group registry (the SP groups are made once per process, the mpu and the expert groups are
    kept for later engines; DeepSpeed's own teardown helper forgets them, the process groups
    stay) and transformers' ZeRO-3 marker."""
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    groups._release_process_group_references()
    unset_hf_deepspeed_config()
    gc.collect()


def _export(run: Any, out: Path) -> None:
    """The run's trained weights now, as its final export writes them (every rank)."""
    from vlmcp.training.weights.export import save_final
    from vlmcp.training.weights.lora_export import save_final_adapter

    model_dir = run.job.resolve_input(run.job.model.path)
    if run.adapter is not None:
        save_final_adapter(run.module, run.adapter, model_dir, out)
    else:
        save_final(run.engine, run.module.hf_model, model_dir, out)


def uninterrupted(job: dict) -> dict:
    """Train `job` STEPS steps on every rank, saving its checkpoint after step SAVED and its
    weights at steps 0 (LoRA), SAVED and STEPS under output_dir/weights_<step>; returns its metrics
    rows and, per step, the samples of the micro-batches of weight 1 this rank ran."""
    from vlmcp.training.checkpoint import save_checkpoint
    from vlmcp.training.loop import start_run, train_step
    from vlmcp.training.weights.hf_format import hf_key_prefixes

    out = Path(job["output_dir"])
    run = start_run(job_from_dict(job))
    rows, samples = [], []
    try:
        run.engine.train()
        if run.adapter is not None:
            _export(run, out / "weights_0")
        for step in range(STEPS):
            rows.append(train_step(run, step))
            fetched = run.step_packs.step_batches(step)
            samples.append(sorted({sid for ids, weight in zip(fetched.sample_ids, fetched.weights)
                                   if weight for sid in ids}))
            if step + 1 == SAVED:
                save_checkpoint(run.engine, run.job, SAVED,
                                hf_key_prefixes(run.module, run.module.hf_model), run.record)
                _export(run, out / f"weights_{SAVED}")
        _export(run, out / f"weights_{STEPS}")
    finally:
        run.steps.close()
    del run
    _fresh_process_state()
    return {"rows": rows, "samples": samples}


def copy_saved(saved_by: Path, out: Path) -> None:
    """The checkpoint of step SAVED of the run in `saved_by` as the only one of `out`, and with a
    publish.dir the steps it published up to SAVED (what a preempted run leaves)."""
    shutil.copytree(saved_by / "checkpoints" / f"step{SAVED}", out / "checkpoints" / f"step{SAVED}")
    (out / "checkpoints" / "latest").write_text(f"step{SAVED}")
    for step in range(1, SAVED + 1):
        published = saved_by / "weights" / f"step_{step}"
        if published.is_dir():
            shutil.copytree(published, out / "weights" / f"step_{step}")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trained(job: dict, saved_by: str | None) -> dict:
    """`vlmcp train`'s loop on `job`; with `saved_by` (an earlier run's output_dir) it resumes
    from a copy of that run's checkpoint of step SAVED (`copy_saved`). Returns its metrics rows."""
    from vlmcp.parallel import comm
    from vlmcp.training.loop import train

    out = Path(job["output_dir"])
    if saved_by is not None:
        if comm.rank() == 0:
            copy_saved(Path(saved_by), out)
        comm.barrier()
        job = {**job, "train": {**job["train"], "resume": True}}
    train(job_from_dict(job))
    _fresh_process_state()
    return {"rows": _rows(out)}


def run_all(runs: list[tuple[str, str, dict, str | None]]) -> dict[str, dict]:
    """On every rank: each run of `runs` in order, (kind "uninterrupted" | "trained", name, job,
    for "trained" the output_dir whose checkpoint it resumes or None); {name: what it
    returned}."""
    return {name: uninterrupted(job) if kind == "uninterrupted" else trained(job, saved_by)
            for kind, name, job, saved_by in runs}


@dataclass
class Trajectory:
    """A reference run: the loss of every step, and the trained weights before step `SAVED` + 1
    and after step STEPS, under the names of a run's export (transformers' names, or the PEFT
    adapter file's keys)."""

    losses: list[float]
    saved: dict[str, torch.Tensor]
    last: dict[str, torch.Tensor]


def _raw_samples(job: dict, ids: list[str]) -> list[RawSample]:
    """The samples of `ids` ("file:line") as plain transformers takes them."""
    processor = load_processor(job["model"]["path"])
    by_source = {s.source: s for s in load_samples(job["data"]["train"], processor,
                                                   job["data"]["max_seq_len"])}
    return [RawSample(torch.tensor(s.input_ids), torch.tensor(s.labels), s.pixel_values,
                      s.image_grid_thw) for s in (by_source[i] for i in ids)]


def model_class(model_dir: Path) -> type:
    moe = AutoConfig.from_pretrained(model_dir).model_type == "qwen3_5_moe"
    return Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration


def trained_weights(directory: Path, job: dict) -> dict[str, torch.Tensor]:
    """A run's export: the adapter file's tensors (LoRA), else the model's state under
    transformers' names (per-expert files fused as transformers loads them)."""
    if job.get("lora"):
        return load_file(directory / ADAPTER)
    model = model_class(directory).from_pretrained(directory, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference_model(job: dict, start: Path | None) -> torch.nn.Module:
    """Plain transformers' model of the job in fp32, its vision tower frozen; under LoRA its
    PeftModel with the adapters of `start`'s adapter file."""
    from vlmcp.config import LoraSection
    from vlmcp.model.lora import apply_lora

    model_dir = Path(job["model"]["path"])
    model = model_class(model_dir).from_pretrained(model_dir, dtype=torch.float32,
                                                   attn_implementation="sdpa")
    model.model.visual.requires_grad_(False)
    if not job.get("lora"):
        return model
    peft = apply_lora(model, LoraSection(**job["lora"]), model_dir)
    set_peft_model_state_dict(peft, load_file(start / ADAPTER))
    return peft


def _weights(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights of a reference model (`root`: the PeftModel under LoRA) under the
    names of a run's export."""
    if hasattr(root, "peft_config"):
        return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(root).items()}
    return {k: v.detach().float().clone() for k, v in root.state_dict().items()}


def _train(root: torch.nn.Module, job: dict, steps: list[list[RawSample]]) -> Trajectory:
    """Every step of `steps` on `root` (the model, or its PeftModel) in place (module
    docstring)."""
    from vlmcp.config import OptimizerSection, SchedulerSection
    from vlmcp.training.optim import build_scheduler

    params = [p for p in root.parameters() if p.requires_grad]
    opt_section = OptimizerSection(**job["optimizer"])
    optimizer = torch.optim.AdamW(params, lr=opt_section.lr, betas=tuple(opt_section.betas),
                                  eps=opt_section.eps, weight_decay=opt_section.weight_decay,
                                  foreach=False)
    schedule = build_scheduler(optimizer, SchedulerSection(**job["scheduler"]), STEPS)
    config = root.config if hasattr(root, "config") else root.base_model.model.config
    losses, saved = [], {}
    for index, samples in enumerate(steps):
        if index == SAVED:
            saved = _weights(root)
        n_total = sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in samples)
        loss = 0.0
        for sample in samples:
            n = int((sample.labels[1:] != IGNORE_INDEX).sum())
            out = root(input_ids=sample.input_ids[None], labels=sample.labels[None],
                       use_cache=False, **vision_kwargs(sample, config))
            (out.loss * n / n_total).backward()
            loss += float(out.loss.detach()) * n / n_total
        losses.append(loss)
        torch.nn.utils.clip_grad_norm_(params, job["train"].get("grad_clip", 1.0))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return Trajectory(losses, saved, _weights(root))


def reference_run(job: dict, step_samples: list[list[str]], start: Path | None) -> Trajectory:
    """Plain transformers' float64 run of `job` over the samples of each step (module docstring),
    from the weights of `model.path` (and under LoRA the adapters of the export in `start`)."""
    steps = [_raw_samples(job, ids) for ids in step_samples]
    twin = _reference_model(job, start).double()
    base = twin.base_model.model if hasattr(twin, "peft_config") else twin
    if getattr(base.config, "_experts_implementation", None) not in (None, "eager"):
        base.set_experts_implementation("eager")  # (the grouped matmul has no float64 kernel)
    with float64_everywhere():
        return _train(twin, job, steps)
