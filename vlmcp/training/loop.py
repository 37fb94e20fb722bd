"""`vlmcp train`: one job, every rank, from process-group start to the exported model.

Per optimizer step, each rank runs `train.grad_accum` packed micro-batches (every rank of a
sequence-parallel group gets the same pack and shards it internally). The step's loss is the sum
of target-token cross-entropy over all micro-batches and ranks / the number of those targets;
each micro-batch's shard loss is scaled so that DeepSpeed's averaging and accumulation yield
exactly that gradient. DeepSpeed clips, steps the optimizer and the LR schedule at the
accumulation boundary.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.data.pack import PackedDataset
from vlmcp.model.load import load_model
from vlmcp.model.loss import global_target_count, scale_for_deepspeed
from vlmcp.model.packed import PackedVLM
from vlmcp.parallel import comm
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.checkpoint import checkpoint_dir, load_latest, save_checkpoint
from vlmcp.training.ds_config import zero_stage
from vlmcp.training.evaluate import eval_loss, generation_accuracy
from vlmcp.training.export import hf_key_prefixes, save_final
from vlmcp.training.metrics import MetricsWriter
from vlmcp.training.optim import build_optimizer, build_scheduler
from vlmcp.training.preflight import Preflight, PreflightError, run_preflight
from vlmcp.training.schedule import StepSchedule

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a started run holds."""

    job: JobConfig
    preflight: Preflight
    sp: SequenceParallel
    engine: Any
    module: PackedVLM
    schedule: StepSchedule
    metrics: MetricsWriter
    start_step: int


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def agree_on_problems(problems: list[str]) -> None:
    """Fail on every rank when any rank found a problem, before any other collective.

    The lowest failing rank raises its problems (the CLI prints them); every other rank raises
    an empty PreflightError and exits quietly, so no rank is left waiting in a collective and
    each problem is printed once.
    """
    flags = torch.zeros(comm.world_size(), dtype=torch.float64)
    flags[comm.rank()] = float(bool(problems))
    comm.all_reduce_sum(flags)
    failing = [r for r, flag in enumerate(flags.tolist()) if flag]
    if not failing:
        return
    if comm.rank() == failing[0]:
        raise PreflightError(problems)
    raise PreflightError([])


def _build_engine(job: JobConfig, preflight: Preflight, sp: SequenceParallel) -> tuple[Any, PackedVLM]:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = preflight.ds_config
    # Kept alive while the model loads, so that from_pretrained partitions under ZeRO-3.
    hf_ds_config = HfDeepSpeedConfig(ds_config) if zero_stage(ds_config) == 3 else None
    hf_model = load_model(job.resolve_input(job.model.path), job.model.dtype,
                          freeze_vision=job.model.freeze_vision,
                          attn_implementation=job.model.attn_implementation)
    module = PackedVLM(hf_model, sp=sp, deltanet_cp=job.parallel.deltanet_cp,
                       gradient_checkpointing=job.train.gradient_checkpointing,
                       loss_chunk_mb=job.train.loss_chunk_mb)
    optimizer = build_optimizer((p for p in module.parameters() if p.requires_grad), job.optimizer)
    scheduler = build_scheduler(optimizer, job.scheduler, job.train.max_steps)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, mpu=sp.mpu)
    del hf_ds_config
    return engine, module


def start_run(job: JobConfig) -> Run:
    """Start the process group, check the job on every rank, build the engine and the data."""
    comm.init_distributed()
    preflight = run_preflight(job, comm.world_size())
    agree_on_problems(preflight.problems)
    seed_everything(job.train.seed)
    sp = SequenceParallel.initialize(job.parallel.sp_size)
    logger.info("world %d = sp %d x dp %d, ZeRO stage %d, %d train / %d eval samples",
                comm.world_size(), sp.size, sp.dp_size, zero_stage(preflight.ds_config),
                len(preflight.train_samples), len(preflight.eval_samples))
    engine, module = _build_engine(job, preflight, sp)
    start_step = load_latest(engine, job) if job.train.resume else 0
    dataset = PackedDataset(preflight.train_samples, job.data.max_seq_len, dp_rank=sp.dp_rank,
                            dp_size=sp.dp_size, shuffle=job.data.shuffle, seed=job.train.seed,
                            multiple_of=job.train.grad_accum)
    return Run(job=job, preflight=preflight, sp=sp, engine=engine, module=module,
               schedule=StepSchedule(dataset, job.train.grad_accum),
               metrics=MetricsWriter(job.output_dir, enabled=comm.rank() == 0,
                                     start_step=start_step),
               start_step=start_step)


def _plain_fp32_engine(engine: Any) -> bool:
    """ZeRO-0 in fp32: DeepSpeed clips there without keeping the norm, so vlmcp measures it."""
    return not (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def _grad_norm(module: torch.nn.Module) -> float:
    """L2 norm of the (all-reduced, unclipped) gradients of `module`."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def train_step(run: Run, step: int) -> dict[str, Any]:
    """Run optimizer step `step` (0-based); returns its metrics row."""
    started = time.perf_counter()
    engine, sp, grad_accum = run.engine, run.sp, run.job.train.grad_accum
    batches = run.schedule.batches(step)
    lr = engine.get_lr()[0]
    n_global = global_target_count(sum(run.module.shard_target_count(b) for b in batches))
    sums = torch.zeros(2, dtype=torch.float64)  # [shard CE sum, pack tokens (once per SP group)]
    grad_norm = None
    for index, batch in enumerate(batches):
        loss_sum, _ = engine(batch)
        engine.backward(scale_for_deepspeed(loss_sum, n_global, dp_size=sp.dp_size,
                                            grad_accum=grad_accum))
        if index == len(batches) - 1 and _plain_fp32_engine(engine):
            grad_norm = _grad_norm(engine.module)
        engine.step()
        sums[0] += float(loss_sum.detach())
        if sp.rank == 0:
            sums[1] += batch.num_tokens
    comm.all_reduce_sum(sums)
    elapsed = time.perf_counter() - started
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    return {
        "step": step + 1,
        "loss": float(sums[0]) / max(n_global, 1),
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens": int(sums[1]),
        "targets": n_global,
        "tokens_per_s": float(sums[1]) / elapsed,
        "step_time_s": elapsed,
        "epoch": run.schedule.locate(step)[0],
    }


def evaluate(run: Run, step: int) -> dict[str, Any]:
    """Evaluation row at `step` completed steps (every rank takes part)."""
    job, engine = run.job, run.engine
    engine.eval()
    loss, targets = eval_loss(engine, run.preflight.eval_samples, job.data.max_seq_len, run.sp)
    row: dict[str, Any] = {"step": step, "eval_loss": loss, "eval_targets": targets}
    if job.eval.generate:
        samples = run.preflight.eval_samples[:job.eval.max_samples]
        accuracy, count = generation_accuracy(
            run.module.hf_model, samples, job.eval.max_new_tokens,
            synced=zero_stage(run.preflight.ds_config) == 3)
        row.update({"eval_accuracy": accuracy, "eval_samples": count})
    engine.train()
    return row


def _progress(run: Run) -> Any:
    if comm.rank() != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.job.train.max_steps, initial=run.start_step, desc="train",
                unit="step", dynamic_ncols=True)


def train(job: JobConfig) -> None:
    """Train `job` to `train.max_steps`, checkpointing, evaluating and exporting on the way."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    run = start_run(job)
    with logging_redirect_tqdm():
        _train_loop(run)
    save_final(run.engine, run.module, run.module.hf_model, job.resolve_input(job.model.path),
               f"{job.output_dir}/final")
    logger.info("done: %d steps; metrics in %s/metrics.jsonl, checkpoints in %s",
                job.train.max_steps, job.output_dir, checkpoint_dir(job))


def _train_loop(run: Run) -> None:
    job, train_cfg = run.job, run.job.train
    progress = _progress(run)
    prefixes = hf_key_prefixes(run.module, run.module.hf_model)
    run.engine.train()
    for step in range(run.start_step, train_cfg.max_steps):
        row = train_step(run, step)
        done = step + 1
        if done % train_cfg.log_every == 0 or done == train_cfg.max_steps:
            run.metrics.write(row)
        if progress is not None:
            progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            progress.update(1)
        if train_cfg.eval_every and (done % train_cfg.eval_every == 0 or done == train_cfg.max_steps):
            eval_row = evaluate(run, done)
            run.metrics.write(eval_row)
            logger.info("step %d: %s", done, ", ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in eval_row.items() if k != "step"))
        if train_cfg.save_every and done % train_cfg.save_every == 0:
            save_checkpoint(run.engine, job, done, prefixes)
    if progress is not None:
        progress.close()
    run.metrics.close()
