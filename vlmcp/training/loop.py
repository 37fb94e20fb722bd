"""`vlmcp train`: one job, every rank, from process-group start to the exported model.

Per optimizer step, each rank runs `train.grad_accum` packed micro-batches of data.train
(training/steps/step_packs.py), or as many as rollout step N packs into (`rollouts.dir`,
training/steps/rollout_steps.py, whose wait for the step lies outside the watchdog); every rank of a
sequence-parallel group gets the same pack and shards it internally. The step's loss is the sum
of target-token cross-entropy over all micro-batches and ranks / the number of those targets (or
the `loss` section's objective and normaliser, training/objective_step.py); each micro-batch's
shard loss is scaled so that DeepSpeed's averaging and accumulation yield
exactly that gradient, and the loop marks the last micro-batch as the accumulation boundary. A
micro-batch of weight 0 (a repeated pack that only keeps a short DP rank's collectives in step)
adds nothing. DeepSpeed clips, steps the optimizer and the LR schedule at the boundary. The
step's normalisers come before its first micro-batch loads (from the loaded packs of a data.train
step, from the length index of a rollout step, whose packs stream), and the ranks agree before
every micro-batch that each could load it, so a pack that fails on one rank stops every rank.

After each step, the ranks first agree on a stop signal (training/signals.py): a stopped run
checkpoints and exits before anything optional. Then, with `publish.dir`, the weights are
published after every `publish.every`-th step (training/weights/publish.py), a background write
checked at every step boundary and waited for after the step loop, whichever publish started it (so
a resumed run with no step left still finishes the publish of its start step); on a stop it gets
at most publish.stop_wait_s, after the stop checkpoint; after an error every rank raised
together (`AGREED_ERRORS`) it is finished, after the checkpoint, rather than abandoned. The next
optimizer step first waits until a background publish's copy of the weights is complete
(`Publisher.fence`); a failed publish checkpoints the trained steps before it raises, and a
resumed run publishes its start step first when that step is due and not in publish.dir (so
every trained step that is due gets published, by its run or the resumed one). The publisher's
rows are written in one agreement however many each rank holds (`_write_rows`).
Then evaluation, then the periodic checkpoint. A failure on one rank alone
where the others would wait (a metrics row rank 0 cannot write, a pack that fails to load with
any exception) is agreed (`parallel.agree.run_together`) and raised on every rank.

With `model.router_aux_loss` (MoE), each micro-batch also adds router_aux_loss_coef x its router
load-balancing loss (model.router_loss): the step's gradient is d(sum CE / N) + coef x d(mean of
the micro-batches' aux losses over DP x accumulation). The row's `loss` stays the LM loss; the
mean aux loss (without the coefficient) is reported as `router_aux_loss`.

A MoE model replays the routes its packs carry (model.router_replay); every MoE row reports
`router_replay_tokens` and `router_replay_agreement` (0 and null when nothing was replayed).
Every MoE row also reports the step's expert load over the world (model.expert_load:
`expert_load_max_over_mean` of the worst layer, its index, max and mean), and under
`parallel.ep_size` > 1 the expert all-to-all's `expert_a2a_bytes` and `expert_a2a_s`
(training/ds/expert_comms.py; null when the job's comms_logger section turns it off).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlmcp.config import JobConfig
from vlmcp.data.batch import PackedBatch
from vlmcp.data.mixture import draws_per_epoch
from vlmcp.data.pack import PackedDataset
from vlmcp.data.stream import SampleReader
from vlmcp.errors import (CheckpointError, JobError, NonFiniteError, PreflightError,
                          RolloutError)
from vlmcp.model.loss import scale_for_deepspeed
from vlmcp.model.packed import PackedVLM
from vlmcp.model.router_loss import router_objective
from vlmcp.parallel import comm
from vlmcp.parallel.agree import attempt, fail_together, run_together
from vlmcp.parallel.groups import SequenceParallel
from vlmcp.training.checkpoint import checkpoint_dir, load_latest, save_checkpoint
from vlmcp.training.ds.config import zero_stage
from vlmcp.training.ds.expert_comms import expert_a2a_row, restart_expert_a2a
from vlmcp.training.ds.expert_grads import global_grad_norm
from vlmcp.training.evaluate import eval_loss, generation_accuracy
from vlmcp.training.metrics import MetricsWriter
from vlmcp.training.nonfinite import NonFiniteGuard
from vlmcp.training.objective_step import (INITIAL_REFERENCE, objective_metrics, objective_of,
                                           step_counts)
from vlmcp.training.optim import can_veto
from vlmcp.training.preflight import Preflight
from vlmcp.training.score import score_initial_reference
from vlmcp.training.setup import build_engine, seed_everything, start_checked
from vlmcp.training.signals import (StopRequested, StopSignals, clear_stop_marker, stop_row,
                                    write_stop_marker)
from vlmcp.training.steps.rollout_steps import RolloutSteps
from vlmcp.training.steps.step_packs import StepBatches, StepPacks
from vlmcp.training.utilisation import RunUtilisation
from vlmcp.training.watchdog import Watchdog
from vlmcp.training.weights.export import save_final
from vlmcp.training.weights.hf_format import hf_key_prefixes
from vlmcp.training.weights.lora_export import save_final_adapter
from vlmcp.training.weights.publish import Publisher, published_steps

logger = logging.getLogger(__name__)

#: Errors the training loop raises on every rank together (an agreement precedes each), after
#: which the ranks can still meet: a rollout step that cannot train, a pack that fails to load,
#: a non-finite step.
AGREED_ERRORS = (RolloutError, PreflightError, NonFiniteError)


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
    #: The model FLOPs of a pack and the device's peak (the rows' model_tflops, tflops_per_s, mfu).
    utilisation: RunUtilisation
    #: Where each step's micro-batches come from: data.train, or rollouts.dir.
    step_packs: StepPacks | None = None
    rollouts: RolloutSteps | None = None
    #: Publishes the weights after steps when publish.dir or publish.engines is set.
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
                            weights=preflight.train_weights, sp_size=sp.size, sp_rank=sp.rank,
                            sp_dynamic=job.parallel.sp_dynamic)
    reader = SampleReader(index, preflight.processor, job.data.max_seq_len, job.data.truncate,
                          cache_path=str(preflight.train_index_result.path),
                          reference_logps=reference)
    return StepPacks(dataset, job.train.grad_accum, reader, objective_of(job),
                     num_workers=job.data.num_workers, prefetch_factor=job.data.prefetch_factor)


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
                          if job.publish.dir or job.publish.engines else None),
               metrics=run_together(
                   lambda: MetricsWriter(job.output_dir, enabled=comm.rank() == 0,
                                         start_step=start_step),
                   CheckpointError, f"opening {job.output_dir}/metrics.jsonl"),
               start_step=start_step, adapter=adapter,
               utilisation=RunUtilisation.of_run(job, module, engine, adapter))


def _write_row(run: Run, row: dict[str, Any]) -> None:
    """Append `row` to the metrics (rank 0 writes; call on every rank): a write that fails
    raises CheckpointError on every rank."""
    run_together(lambda: run.metrics.write(row), CheckpointError,
                 f"writing step {row.get('step')}'s row to {run.metrics.path}")


def _write_rows(run: Run, rows: list[dict[str, Any]]) -> None:
    """Append rank 0's `rows` to the metrics in one agreement (call on every rank): the ranks
    meet once however many rows each holds, so a row known on rank 0 alone (a publish it saw
    complete) never puts their collectives out of step. A write that fails raises
    CheckpointError on every rank."""
    def write() -> None:
        for row in rows:
            run.metrics.write(row)

    steps = ", ".join(str(row.get("step")) for row in rows) or "no"
    run_together(write, CheckpointError, f"writing the rows of step(s) {steps} to "
                 f"{run.metrics.path}")


def _step_batches(run: Run, step: int) -> StepBatches:
    """This rank's micro-batches of `step`. A rollout step agrees itself (its index comes from
    rank 0; its packs load as the step runs them); a data.train step's packs load here, and every
    rank stops together when any rank cannot load them (whatever it raised)."""
    if run.rollouts is not None:
        return run.rollouts.step_batches(step)
    return run_together(lambda: run.step_packs.step_batches(step), PreflightError,
                        f"loading the packs of step {step + 1}")


def _named_samples(ids: list[str]) -> str:
    """The samples of a pack, for an error line: the first few and a count."""
    shown = ", ".join(ids[:4])
    return f"{shown} and {len(ids) - 4} more" if len(ids) > 4 else shown


def _next_batch(fetched: StepBatches, step: int, index: int) -> PackedBatch:
    """Micro-batch `index` of the step, loaded now (call on every rank): every rank raises
    PreflightError when any rank's pack failed to load, whatever it raised."""
    return run_together(lambda: next(fetched.batches), PreflightError,
                        f"loading the packs of step {step + 1} (micro-batch {index + 1}, samples "
                        f"{_named_samples(fetched.sample_ids[index])})")


def _plain_fp32_engine(engine: Any) -> bool:
    """ZeRO-0 in fp32: DeepSpeed clips there without keeping the norm, so vlmcp measures it."""
    return not (engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


#: Entries of a training step's summed row values before the objective's metric sums.
_STATS = 9


def train_step(run: Run, step: int) -> dict[str, Any]:
    """Run optimizer step `step` (0-based); returns its metrics row."""
    started = time.perf_counter()
    engine, sp, grad_accum = run.engine, run.sp, run.job.train.grad_accum
    if run.job.parallel.ep_size > 1:
        restart_expert_a2a()  # an evaluation's all-to-alls are not the step's
    fetched = _step_batches(run, step)
    if fetched.skip:
        return {"step": step + 1, "skipped_rollout": fetched.skip, **fetched.row}
    lr = engine.get_lr()[0]
    objective = run.module.objective
    counts = step_counts(fetched.counts, objective)
    # DeepSpeed divides each backward by its accumulation steps and averages over DP: the router
    # term of a micro-batch, scaled so, adds up to the mean over the step's micro-batches.
    router_scale = sp.dp_size * grad_accum / max(fetched.micro_batches, 1)
    # [shard loss sum, pack tokens (once per pack), 1 where the optimizer step was not applied,
    # this rank's shares of the router aux losses, the packs' model FLOPs (once per pack), packs
    # and tokens of SP degree 1, packs and tokens spread over the SP group, then the objective's
    # metric sums (Loss.stat_specs)]
    sums = torch.zeros(_STATS + len(objective.stat_specs()), dtype=torch.float64)
    grad_norm = None
    skipped_before = engine.skipped_steps
    last = len(fetched.weights) - 1
    for index, weight in enumerate(fetched.weights):
        batch = _next_batch(fetched, step, index)
        engine.set_gradient_accumulation_boundary(index == last)
        with run.module.micro_batch(batch, weight):
            loss_sum, _, router_share, stat_sums = engine(
                batch, stats=True, denominators=counts.shard_denominators)
            sums[_STATS:] += stat_sums * weight
            engine.backward(scale_for_deepspeed(loss_sum * weight, counts.denominator,
                                                dp_size=sp.dp_size, grad_accum=grad_accum)
                            + router_objective(router_share, run.module.router_aux_coef)
                            * (weight * router_scale))
        if index == last and _plain_fp32_engine(engine):
            grad_norm = global_grad_norm(engine.module)
            # DeepSpeed checks for NaN/Inf gradients itself everywhere else (training/nonfinite.py).
            if can_veto(engine.optimizer):
                engine.optimizer.overflow = not math.isfinite(grad_norm)
        if index == last and run.publisher is not None:
            run.publisher.fence()  # a background publish's copy of the weights is complete
        engine.step()
        sums[0] += float(loss_sum.detach()) * weight
        if router_share is not None:
            sums[3] += float(router_share.detach()) * weight
        if run.module.plan(batch).rank == 0:  # the pack counts once, on the rank of its first token
            sums[1] += batch.num_tokens * weight
            sums[4] += run.utilisation.pack_flops(batch) * weight
            spread = 7 if batch.sp_degree is None or batch.sp_degree == sp.size else 5
            sums[spread] += weight
            sums[spread + 1] += batch.num_tokens * weight
        del batch  # the pack's pixels go before the next pack loads
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
        **objective_metrics(sums[_STATS:], counts, objective),
        **run.utilisation.row(float(sums[4]), elapsed),
    }
    if run.job.parallel.sp_dynamic:
        row["sp_degree_packs"] = {"1": int(sums[5]), str(sp.size): int(sums[7])}
        row["sp_degree_tokens"] = {"1": int(sums[6]), str(sp.size): int(sums[8])}
    if run.module.router_loss is not None:
        row["router_aux_loss"] = float(sums[3]) / max(fetched.micro_batches, 1)
    row.update(run.module.replay_metrics())
    row.update(run.module.expert_load_metrics())
    if run.job.parallel.ep_size > 1:
        row.update(expert_a2a_row())
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
            synced=zero_stage(run.preflight.ds_config) == 3 or job.parallel.ep_size > 1)
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
    be written, CollectiveError when a collective fails (a peer rank is gone). Each watched phase
    must end within `train.collective_timeout_s`.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    if int(os.environ.get("RANK", "0")) == 0:
        clear_stop_marker(job.output_dir)
    run = start_run(job)
    timeout = job.train.collective_timeout_s
    with StopSignals() as stop, Watchdog(timeout, rank=comm.rank()) as watchdog, \
            logging_redirect_tqdm():
        try:
            _train_loop(run, stop, watchdog)
        finally:
            # Also on an error: a loader worker ignores the stop signals, so one left running
            # would hold this process's exit (multiprocessing joins it) until a SIGKILL.
            run.steps.close()
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
    ids = [sid for pack in run.steps.step_batches(step).sample_ids for sid in pack]
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
    """Before a run stops after `step` completed steps: checkpoint them (call on every rank);
    returns what was kept, for the message."""
    if step == run.start_step:
        return "no step was trained since the start, so no new checkpoint was written"
    saver.save(step)
    return (f"a checkpoint of step {step} is in {checkpoint_dir(run.job)}; continue with "
            "train.resume=true")


def _stop(run: Run, signum: int, step: int, saver: _Saver, when: str) -> None:
    """End the run on the agreed stop signal `signum` after `step` completed steps: checkpoint
    them, give a background publish in flight publish.stop_wait_s, then (rank 0) the metrics row
    and OUTPUT_DIR/stopped.json, written last, that tell a clean stop from a failure
    (training/signals.py); raises StopRequested on every rank."""
    kept = _keep_trained_steps(run, step, saver)
    if run.publisher is not None:
        # the write in flight gets publish.stop_wait_s, then is abandoned as its .tmp- directory
        _write_rows(run, run.publisher.close(run.job.publish.stop_wait_s))
    checkpoint = None if saver.saved_step != step else str(checkpoint_dir(run.job) / f"step{step}")
    _write_row(run, stop_row(signum, step, checkpoint))
    run_together(lambda: write_stop_marker(run.job.output_dir, signum, step, checkpoint)
                 if comm.rank() == 0 else None, CheckpointError,
                 f"writing the stop marker in {run.job.output_dir}")
    logger.warning("stopped on a signal %s; %s", when, kept)
    raise StopRequested(signum, step)


def _wait_for_rollout(run: Run, step: int, stop: StopSignals, watchdog: Watchdog,
                      saver: _Saver) -> None:
    """Wait for rollout step `step` + 1 (outside the watchdog's phases). A stop signal while
    waiting, or rollouts.timeout_s, ends the run after a checkpoint of the steps trained so far."""
    outcome = run.rollouts.wait(step, lambda: stop.signum, watchdog)
    if outcome.signum:
        _stop(run, outcome.signum, step, saver, f"while waiting for rollout step {step + 1}")
    if not outcome.timed_out:
        return
    kept = _keep_trained_steps(run, step, saver)
    raise RolloutError([f"{run.rollouts.timeout_problem(step, outcome.waited_s)}; {kept}"]
                       if comm.rank() == 0 else [])


def _publishing(run: Run, done: int, watchdog: Watchdog, saver: _Saver,
                actions: Callable[[list[dict[str, Any]]], None]) -> None:
    """Run the publisher's `actions` after `done` completed steps (call on every rank; they append
    the rows of the publishes that completed to the list they get) and write those rows. A failed
    publish (CheckpointError on every rank; also a background write of an earlier step) keeps
    the trained steps first, and the rows of the publishes that completed before it: the error
    says where the checkpoint of step `done` is, and when `done` is due, that the resumed run
    publishes it before it trains the next."""
    rows: list[dict[str, Any]] = []
    try:
        with watchdog.watch(f"publishing after step {done}"):
            actions(rows)
    except CheckpointError as exc:
        _write_rows(run, rows + run.publisher.unreturned_rows())
        kept = _keep_trained_steps(run, done, saver)
        if run.publisher.due(done):
            kept += f" (the resumed run publishes step {done} first)"
        lines = exc.problems[:-1] + [f"{exc.problems[-1]}; {kept}"] if exc.problems else []
        raise CheckpointError(lines) from exc
    _write_rows(run, rows)


def _publish_boundary(run: Run, done: int, watchdog: Watchdog, saver: _Saver) -> None:
    """After step `done` (every rank): the rows of the background writes that completed, and the
    publish of `done` when it is due."""
    publisher = run.publisher

    def actions(rows: list[dict[str, Any]]) -> None:
        rows += publisher.check()
        if publisher.due(done):
            rows += publisher.publish(done)

    _publishing(run, done, watchdog, saver, actions)


def _finish_publishing(run: Run, watchdog: Watchdog, saver: _Saver) -> None:
    """After the step loop (every rank): wait for the write in flight, whichever publish started
    it (the last step's, or a resumed run's pending one when no step was left to train), so
    that no run ends while its publish thread still holds a due step."""
    if run.publisher is not None:
        _publishing(run, run.job.train.max_steps, watchdog, saver,
                    lambda rows: rows.extend(run.publisher.close()))


def _finish_publishing_on_error(run: Run, watchdog: Watchdog, error: JobError) -> None:
    """After an error that every rank raised together (a rollout step that cannot train, a pack
    that fails to load, a non-finite step): the write in flight is healthy, so it is finished
    (every rank; within the watchdog) rather than left as a `.tmp-` directory for the resumed run
    to redo. A publish that fails now is logged beside `error`, never instead of it."""
    if run.publisher is None:
        return
    try:
        with watchdog.watch("finishing the publish in flight before stopping on an error"):
            _write_rows(run, run.publisher.close())
    except CheckpointError as exc:
        logger.error("rank %d: stopping on %s; the publish in flight failed too: %s",
                     comm.rank(), type(error).__name__, "; ".join(exc.problems) or "on another "
                     "rank")


def _publish_pending(run: Run, watchdog: Watchdog, saver: _Saver) -> None:
    """A resumed run publishes its start step first: into publish.dir when it is due there but
    not in it (the stop signal or a failed publish came before it; rank 0 looks, all agree),
    and into publish.engines always (an engine may serve a step of the stopped run's timeline
    beyond the checkpoint, or be paused half-updated by a push the stop cut short)."""
    publisher = run.publisher
    if publisher is None or not run.start_step:
        return
    write = publisher.dir_due(run.start_step)
    if write:
        found, problems = (attempt(lambda: run.start_step in published_steps(publisher.root),
                                   f"listing {publisher.root}")
                           if comm.rank() == 0 else (True, []))
        fail_together(problems, CheckpointError)
        write = comm.rank_flags(not found)[0]
    push = publisher.push is not None
    if not write and not push:
        return
    if comm.rank() == 0:
        logger.info("publishing the weights of step %d%s%s first", run.start_step,
                    " to publish.dir, which the stopped run had not" if write else "",
                    " into publish.engines" if push else "")
    _publishing(run, run.start_step, watchdog, saver,
                lambda rows: rows.extend(publisher.publish(run.start_step, write=write,
                                                           push=push)))


def _train_loop(run: Run, stop: StopSignals, watchdog: Watchdog) -> None:
    progress = _progress(run)
    try:
        _run_steps(run, stop, watchdog, progress)
    except AGREED_ERRORS as exc:
        _finish_publishing_on_error(run, watchdog, exc)
        raise
    except BaseException:
        # One rank may fail alone here: no collective, the write in flight is abandoned (a stop
        # has settled it already, in `_stop`); rank 0 still records one it saw complete.
        if run.publisher is not None:
            for row in run.publisher.unreturned_rows() + run.publisher.close(agreed=False):
                with contextlib.suppress(OSError):
                    run.metrics.write(row)
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
    _publish_pending(run, watchdog, saver)
    for step in range(run.start_step, train_cfg.max_steps):
        if run.rollouts is not None:
            _wait_for_rollout(run, step, stop, watchdog, saver)
        else:
            # a signal during the previous step's publish or evaluation, or during the start
            with watchdog.watch(f"agreeing on a stop signal before step {step + 1}"):
                signum = stop.agreed()
            if signum:
                _stop(run, signum, step, saver, f"after step {step}")
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
            _write_row(run, row)
        if problem and guard.must_abort():
            _abort_nonfinite(run, step, row, problem, saver)
        if problem:
            logger.warning("%s; skipped (%d in a row, train.max_skipped_steps=%d)", problem,
                           guard.in_a_row, train_cfg.max_skipped_steps)
        if progress is not None:
            if "loss" in row:
                progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            progress.update(1)
        # the stop comes first: a stopped run checkpoints before anything optional (the
        # agreement is a collective: a rank frozen after its step must not hang this one)
        with watchdog.watch(f"agreeing on a stop signal after step {done}"):
            signum = stop.agreed()
        if signum:
            _stop(run, signum, done, saver, f"after step {done}")
        if run.publisher is not None:
            _publish_boundary(run, done, watchdog, saver)
        if train_cfg.eval_every and (done % train_cfg.eval_every == 0 or done == train_cfg.max_steps):
            with watchdog.watch(f"evaluation after step {done}"):
                eval_row = evaluation_row(run, done)
            _write_row(run, eval_row)
            logger.info("step %d: %s", done, ", ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in eval_row.items() if k != "step"))
        if train_cfg.save_every and done % train_cfg.save_every == 0:
            saver.save(done)
    _finish_publishing(run, watchdog, saver)
