"""`vlmcp train`: one job, every rank, from process-group start to the exported model.

Per optimizer step, each rank runs `train.grad_accum` packed micro-batches of data.train
(training/step_packs.py), or as many as rollout step N packs into (`rollouts.dir`,
training/rollout_steps.py, whose wait for the step lies outside the watchdog); every rank of a
sequence-parallel group gets the same pack and shards it internally. The step's loss is the sum
of target-token cross-entropy over all micro-batches and ranks / the number of those targets (or
the `loss` section's objective and normaliser, training/objective_step.py); each micro-batch's
shard loss is scaled so that DeepSpeed's averaging and accumulation yield
exactly that gradient, and the loop marks the last micro-batch as the accumulation boundary. A
micro-batch of weight 0 (a repeated pack that only keeps a short DP rank's collectives in step)
adds nothing. DeepSpeed clips, steps the optimizer and the LR schedule at the boundary. With
`publish.dir`, the weights are published after every `publish.every`-th step
(training/publish.py), before evaluation and checkpoints; a background write is checked at every
step boundary (`_publish_boundary`) and waited for after the last step, or on a stop within
publish.stop_wait_s.

With `model.router_aux_loss` (MoE), each micro-batch also adds router_aux_loss_coef x its router
load-balancing loss (model.router_loss): the step's gradient is d(sum CE / N) + coef x d(mean of
the micro-batches' aux losses over DP x accumulation). The row's `loss` stays the LM loss; the
mean aux loss (without the coefficient) is reported as `router_aux_loss`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.data.mixture import draws_per_epoch
from vlmcp.data.pack import PackedDataset
from vlmcp.data.stream import SampleReader
from vlmcp.errors import CheckpointError, DataError, NonFiniteError, PreflightError, RolloutError
from vlmcp.model.loss import scale_for_deepspeed
from vlmcp.model.packed import PackedVLM
from vlmcp.model.router_loss import router_objective
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.checkpoint import checkpoint_dir, load_latest, save_checkpoint
from vlmcp.training.ds.config import zero_stage
from vlmcp.training.evaluate import eval_loss, generation_accuracy
from vlmcp.training.export import save_final
from vlmcp.training.hf_format import hf_key_prefixes
from vlmcp.training.lora_export import save_final_adapter
from vlmcp.training.metrics import MetricsWriter
from vlmcp.training.nonfinite import NonFiniteGuard
from vlmcp.training.objective_step import INITIAL_REFERENCE, objective_metrics, step_counts
from vlmcp.training.optim import can_veto
from vlmcp.training.preflight import Preflight
from vlmcp.training.publish import Publisher
from vlmcp.training.rollout_steps import RolloutSteps
from vlmcp.training.score import score_initial_reference
from vlmcp.training.setup import build_engine, seed_everything, start_checked
from vlmcp.training.signals import StopRequested, StopSignals
from vlmcp.training.step_packs import StepBatches, StepPacks
from vlmcp.training.watchdog import Watchdog

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a started run holds."""

    job: JobConfig
    preflight: Preflight
    sp: SequenceParallel
    engine: Any
    module: PackedVLM
    metrics: MetricsWriter
    start_step: int
    #: Where each step's micro-batches come from: data.train, or rollouts.dir.
    step_packs: StepPacks | None = None
    rollouts: RolloutSteps | None = None
    #: Publishes the weights after steps when publish.dir is set.
    publisher: Publisher | None = None
    #: The PeftModel around `module.hf_model` when the job trains LoRA adapters (lora.r > 0).
    adapter: Any = None

    @property
    def steps(self) -> StepPacks | RolloutSteps:
        """The source of the steps' micro-batches."""
        return self.rollouts if self.rollouts is not None else self.step_packs


def _step_packs(job: JobConfig, preflight: Preflight, sp: SequenceParallel,
                reference: np.ndarray | None) -> StepPacks:
    """This rank's packs of each step, over the length index, loading packs with DataLoader
    workers; `reference`: the pairs' reference sums (`SampleReader.reference_logps`)."""
    index = preflight.train_index
    if len(preflight.train_file_sizes) > 1 or any(w != 1 for w in preflight.train_weights):
        draws = draws_per_epoch(preflight.train_file_sizes, preflight.train_weights)
        logger.info("data.train mixture, samples per epoch: %s", ", ".join(
            f"[{i}] {n} x {w:g} -> {k}" for i, (n, w, k) in enumerate(
                zip(preflight.train_file_sizes, preflight.train_weights, draws))))
    dataset = PackedDataset(index.tokens, job.data.max_seq_len, dp_rank=sp.dp_rank,
                            dp_size=sp.dp_size, shuffle=job.data.shuffle, seed=job.train.seed,
                            multiple_of=job.train.grad_accum,
                            file_sizes=preflight.train_file_sizes,
                            weights=preflight.train_weights)
    reader = SampleReader(index, preflight.processor, job.data.max_seq_len, job.data.truncate,
                          cache_path=str(preflight.train_index_result.path),
                          reference_logps=reference)
    return StepPacks(dataset, job.train.grad_accum, reader, num_workers=job.data.num_workers,
                     prefetch_factor=job.data.prefetch_factor)


def start_run(job: JobConfig) -> Run:
    """Start the process group, check the job on every rank, build the engine and the data."""
    preflight = start_checked(job)
    seed_everything(job.train.seed)
    sp = SequenceParallel.initialize(job.parallel.sp_size)
    train_data = (f"rollout steps from {job.rollouts.dir}" if job.rollouts.dir
                  else f"{len(preflight.train_index)} train samples")
    logger.info("world %d = sp %d x dp %d, ZeRO stage %d, %s / %d eval samples",
                comm.world_size(), sp.size, sp.dp_size, zero_stage(preflight.ds_config),
                train_data, len(preflight.eval_index or ()))
    engine, module, adapter = build_engine(job, preflight, sp)
    start_step = load_latest(engine, job) if job.train.resume else 0
    reference = preflight.reference_logps
    if job.loss.reference_logps == INITIAL_REFERENCE and not job.train.resume:
        logger.info("loss.reference_logps \"initial\": scoring data.train with the initial policy")
        reference = score_initial_reference(
            engine, SampleReader(preflight.train_index, preflight.processor,
                                 job.data.max_seq_len, job.data.truncate), job, sp)
    return Run(job=job, preflight=preflight, sp=sp, engine=engine, module=module,
               step_packs=None if job.rollouts.dir else _step_packs(job, preflight, sp,
                                                                    reference),
               rollouts=RolloutSteps(job, preflight.processor, sp) if job.rollouts.dir else None,
               publisher=(Publisher(job, engine, module, adapter, start_step)
                          if job.publish.dir else None),
               metrics=MetricsWriter(job.output_dir, enabled=comm.rank() == 0,
                                     start_step=start_step),
               start_step=start_step, adapter=adapter)


def _step_batches(run: Run, step: int) -> StepBatches:
    """This rank's micro-batches of `step`; every rank stops together when any rank cannot load
    its packs (a DataLoader worker that died, a sample that fails to load)."""
    try:
        fetched, problems = run.steps.step_batches(step), []
    except (DataError, RuntimeError) as exc:
        fetched, problems = None, [f"loading the packs of step {step + 1}: {exc}"]
    fail_together(problems, PreflightError)
    return fetched


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
    fetched = _step_batches(run, step)
    if fetched.skip:
        return {"step": step + 1, "skipped_rollout": fetched.skip, **fetched.row}
    lr = engine.get_lr()[0]
    objective = run.module.objective
    counts = step_counts(run.module, fetched.counted, objective)
    # DeepSpeed divides each backward by its accumulation steps and averages over DP: the router
    # term of a micro-batch, scaled so, adds up to the mean over the step's micro-batches.
    router_scale = sp.dp_size * grad_accum / max(fetched.micro_batches, 1)
    # [shard loss sum, pack tokens (once per SP group), 1 where the optimizer step was not
    # applied, this rank's shares of the router aux losses, then the objective's metric sums
    # (Loss.stat_specs)]
    sums = torch.zeros(4 + len(objective.stat_specs()), dtype=torch.float64)
    grad_norm = None
    skipped_before = engine.skipped_steps
    last = len(fetched.batches) - 1
    for index, (batch, weight) in enumerate(zip(fetched.batches, fetched.weights)):
        engine.set_gradient_accumulation_boundary(index == last)
        with run.module.micro_batch():
            loss_sum, _, router_share, stat_sums = engine(
                batch, stats=True, denominators=counts.shard_denominators)
            sums[4:] += stat_sums * weight
            engine.backward(scale_for_deepspeed(loss_sum * weight, counts.denominator,
                                                dp_size=sp.dp_size, grad_accum=grad_accum)
                            + router_objective(router_share, run.module.router_aux_coef)
                            * (weight * router_scale))
        if index == last and _plain_fp32_engine(engine):
            grad_norm = _grad_norm(engine.module)
            # DeepSpeed checks for NaN/Inf gradients itself everywhere else (training/nonfinite.py).
            if can_veto(engine.optimizer):
                engine.optimizer.overflow = not math.isfinite(grad_norm)
        engine.step()
        sums[0] += float(loss_sum.detach()) * weight
        if router_share is not None:
            sums[3] += float(router_share.detach()) * weight
        if sp.rank == 0:
            sums[1] += batch.num_tokens * weight
    sums[2] = float(engine.skipped_steps > skipped_before)
    comm.all_reduce_sum(sums)
    elapsed = time.perf_counter() - started
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    row: dict[str, Any] = {
        "step": step + 1,
        "loss": float(sums[0]) / (counts.denominator or 1.0),
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens": int(sums[1]),
        "targets": counts.targets,
        "tokens_per_s": float(sums[1]) / elapsed,
        "step_time_s": elapsed,
        **fetched.row,
        **objective_metrics(sums[4:], counts, objective),
    }
    if run.module.router_loss is not None:
        row["router_aux_loss"] = float(sums[3]) / max(fetched.micro_batches, 1)
    if sums[2]:
        row["skipped_step"] = True
    return row


def evaluation_row(run: Run, step: int) -> dict[str, Any]:
    """Evaluation row at `step` completed steps (every rank takes part); data.eval's packs and
    prompts are loaded from its length index as they are needed."""
    job, engine = run.job, run.engine
    reader = SampleReader(run.preflight.eval_index, run.preflight.processor, job.data.max_seq_len,
                          job.data.truncate)
    engine.eval()
    loss, targets = eval_loss(engine, reader, job.data.max_seq_len, run.sp)
    row: dict[str, Any] = {"step": step, "eval_loss": loss, "eval_targets": targets}
    if job.eval.generate:
        count = len(reader.index)
        if job.eval.max_samples is not None:
            count = min(count, job.eval.max_samples)
        accuracy, count = generation_accuracy(
            run.module.hf_model, reader, count, job.eval.max_new_tokens,
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


def train(job: JobConfig) -> Run:
    """Train `job` to `train.max_steps`, checkpointing, evaluating and exporting on the way;
    returns the finished run.

    Raises StopRequested after a stop signal (a checkpoint is saved first), NonFiniteError on a
    non-finite step (`train.nonfinite`), CheckpointError when a checkpoint or the export cannot
    be written. Each watched phase must end within `train.collective_timeout_s`.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    run = start_run(job)
    timeout = job.train.collective_timeout_s
    with StopSignals() as stop, Watchdog(timeout, rank=comm.rank()) as watchdog, \
            logging_redirect_tqdm():
        _train_loop(run, stop, watchdog)
        if run.step_packs is not None:
            run.step_packs.close()
        with watchdog.watch("the final export"):
            if run.adapter is not None:
                save_final_adapter(run.module, run.adapter, job.resolve_input(job.model.path),
                                   f"{job.output_dir}/final")
            else:
                save_final(run.engine, run.module.hf_model,
                           job.resolve_input(job.model.path), f"{job.output_dir}/final")
    logger.info("done: %d steps; metrics in %s/metrics.jsonl, checkpoints in %s",
                job.train.max_steps, job.output_dir, checkpoint_dir(job))
    return run


class _Saver:
    """Saves checkpoints of the run, at most once per completed step."""

    def __init__(self, run: Run, watchdog: Watchdog):
        self.run, self.watchdog = run, watchdog
        self.prefixes = hf_key_prefixes(run.module, run.module.hf_model)
        self.saved_step = run.start_step if run.job.train.resume else -1

    def save(self, step: int) -> None:
        if step != self.saved_step:
            with self.watchdog.watch(f"saving the checkpoint of step {step}"):
                save_checkpoint(self.run.engine, self.run.job, step, self.prefixes)
            self.saved_step = step


def _abort_nonfinite(run: Run, step: int, row: dict[str, Any], problem: str, saver: _Saver) -> None:
    """Log the step's packs, keep a checkpoint of the last finite state, raise NonFiniteError."""
    ids = [sid for batch in run.steps.step_batches(step).batches for sid in batch.sample_ids]
    logger.error("rank %d: %s; its packs on this rank hold samples %s", comm.rank(), problem, ids)
    if row.get("skipped_step"):
        saver.save(step)
        kept = (f"a checkpoint of the last finite state (step {step}) is in "
                f"{checkpoint_dir(run.job)}")
    else:
        kept = "the weights took that step, so no new checkpoint was written"
    raise NonFiniteError([f"{problem}; stopped (train.nonfinite={run.job.train.nonfinite!r}, "
                          f"max_skipped_steps={run.job.train.max_skipped_steps}); {kept}"]
                         if comm.rank() == 0 else [])


def _keep_trained_steps(run: Run, step: int, saver: _Saver) -> str:
    """Before a rollout run stops at step `step` + 1: checkpoint the `step` steps done (call on
    every rank); returns what was kept, for the message."""
    if step == run.start_step:
        return "no step was trained since the start, so no new checkpoint was written"
    saver.save(step)
    return (f"a checkpoint of step {step} is in {checkpoint_dir(run.job)}; continue with "
            "train.resume=true")


def _wait_for_rollout(run: Run, step: int, stop: StopSignals, watchdog: Watchdog,
                      saver: _Saver) -> None:
    """Wait for rollout step `step` + 1 (outside the watchdog's phases). A stop signal while
    waiting, or rollouts.timeout_s, ends the run after a checkpoint of the steps trained so far."""
    outcome = run.rollouts.wait(step, lambda: stop.signum, watchdog)
    if not (outcome.signum or outcome.timed_out):
        return
    kept = _keep_trained_steps(run, step, saver)
    if outcome.signum:
        logger.warning("stopped on a signal while waiting for rollout step %d; %s", step + 1, kept)
        raise StopRequested(outcome.signum, step)
    raise RolloutError([f"{run.rollouts.timeout_problem(step, outcome.waited_s)}; {kept}"]
                       if comm.rank() == 0 else [])


def _publish_boundary(run: Run, done: int, watchdog: Watchdog, saver: _Saver) -> None:
    """After step `done` (every rank): the rows of the publishes that completed, the publish of
    `done` when it is due, and after the last step the wait for the write in flight. A failed
    publish (also a background write of an earlier step) keeps the trained steps in a
    checkpoint, then raises CheckpointError on every rank."""
    publisher = run.publisher
    try:
        with watchdog.watch(f"publishing after step {done}"):
            rows = publisher.check()
            if publisher.due(done):
                rows += publisher.publish(done)
            if done == run.job.train.max_steps:
                rows += publisher.close()
    except CheckpointError:
        kept = _keep_trained_steps(run, done, saver)
        if comm.rank() == 0:
            logger.error("publishing the weights failed after step %d; %s", done, kept)
        raise
    for row in rows:
        run.metrics.write(row)


def _train_loop(run: Run, stop: StopSignals, watchdog: Watchdog) -> None:
    progress = _progress(run)
    try:
        _run_steps(run, stop, watchdog, progress)
    except StopRequested:
        # Every rank stops together, after its checkpoint: the write in flight may finish.
        if run.publisher is not None:
            for row in run.publisher.close(run.job.publish.stop_wait_s):
                run.metrics.write(row)
        raise
    except BaseException:
        # One rank may fail alone here: no collective, the write in flight is abandoned.
        if run.publisher is not None:
            run.publisher.close(agreed=False)
        raise
    finally:
        # Also when a step raises: the bar ends its line before the error lines are printed.
        if progress is not None:
            progress.close()
    run.metrics.close()


def _run_steps(run: Run, stop: StopSignals, watchdog: Watchdog, progress: Any) -> None:
    train_cfg = run.job.train
    saver = _Saver(run, watchdog)
    guard = NonFiniteGuard(train_cfg.nonfinite, train_cfg.max_skipped_steps)
    run.engine.train()
    for step in range(run.start_step, train_cfg.max_steps):
        if run.rollouts is not None:
            _wait_for_rollout(run, step, stop, watchdog, saver)
        try:
            with watchdog.watch(f"step {step + 1}"):
                row = train_step(run, step)
        except (RolloutError, PreflightError):
            # a bad rollout step, or one of its packs failing to load (raised on every rank): the
            # steps trained since the last checkpoint are kept, as the producer moved on
            if run.rollouts is None:
                raise
            kept = _keep_trained_steps(run, step, saver)
            if comm.rank() == 0:
                logger.error("rollout step %d cannot train; %s", step + 1, kept)
            raise
        done = step + 1
        problem = guard.check(row)
        if problem or done % train_cfg.log_every == 0 or done == train_cfg.max_steps \
                or "skipped_rollout" in row:
            run.metrics.write(row)
        if problem and guard.must_abort():
            _abort_nonfinite(run, step, row, problem, saver)
        if problem:
            logger.warning("%s; skipped (%d in a row, train.max_skipped_steps=%d)", problem,
                           guard.in_a_row, train_cfg.max_skipped_steps)
        if progress is not None:
            if "loss" in row:
                progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            progress.update(1)
        if run.publisher is not None:
            _publish_boundary(run, done, watchdog, saver)
        if train_cfg.eval_every and (done % train_cfg.eval_every == 0 or done == train_cfg.max_steps):
            with watchdog.watch(f"evaluation after step {done}"):
                eval_row = evaluation_row(run, done)
            run.metrics.write(eval_row)
            logger.info("step %d: %s", done, ", ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in eval_row.items() if k != "step"))
        if train_cfg.save_every and done % train_cfg.save_every == 0:
            saver.save(done)
        signum = stop.agreed()
        if signum:
            saver.save(done)
            logger.warning("stopped on a signal after step %d; resume with train.resume=true",
                           done)
            raise StopRequested(signum, done)
