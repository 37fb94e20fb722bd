"""`vlmcp bench --ep-size E`: expert parallelism against ZeRO without it, on an expert-heavy MoE.

World `--ep-world` W, default 2 (fresh rank processes over gloo, one thread each), DP W, SP 1,
one `--seq-lens` pack of random text per rank, fp32, torch AdamW (so that optimizer state exists) under DeepSpeed's engine.
The model (`ep_layout`) is Qwen3.5-35B-A3B's MoE layout cut to a CPU: 64 routed experts, top 8,
a shared expert, expert width a quarter of the hidden size, 3 DeltaNet layers then one attention
layer; the report gives its numbers and the routed experts' share of the parameters. The ways
(`WAYS`), each in a fresh world of its own, one after the other:

    zero3         vlmcp's PackedVLM, ZeRO 3, no EP: every rank gathers each layer's experts
    zero2         vlmcp's PackedVLM, ZeRO 2, no EP: the reference of the expert-state ratio
    ep_zero2      vlmcp's PackedVLM, ZeRO 2, `parallel.ep_size` E (DeepSpeed's AutoEP)
    autoep_alone  transformers' own model and forward, ZeRO 2, DeepSpeed's AutoEP at E, with no
                  vlmcp module: tried as `AUTOEP_ATTEMPTS` says until one runs; the error of each
                  attempt that cannot run is kept (`failed_attempts`)

Per way: `--warmup` untimed steps, then `--repeats` timed steps (forward + backward + optimizer
step; the slowest rank's wall time each), giving min / median / max of `step_time_s`, and at the
median `tokens_per_s` (both ranks' tokens) and `mfu` (vlmcp.model.flops; the CPU peak measured on
the model's GEMM shapes, one thread). `phase_s`: the median forward, backward and optimizer-step
seconds (slowest rank). `step_cpu_s`: both ranks' process CPU seconds a step (median), which a
loaded machine disturbs less than wall time.

Memory per rank, read after one more, untimed step (`probe`):
  * `expert_bytes`: the routed experts' parameters, gradients, fp32 master copy and AdamW state
    as the rank holds them: parameters at their size in the module (ZeRO 2 keeps them whole,
    ZeRO 3 keeps the rank's partition `ds_tensor`); gradients, master and state over the elements
    of the experts that lie in this rank's optimizer partition (ZeRO 2: each parameter's
    `_hp_mapping` fragment; ZeRO 3: its `ds_tensor`), at the master partition's dtype for the
    gradient and master and at the optimizer state's own tensors' dtypes (exp_avg, exp_avg_sq);
  * `peak_rss_mb`: the resident set's peak (VmHWM) over the warmup and timed steps, reset after
    the engine is built (`model_rss_mb`: the resident set then; `process_rss_mb`: before the
    model loads, torch and DeepSpeed imported, the part of every peak that no way changes);
    `peak_above_process_mb`: the peak less `process_rss_mb`, the part a GPU's allocator would
    count (the interpreter and the libraries' code are not device memory);
  * `saved_activation_mb`: the bytes autograd saves for backward in the probe's forward (each
    storage once, parameters' storages excluded: a ZeRO 3 layer's gathered weights are
    parameters), the part of activation memory a CPU measures exactly;
  * `collective_s`: the probe step's seconds in each kind of gloo collective, per rank
    (torch.profiler), which is where ZeRO 3's gathers and EP's all-to-alls show.

`loss`: rank 0's probe-step loss as backward gets it (vlmcp: scaled as `vlmcp train` scales it).
`ratios` holds the issue's three targets with their measured values: expert state at EP E over
ZeRO 2 without EP (<= 0.55), peak resident set at EP E over ZeRO 3 without EP (<= 0.8), step time
(medians) at EP E over ZeRO 3 without EP (<= 0.8); and the peak target again on
`peak_above_process_mb`.

Why W matters (docs/expert-parallelism.md#measured): with AdamW a rank holds, per routed-expert
element, a parameter, a gradient, a master copy and two moments (5 numbers in fp32). ZeRO 2
without EP keeps the parameters whole and partitions the rest over W: 1 + 4/W; EP at E = W with
ZeRO 2 holds 1/W of the experts whole (their expert-data-parallel group is the rank alone): 5/W.
The expert-state ratio is 5 / (W + 4): 0.83 at W = 2, 0.55 at W = 5.1, 0.42 at W = 8, whatever
the model or the device. Above 2 CPU cores a larger W oversubscribes them: its step times are not
comparable, its memory figures are.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmcp.bench.jobs import scratch_folder
from vlmcp.bench.procs import Memory, run_fresh
from vlmcp.bench.saved_bytes import counting_saved_bytes
from vlmcp.parallel import comm

#: The world every way runs on unless --ep-world says, and the tokens a rank's pack holds
#: unless --seq-lens says.
DEFAULT_WORLD = 2
DEFAULT_TOKENS = 512
DEFAULT_HIDDEN = 512
#: The ways compared: (ZeRO stage, EP on, transformers' own model instead of vlmcp's module).
WAYS = {"zero3": (3, False, False), "zero2": (2, False, False), "ep_zero2": (2, True, False),
        "autoep_alone": (2, True, True)}
#: The issue's targets: (ratio name, numerator way, denominator way, measure, bound).
TARGETS = (("expert_state_ep_over_zero2", "ep_zero2", "zero2", "expert_state_bytes", 0.55),
           ("peak_rss_ep_over_zero3", "ep_zero2", "zero3", "peak_rss_mb", 0.8),
           ("step_time_ep_over_zero3", "ep_zero2", "zero3", "step_time_s", 0.8),
           ("peak_above_process_ep_over_zero3", "ep_zero2", "zero3", "peak_above_process_mb",
            0.8))
#: The real model the layout is cut from.
REAL_LAYOUT = ("Qwen3.5-35B-A3B: hidden 2048, 40 layers (3 DeltaNet then 1 attention), 256 routed "
               "experts top 8 of width 512, one shared expert of width 512, vocabulary 248320")
#: The kinds of gloo collective a probe step's seconds are sorted into.
COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "broadcast", "other")
_EXPERT = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj|w1|w2|w3|\d+\.(gate|up|down)_proj\.weight)")
#: How AutoEP alone is tried, in turn, until one runs: on the VLM with DeepSpeed's preset, on the
#: VLM with the structure named as vlmcp names it, on its text backbone (transformers'
#: Qwen3_5MoeForCausalLM, model_type "qwen3_5_moe_text", the weights copied) with the preset.
AUTOEP_ATTEMPTS = ("vlm_preset", "vlm_explicit", "text_preset")
_HF_MOE_LAYERS = r"model\.language_model\.layers\.\d+\.mlp"


def ep_layout(hidden: int, expert_width: int | None = None) -> dict[str, Any]:
    """The benched layout's `tiny_qwen3_5_config` keys at width `hidden` (expert width: a quarter
    of it unless given), heads of 64 as the hidden size allows."""
    width = expert_width or max(hidden // 4, 1)
    heads = max(hidden // 64, 1)
    return {"hidden_size": hidden, "num_hidden_layers": 4, "full_attention_interval": 4,
            "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1),
            "head_dim": 64, "linear_num_key_heads": max(heads // 2, 1),
            "linear_num_value_heads": heads, "linear_head_dim": 64, "num_experts": 64,
            "num_experts_per_tok": 8, "moe_intermediate_size": width,
            "shared_expert_intermediate_size": width}


def is_expert(name: str) -> bool:
    """A routed experts' weight: transformers' fused ones, AutoEP's grouped ones, or a
    checkpoint's per-expert ones."""
    return _EXPERT.fullmatch(name) is not None


def _ds_config(stage: int, hidden: int) -> dict[str, Any]:
    """fp32, one micro-batch a step, the ZeRO buckets `vlmcp train` fills for "auto"."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": hidden * hidden,
                                  "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                                  "stage3_param_persistence_threshold": 10 * hidden}}


@dataclass(frozen=True)
class EpTask:
    """One way on every rank of the world: build the engine, time the steps, probe."""

    way: str
    model_dir: str
    ep_size: int
    tokens: int
    warmup: int
    repeats: int
    #: AutoEP alone: which of `AUTOEP_ATTEMPTS`.
    attempt: str = ""

    def run(self, device: torch.device) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        import deepspeed  # noqa: F401 - imported before the baseline resident set is read

        stage, ep_on, plain = WAYS[self.way]
        memory = Memory(device)
        process_mb = memory.current_mb()
        why = None
        try:
            engine, step_loss = (_plain_engine if plain else _vlmcp_engine)(self, stage, ep_on)
        except Exception as error:  # noqa: BLE001 - a way that cannot run is reported, not fatal
            why = f"{type(error).__name__}: {error}"
        # every rank learns whether any could not build the way (none times steps alone)
        if any(comm.rank_flags(why is not None)):
            return {"ran": False, "why": why or "it could not run on another rank"}
        gc.collect()
        model_mb = memory.current_mb()
        memory.reset_peak()
        phases: list[list[float]] = []
        for index in range(self.warmup + self.repeats):
            started, cpu_started = time.perf_counter(), time.process_time()
            loss = step_loss()
            forward_end = time.perf_counter()
            engine.backward(loss)
            backward_end = time.perf_counter()
            engine.step()
            ended = time.perf_counter()
            if index >= self.warmup:
                phases.append([ended - started, forward_end - started, backward_end - forward_end,
                               ended - backward_end, time.process_time() - cpu_started])
        peak_mb = memory.peak_mb()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            with counting_saved_bytes(engine.module) as saved:
                loss = step_loss()
            engine.backward(loss)
            engine.step()
        expert = _expert_bytes(engine)
        collectives = _collective_seconds(profiled)
        mine = [process_mb, model_mb, peak_mb, saved.total, *expert.values(), *collectives.values(),
                *(v for step in phases for v in step)]
        table = torch.zeros(comm.world_size(), len(mine), dtype=torch.float64)
        table[comm.rank()] = torch.tensor(mine, dtype=torch.float64)
        table = comm.all_reduce_sum(table)
        return _row(table, list(expert), list(collectives), len(phases), float(loss.detach()))


def _row(table: torch.Tensor, expert_keys: list[str], collective_keys: list[str], steps: int,
         loss: float) -> dict[str, Any]:
    """A way's row from every rank's numbers (rows of `table`, as `EpTask.run` lays them out)."""
    ranks = table.tolist()
    start = 4 + len(expert_keys) + len(collective_keys)
    timed = table[:, start:].reshape(table.shape[0], steps, 5)
    slowest = timed[:, :, :4].max(dim=0).values  # per step: wall, forward, backward, optimizer
    times = slowest[:, 0].tolist()
    per_rank = [{"rank": r, "process_rss_mb": round(row[0], 1), "model_rss_mb": round(row[1], 1),
                 "peak_rss_mb": round(row[2], 1), "saved_activation_mb": round(row[3] / 2**20, 2),
                 "expert_bytes": {k: int(v) for k, v in zip(expert_keys, row[4:])},
                 "collective_s": {k: round(v, 4) for k, v in zip(collective_keys,
                                                                 row[4 + len(expert_keys):])}}
                for r, row in enumerate(ranks)]
    return {"ran": True, "step_time_s": _spread(times),
            "phase_s": {name: statistics.median(slowest[:, i].tolist())
                        for i, name in enumerate(("forward", "backward", "optimizer"), start=1)},
            "step_cpu_s": statistics.median(timed[:, :, 4].sum(dim=0).tolist()),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
            "peak_above_process_mb": round(max(r["peak_rss_mb"] - r["process_rss_mb"]
                                               for r in per_rank), 1),
            "expert_state_bytes": max(r["expert_bytes"]["total"] for r in per_rank),
            "loss": loss, "per_rank": per_rank}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "each": values}


def _tokens(task: EpTask, vocab: int) -> torch.Tensor:
    """This rank's pack: `task.tokens` random ids, seeded by rank (the same for every way)."""
    generator = torch.Generator().manual_seed(comm.rank())
    return torch.randint(8, vocab, (task.tokens,), generator=generator)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5)


def _vlmcp_engine(task: EpTask, stage: int, ep_on: bool) -> tuple[Any, Any]:
    """vlmcp's PackedVLM under DeepSpeed as `vlmcp train` builds it; (engine, a callable running
    one forward and returning the loss to backward)."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    from vlmcp.data.batch import IGNORE_INDEX, PackedBatch
    from vlmcp.model.load import load_model
    from vlmcp.model.loss import scale_for_deepspeed
    from vlmcp.model.packed import PackedVLM
    from vlmcp.parallel.groups import SequenceParallel
    from vlmcp.training.ds.edits import DeepSpeedEdits
    from vlmcp.training.ds.expert_parallel import fill_expert_parallel, moe_optimizer_factory

    sp = SequenceParallel.initialize(1)
    hidden = _text_config(task.model_dir)["hidden_size"]
    config = _ds_config(stage, hidden)
    if ep_on:
        edits = DeepSpeedEdits()
        fill_expert_parallel(config, task.ep_size, _text_config(task.model_dir)["num_experts_per_tok"],
                             edits)
    keep_alive = HfDeepSpeedConfig(config) if stage == 3 else None  # partitioned as it loads
    module = PackedVLM(load_model(task.model_dir), sp=sp)
    optimizer = moe_optimizer_factory(_adamw) if ep_on else _adamw(
        [p for p in module.parameters() if p.requires_grad])
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, mpu=sp.mpu)
    if ep_on:
        module.adopt_expert_parallel()
    del keep_alive
    engine.train()
    ids = _tokens(task, module.hf_model.config.text_config.vocab_size)
    batch = PackedBatch(input_ids=ids, targets=torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])]),
                        position_ids=torch.arange(task.tokens).expand(3, -1),
                        mm_token_type_ids=torch.zeros_like(ids), seq_lens=[task.tokens])

    def step_loss() -> torch.Tensor:
        loss_sum, _, _ = engine(batch)
        return scale_for_deepspeed(loss_sum, task.tokens - 1, sp.dp_size, 1)

    return engine, step_loss


def _plain_engine(task: EpTask, stage: int, ep_on: bool) -> tuple[Any, Any]:
    """transformers' Qwen3.5-MoE (or its text backbone) and its own forward (labels: the mean
    loss) under DeepSpeed with AutoEP as `task.attempt` says; (engine, a callable returning the
    loss to backward)."""
    import deepspeed
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    from vlmcp.model.load import load_model
    from vlmcp.training.ds.edits import DeepSpeedEdits
    from vlmcp.training.ds.expert_parallel import fill_expert_parallel, moe_optimizer_factory

    config = _ds_config(stage, _text_config(task.model_dir)["hidden_size"])
    if task.attempt.endswith("preset"):
        config["expert_parallel"] = {"enabled": True, "autoep_size": task.ep_size,
                                     "preset_model": "qwen3_5_moe"}
    else:
        fill_expert_parallel(config, task.ep_size, _text_config(task.model_dir)["num_experts_per_tok"],
                             DeepSpeedEdits())
        config["expert_parallel"]["moe_layer_pattern"] = _HF_MOE_LAYERS
    model = load_model(task.model_dir)
    if task.attempt.startswith("text"):
        text = Qwen3_5MoeForCausalLM(model.config.text_config)
        text.model.load_state_dict(model.model.language_model.state_dict())
        text.lm_head.load_state_dict(model.lm_head.state_dict())
        model = text
    engine, *_ = deepspeed.initialize(model=model, optimizer=moe_optimizer_factory(_adamw),
                                      config=config)
    engine.train()
    ids = _tokens(task, _text_config(task.model_dir)["vocab_size"])[None]

    def step_loss() -> torch.Tensor:
        return engine(input_ids=ids, labels=ids).loss

    return engine, step_loss


def _text_config(model_dir: str) -> dict[str, Any]:
    return json.loads(Path(model_dir, "config.json").read_text())["text_config"]


def _expert_params(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad and is_expert(n)]


def _held_elements(engine: Any) -> int:
    """Elements of the routed experts in this rank's optimizer partition."""
    total = 0
    for _, param in _expert_params(engine):
        if hasattr(param, "ds_tensor"):
            total += param.ds_tensor.numel()
        elif getattr(param, "_hp_mapping", None) is not None:
            total += param._hp_mapping.hp_fragment.numel()
    return total


def _expert_bytes(engine: Any) -> dict[str, int]:
    """The routed experts' bytes on this rank: params, grads, master, optimizer_state, total."""
    held = _held_elements(engine)
    optimizer = engine.optimizer
    stage3 = hasattr(optimizer, "fp32_partitioned_groups_flat")
    flats = optimizer.fp32_partitioned_groups_flat if stage3 else optimizer.single_partition_of_fp32_groups
    master = flats[0].element_size()
    state = 0
    for flat in flats:
        values = optimizer.optimizer.state.get(flat, {}).values()
        state = max(state, sum(v.element_size() for v in values
                               if torch.is_tensor(v) and v.numel() == flat.numel()))
    params = sum((p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()) * p.element_size()
                 for _, p in _expert_params(engine))
    counts = {"params": params, "grads": held * master, "master": held * master,
              "optimizer_state": held * state}
    return {**counts, "total": sum(counts.values())}


def _collective_seconds(profiled: Any) -> dict[str, float]:
    """This rank's seconds in each kind of gloo collective (`COLLECTIVES`) of a torch.profiler
    run."""
    seconds = dict.fromkeys(COLLECTIVES, 0.0)
    for event in profiled.key_averages():
        if event.key.startswith("gloo:"):
            name = event.key.removeprefix("gloo:").replace("_", "")
            kind = next((k for k in COLLECTIVES if k.replace("_", "") in name), "other")
            seconds[kind] += event.cpu_time_total / 1e6
    return seconds


# --------------------------------------------------------------------------- the report


def flag_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the `--ep-size` flags themselves (`run_bench` adds the flags of other
    modes), one line each."""
    problems = []
    experts = ep_layout(8)["num_experts"]
    world = args.ep_world or DEFAULT_WORLD
    if world < 2:
        problems.append(f"--ep-world {world}: the bench's world needs at least 2 ranks")
    elif args.ep_size < 2 or world % args.ep_size or experts % args.ep_size:
        problems.append(f"--ep-size {args.ep_size}: the experts split over E >= 2 ranks, E dividing "
                        f"the bench's world ({world}) and its {experts} experts")
    lengths = (args.seq_lens or str(DEFAULT_TOKENS)).split(",")
    if len(lengths) != 1 or not lengths[0].strip().isdigit() or int(lengths[0]) < 2:
        problems.append(f"--ep-size takes one --seq-lens length >= 2 (tokens a rank), not "
                        f"{args.seq_lens!r}")
    if args.repeats < 1 or args.warmup < 0:
        problems.append("--ep-size needs --repeats >= 1 and --warmup >= 0")
    return problems


def _parameters(model_dir: Path) -> tuple[int, int]:
    """(parameters, routed experts' parameters) of a checkpoint, from its safetensors headers."""
    from safetensors import safe_open

    total = experts = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                numel = 1
                for size in f.get_slice(name).get_shape():
                    numel *= size
                total += numel
                experts += numel if is_expert(name) else 0
    return total, experts


def _ratios(ways: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ratios = {}
    for name, over, under, measure, bound in TARGETS:
        value = None
        if ways[over].get("ran") and ways[under].get("ran"):
            top, bottom = ways[over][measure], ways[under][measure]
            value = round((top["median"] if isinstance(top, dict) else top)
                          / (bottom["median"] if isinstance(bottom, dict) else bottom), 3)
        ratios[name] = {"value": value, "target": bound,
                        "met": None if value is None else value <= bound}
    return ratios


def _table(report: dict[str, Any]) -> str:
    """The report as a readable table (one line per way, then the ratios)."""
    lines = [f"{'way':<13} {'step s (min/med/max)':>22} {'tok/s':>7} {'mfu':>6} {'peak RSS MB':>11} "
             f"{'above process':>13} {'expert MB p/g/m/s':>23} {'saved MB':>8}"]
    for way, row in report["ways"].items():
        if not row.get("ran"):
            whys = row.get("failed_attempts") or {"": row.get("why")}
            lines += [f"{way:<13} did not run{f' ({a})' if a else ''}: {why}"
                      for a, why in whys.items()]
            continue
        spread = row["step_time_s"]
        parts = row["per_rank"][0]["expert_bytes"]
        mb = "/".join(f"{parts[k] / 2**20:.0f}" for k in ("params", "grads", "master",
                                                        "optimizer_state"))
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        lines.append(f"{way:<13} {spread['min']:>6.2f}/{spread['median']:.2f}/{spread['max']:.2f}"
                     f"{'':>7} {row['tokens_per_s']:>7.0f} {mfu:>6} {row['peak_rss_mb']:>11.0f} "
                     f"{row['peak_above_process_mb']:>13.0f} {mb:>23} "
                     f"{row['per_rank'][0]['saved_activation_mb']:>8.1f}")
    for name, ratio in report["ratios"].items():
        lines.append(f"{name}: {ratio['value']} (target <= {ratio['target']}, met: {ratio['met']})")
    return "\n".join(lines)


def run_expert_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """The `--ep-size` report (see the module docstring); prints its table."""
    from vlmcp.model.flops import gemm_shapes, step_flops
    from vlmcp.model.load import load_config
    from vlmcp.model.tiny import build_tiny_checkpoint
    from vlmcp.training.utilisation import device_peak, utilisation

    problems = flag_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    ep_size, tokens = args.ep_size, int(args.seq_lens or DEFAULT_TOKENS)
    world = args.ep_world or DEFAULT_WORLD
    layout = ep_layout(args.hidden_size or DEFAULT_HIDDEN, args.intermediate_size)
    vocab = args.vocab_size or 512
    ways: dict[str, dict[str, Any]] = {}
    with scratch_folder(args.scratch, "vlmcp-ep-bench-") as root:
        model_dir = build_tiny_checkpoint(root / "model", moe=True, tokenizer=False,
                                          vocab_size=vocab, **layout)
        config = load_config(str(model_dir))
        total, experts = _parameters(model_dir)
        peak = device_peak(torch.device("cpu"), torch.float32, gemm_shapes(config), tokens, 1)
        flops = step_flops(config, [tokens] * world, lm_head_tokens=world * (tokens - 1)).total
        for way in WAYS:
            row = run_fresh(EpTask(way, str(model_dir), ep_size, tokens, args.warmup,
                                   args.repeats), world) if way != "autoep_alone" else {}
            failed = {}
            for attempt in AUTOEP_ATTEMPTS if way == "autoep_alone" else ():
                row = {"attempt": attempt, **run_fresh(EpTask(
                    way, str(model_dir), ep_size, tokens, args.warmup, args.repeats, attempt), world)}
                if row["ran"]:
                    break
                failed[attempt] = row["why"]
            if failed:
                row["failed_attempts"] = failed
            if row["ran"]:
                median = row["step_time_s"]["median"]
                row.update(tokens_per_s=world * tokens / median,
                           **utilisation(flops, median, world, peak.tflops))
            stage, ep_on, plain = WAYS[way]
            ways[way] = {"zero_stage": stage, "ep_size": ep_size if ep_on else 1,
                         "module": "transformers" if plain else "vlmcp PackedVLM", **row}
    report = {"mode": "expert_parallel", "world": world, "sp_size": 1, "ep_size": ep_size,
              "tokens_per_rank": tokens, "warmup": args.warmup, "repeats": args.repeats,
              "dtype": "float32", "optimizer": "torch AdamW (DeepSpeed ZeRO's partitions)",
              "threads_per_rank": 1,
              "model": {"layout": {**layout, "vocab_size": vocab}, "cut_from": REAL_LAYOUT,
                        "params": total, "expert_params": experts,
                        "expert_share": round(experts / total, 4)},
              "peak_tflops": peak.tflops, "peak_source": peak.source,
              "ways": ways, "ratios": _ratios(ways)}
    print(f"routed experts: {experts:,} of {total:,} parameters ({100 * experts / total:.1f} %)")
    print(_table(report), flush=True)
    return report
