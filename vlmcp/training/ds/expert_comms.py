"""The expert all-to-all's bytes and seconds per optimizer step (`parallel.ep_size` > 1), from
DeepSpeed's comms logger.

AutoEP moves tokens with `deepspeed.comm.all_to_all_single` (`_AllToAllV` and
`_split_plan_from_expert_counts` in deepspeed/module_inject/auto_ep_layer.py), which DeepSpeed's
`@timed_op` wraps. With a `comms_logger` section in the DeepSpeed config, each profiled call is
timed and its size recorded (DeepSpeed 0.19.8, deepspeed/comm/comm.py, utils/comms_logging.py):

    comms_logger.comms_dict   {record name: {message bytes: [calls, [latency ms], [algbw], [busbw]]}}
    record name               "all_to_all_single" ("all_to_all_single | [Caller Func: f]" with
                              the section's `debug`)
    message bytes             the call's *input* tensor: what this rank sends, its own rows too
    timers(record name)       deepspeed.comm.comm's timer of the record: every call's wall time

What the calls are, per MoE layer and forward, on each EP rank: the count exchange (its tokens per
expert, [E] int32), the dispatch (the rows it routed, [T_local x K, H]) and the combine (the rows
its experts computed for the group); in backward the reverse of the combine and of the dispatch
(the same sizes); a recompute in backward (activation checkpointing) runs the forward's three
again. Over an EP group, each of the four row transfers moves the group's T x K rows x H x the
activation's element size.

The seconds come from the timer, not from the record's latencies: `timed_op` appends
`timers(name).elapsed(reset=False)`, the timer's running total since its last reset, so the
latency list holds running sums, not per-call times (four calls of 0.83, 0.31, 0.71 and 2.10 ms
are recorded as 0.83, 1.15, 1.86, 3.95), and an unreset timer sums every past call on every call.
The timer, read and reset here every step, holds the step's sum. Other DeepSpeed callers of the
op (ZeRO's checkpoint repartition, its Muon exchange) do not run within a vlmcp step.

Per step, the training loop calls `restart_expert_a2a` as the step starts and `expert_a2a_row` after
it: the bytes are the traffic the step's micro-batches made, a repeated pack of weight 0 (one that
only keeps a rank's collectives in step) included, as it runs its all-to-alls.

Cost, while the logger is enabled: DeepSpeed synchronizes the device after *every* collective that
goes through deepspeed.comm, profiled or not (`get_accelerator().synchronize()` in `timed_op`),
ZeRO's gradient reductions and parameter gathers included, which so no longer overlap compute;
plus a host clock (CPU) or a pair of device events per profiled call. vlmcp's own collectives
(Ulysses, the metric sums: parallel/comm.py) use torch.distributed and are neither timed nor synced.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vlmcp.parallel import comm
from vlmcp.training.ds.edits import ABSENT, DeepSpeedEdits, shown

logger = logging.getLogger(__name__)

#: The deepspeed.comm op AutoEP's all-to-alls are recorded under.
EXPERT_OP = "all_to_all_single"

#: The section vlmcp writes when the job's DeepSpeed config has none: the expert all-to-all only.
_SECTION: dict[str, Any] = {"enabled": True, "prof_all": False, "prof_ops": [EXPERT_OP],
                            "verbose": False, "debug": False}

#: The row keys, None where the comms logger does not record the op (turned off by the user).
ROW_KEYS = ("expert_a2a_bytes", "expert_a2a_s")


def fill_comms_logger(config: dict[str, Any], ep_size: int, edits: DeepSpeedEdits,
                      on_cuda: bool) -> None:
    """Fill the DeepSpeed config's `comms_logger` section for `parallel.ep_size` = `ep_size`.

    At ep_size 1 the section is left as it is. Above: a missing section becomes `_SECTION`
    (logged) on a CPU, where a collective is synchronous anyway; on CUDA (`on_cuda`) it stays
    missing, logged, since the logger's device synchronisation after every collective would cost
    ZeRO its overlap of communication with compute: the rows' expert_a2a_bytes and expert_a2a_s
    are then null, and a section in the job's DeepSpeed config turns them on (measured on GPUs:
    not yet). A user's section is kept as written and read, unless it says `enabled: false` (the
    way to turn the metric and its device syncs off): then it is removed, logged, because
    DeepSpeed 0.19.8 turns its logger on whenever the section is present, whatever `enabled`
    says. A section that is on but records no `all_to_all_single` (`prof_all` false and the op
    not in `prof_ops`) is a problem: it would sync the device after every collective and still
    give no metric.
    """
    if ep_size == 1:
        return
    section = config.get("comms_logger", ABSENT)
    if section is ABSENT and on_cuda:
        logger.info("parallel.ep_size > 1 on CUDA: no DeepSpeed comms_logger (it syncs the device "
                    "after every collective); the rows' expert_a2a_bytes and expert_a2a_s are "
                    "null; a comms_logger section in the DeepSpeed config records them")
        return
    if section is ABSENT:
        edits.set(config, "comms_logger", dict(_SECTION),
                  "parallel.ep_size > 1: the rows' expert_a2a_bytes and expert_a2a_s")
        return
    if not isinstance(section, dict):
        edits.problem("config key 'deepspeed.comms_logger': expected an object")
        return
    if section.get("enabled", True) is False:
        edits.remove(config, "comms_logger", "enabled: false, and DeepSpeed turns its logger on "
                     "whenever the section is present; the rows' expert_a2a_bytes and "
                     "expert_a2a_s are null")
        return
    prof_ops = section.get("prof_ops") or []
    if section.get("prof_all", True) is False and EXPERT_OP not in prof_ops:
        edits.problem(f"config key 'deepspeed.comms_logger.prof_ops': {shown(prof_ops)} with "
                      f"prof_all false records no {EXPERT_OP}, the expert all-to-all the rows' "
                      f"expert_a2a_bytes and expert_a2a_s need, yet syncs the device after every "
                      f"collective; add \"{EXPERT_OP}\" to prof_ops, or set enabled: false")


def _take_local() -> tuple[float, float] | None:
    """(bytes sent, seconds) of this rank's expert all-to-alls since the last call, their records
    deleted and timers reset (other ops' records stay); None when the comms logger does not
    record the op."""
    from deepspeed.comm import comm as ds_comm

    logged = ds_comm.comms_logger
    if not (logged.enabled and (logged.prof_all or EXPERT_OP in logged.prof_ops)):
        return None
    sent, ms = 0.0, 0.0
    names = [name for name in logged.comms_dict
             if name == EXPERT_OP or name.startswith(f"{EXPERT_OP} |")]
    for name in names:
        sent += sum(size * record[0] for size, record in logged.comms_dict.pop(name).items())
        ms += ds_comm.timers(name).elapsed(reset=True)
    return sent, ms / 1000.0


def restart_expert_a2a() -> None:
    """Drop this rank's expert all-to-all records so far (an evaluation's or a scoring pass's
    between steps), so that the next `expert_a2a_row` covers what runs from now; no collective."""
    _take_local()


def expert_a2a_row() -> dict[str, Any]:
    """The training row's expert all-to-all entries since the last call (every rank calls it
    together, one all-reduce of [1 + W] float64): `expert_a2a_bytes`, the bytes every rank sent
    summed over the world (each byte once, by its sender), and `expert_a2a_s`, the largest of the
    ranks' summed seconds (a collective lasts as long as its slowest rank; a sum over ranks would
    count one wait W times). Both None when the comms logger does not record the op (the same
    DeepSpeed config on every rank: then no rank reduces)."""
    local = _take_local()
    if local is None:
        return dict.fromkeys(ROW_KEYS)
    world = torch.zeros(1 + comm.world_size(), dtype=torch.float64)
    world[0] = local[0]
    world[1 + comm.rank()] = local[1]
    comm.all_reduce_sum(world)
    return {"expert_a2a_bytes": int(world[0]), "expert_a2a_s": float(world[1:].max())}
