"""`vlmcp bench --compare-alst`: vlmcp's training step beside stock DeepSpeed ALST's.

Both sides train the same all-full-attention tiny Qwen3.5 (`ALST_MODEL`) on the same single
random sample of each length, with the real DeepSpeed engine (ZeRO 0, fp32, torch SGD at lr 0 so
every step sees the same weights), in fresh processes of their own (`--sp-size` ranks over gloo on CPU; one process on CUDA):
  * ALST: the loop of DeepSpeed's ALST tutorial: `UlyssesSPAttentionHF.register_with_transformers`
    (its sdpa entry replaced by the Ulysses wrapper), `UlyssesSPDataLoaderAdapter` sharding a
    DataLoader batch, the model's own forward on the shard, `loss_function` on the shard's
    logits with `shift_labels`, and the tutorial's differentiable per-shard loss aggregation
    (all_gather of losses and token counts). At SP 1 it is the plain transformers step.
  * vlmcp: `PackedVLM` on the same sample as a one-sample pack, its per-shard loss sum scaled as
    `vlmcp train` scales it.
Each repeat runs vlmcp then ALST (interleaved, so both see the same machine load); a row reports
each side's step time (slowest rank, mean over `--steps`), activation memory (peak resident set
minus the memory after the engine is built, largest rank), the losses, and the per-repeat ratios
vlmcp / ALST with their median, min and max. On CPU a row also gives each side's step CPU time
(the process CPU time of every rank summed, mean over `--steps`) and its ratios: the work a step
does, which on a loaded machine depends less than the wall time on how the OS schedules the ranks
(a rank that waits in a collective for a descheduled peer adds wall time, not CPU time).

Both sides' runs carry `model_tflops`, `tflops_per_s` and `mfu` (`vlmcp.training.utilisation`)
from one count of the model FLOPs of the sample's step (`vlmcp.model.flops`, the lm_head over the
sample's seq_len - 1 targets, the work the loss needs, although ALST's forward computes one more
row of logits), so that the two MFUs differ exactly as the step times do; the row gives each side's
median `mfu`.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmcp.bench.procs import Memory, run_fresh
from vlmcp.model.flops import step_flops
from vlmcp.parallel import comm
from vlmcp.training.utilisation import utilisation

#: The comparison model: hidden 96, 4 query heads and 1 kv head of 24, every layer full
#: attention (ALST's Ulysses attention is exact there; it has no DeltaNet support).
ALST_MODEL = {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24,
              "full_attention_interval": 1}


def _ds_config() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}


def _sample(seq_len: int, vocab: int) -> torch.Tensor:
    """The sample's token ids [seq_len] (seed 0, the same on both sides)."""
    return torch.randint(8, vocab, (seq_len,), generator=torch.Generator().manual_seed(0))


@dataclass(frozen=True)
class CompareTask:
    """One side (`side`: "vlmcp" or "alst") on every rank: `warmup` + `steps` training steps on one
    `seq_len`-token sample."""

    side: str
    model_dir: str
    seq_len: int
    sp_size: int
    steps: int
    warmup: int

    def run(self, device: torch.device) -> dict[str, Any]:
        memory = Memory(device)
        step = _alst_steps(self, device) if self.side == "alst" else _vlmcp_steps(self, device)
        gc.collect()
        model_mb = memory.current_mb()
        memory.reset_peak()
        times, cpu_times, losses = [], [], []
        for index in range(self.warmup + self.steps):
            started, cpu_started = time.perf_counter(), time.process_time()
            losses.append(step())
            if index >= self.warmup:
                times.append(time.perf_counter() - started)
                cpu_times.append(time.process_time() - cpu_started)
        mine = torch.tensor([model_mb, memory.peak_mb(), *times, *cpu_times], dtype=torch.float64)
        table = torch.zeros(comm.world_size(), mine.numel(), dtype=torch.float64)
        table[comm.rank()] = mine
        table = comm.all_reduce_sum(table)
        steps = len(times)
        row = {"side": self.side, "step_time_s": float(table[:, 2:2 + steps].max(dim=0).values.mean()),
               "activation_memory_mb": float((table[:, 1] - table[:, 0]).max()),
               "peak_memory_mb": float(table[:, 1].max()), "loss": losses[-1]}
        if device.type == "cpu":
            row["step_cpu_time_s"] = float(table[:, 2 + steps:].sum(dim=0).mean())
        return row


def _engine(model: torch.nn.Module, mpu: Any) -> Any:
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=0.0),
                                      config=_ds_config(), mpu=mpu)
    engine.train()
    return engine


def _vlmcp_steps(task: CompareTask, device: torch.device):
    """vlmcp's step as `vlmcp train` runs it; returns a callable doing one step (-> loss)."""
    from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
    from vlmcp.model.load import load_model
    from vlmcp.model.loss import scale_for_deepspeed
    from vlmcp.model.packed import PackedVLM
    from vlmcp.parallel.groups import SequenceParallel

    sp = SequenceParallel.initialize(task.sp_size)
    module = PackedVLM(load_model(task.model_dir).to(device), sp=sp)
    engine = _engine(module, sp.mpu)
    ids = _sample(task.seq_len, module.hf_model.config.text_config.vocab_size)
    positions = torch.arange(task.seq_len).expand(3, -1)
    batch = PackedBatch(input_ids=ids, targets=torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])]),
                        position_ids=positions, mm_token_type_ids=torch.zeros_like(ids),
                        seq_lens=[task.seq_len])
    targets = task.seq_len - 1

    def step() -> float:
        loss_sum, _, _ = engine(batch)
        engine.backward(scale_for_deepspeed(loss_sum, targets, sp.dp_size, 1))
        engine.step()
        return float(comm.all_reduce_sum(loss_sum.detach().clone(), sp.group)) / targets

    return step


def _alst_steps(task: CompareTask, device: torch.device):
    """The ALST tutorial's step; returns a callable doing one step (-> loss)."""
    import torch.distributed.nn.functional as dist_fn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from torch.utils.data import DataLoader

    from vlmcp.model.load import load_model

    model = load_model(task.model_dir).to(device)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=task.sp_size,
        micro_batch_size=1, seq_length_is_variable=True)
    engine = _engine(model, mpu)
    ids = _sample(task.seq_len, model.config.text_config.vocab_size)
    sample = {"input_ids": ids, "position_ids": torch.arange(task.seq_len), "labels": ids.clone()}
    loader = DataLoader([sample], batch_size=1)
    vocab = model.config.text_config.vocab_size
    if mpu is None:
        def batches():
            while True:
                yield from loader
    else:
        sp_group = mpu.get_sequence_parallel_group()
        sp_world, sp_rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()

        def batches():
            while True:
                yield from UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group,
                                                      sp_world_size=sp_world, device=device)
    stream = batches()

    def step() -> float:
        batch = next(stream)
        if mpu is None:  # the adapter below moves its shards to the device; here nothing does
            loss = engine(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
        else:
            shift_labels = batch["shift_labels"]
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                            use_cache=False).logits
            loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                               vocab_size=vocab)
            losses = dist_fn.all_gather(loss, group=sp_group)
            good = (shift_labels != -100).view(-1).sum()
            goods = dist_fn.all_gather(good, group=sp_group)
            loss = sum(losses[r] * goods[r] for r in range(sp_world)) / max(sum(goods), 1)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step


def compare_alst(model_dir: str, seq_lens: list[int], sp_size: int, steps: int, warmup: int,
                 repeats: int, device: str = "cpu", peak_tflops: float | None = None) -> list[dict[str, Any]]:
    """Per length, `repeats` interleaved pairs of fresh-process runs (vlmcp, then ALST) on `device`
    ("cuda": one process, SP 1); the rows. `peak_tflops`: the device's peak, for the mfu."""
    from vlmcp.model.load import load_config

    config = load_config(model_dir)
    rows = []
    for seq_len in seq_lens:
        flops = step_flops(config, [seq_len], lm_head_tokens=seq_len - 1).total
        runs: dict[str, list[dict[str, Any]]] = {"vlmcp": [], "alst": []}
        for _ in range(repeats):
            for side in ("vlmcp", "alst"):
                task = CompareTask(side, model_dir, seq_len, sp_size, steps, warmup)
                # always through vlmcp's process-group start (also at SP 1), which keeps DeepSpeed
                # from JIT-building its CPU shm comm op in every fresh process
                run = run_fresh(task, sp_size, distributed=True, device=device)
                runs[side].append({**run, **utilisation(flops, run["step_time_s"], sp_size, peak_tflops)})
        time_ratios = [v["step_time_s"] / a["step_time_s"] for v, a in zip(runs["vlmcp"], runs["alst"])]
        memory_ratios = [v["activation_memory_mb"] / a["activation_memory_mb"]
                         for v, a in zip(runs["vlmcp"], runs["alst"])]
        row = {"seq_len": seq_len, "sp_size": sp_size, "repeats": repeats,
               "vlmcp": runs["vlmcp"], "alst": runs["alst"],
               "step_time_ratio": _spread(time_ratios), "activation_memory_ratio": _spread(memory_ratios),
               "loss_rel_diff": abs(runs["vlmcp"][-1]["loss"] - runs["alst"][-1]["loss"])
               / abs(runs["alst"][-1]["loss"]), "model_tflops": flops / 1e12,
               "mfu": {side: _median_or_none([run["mfu"] for run in runs[side]]) for side in runs}}
        if device == "cpu":
            row["step_cpu_time_ratio"] = _spread([v["step_cpu_time_s"] / a["step_cpu_time_s"]
                                                  for v, a in zip(runs["vlmcp"], runs["alst"])])
        rows.append(row)
    return rows


def _median_or_none(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(values)


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "each": values}


def build_compare_model(scratch: str, vocab_size: int) -> str:
    """The all-attention tiny checkpoint of the comparison under `scratch`."""
    from vlmcp.model.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(Path(scratch, "alst-model"), tokenizer=False, vocab_size=vocab_size,
                                     **ALST_MODEL))
