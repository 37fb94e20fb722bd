"""Visible expert load (docs/expert-parallelism.md "Visible load"): a MoE training row's expert
load is the tokens each layer's experts received in the step over the world, each forward counted
once (activation checkpointing's recompute adds nothing), replayed routes as replayed, with EP 1
(transformers' router) and EP 2 (AutoEP's); under EP its expert all-to-all bytes are exactly what
the step's rows imply and its seconds are measured; the DeepSpeed config's `comms_logger` section
is filled for it, a user's honoured, turned off or refused; `vlmcp train` writes the keys.

The engine cases run the real DeepSpeed engine over gloo (tests/helpers/sp_cases.engine_step).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import assert_ok, run_vlmcp, tiny_job, write_job
from tests.helpers.parity import build_model, make_sample, pack
from tests.helpers.sp_cases import engine_step
from vlmcp.config import job_from_dict
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.data.routes import RouteSpec, pack_routes, parse_routes
from vlmcp.errors import ConfigError
from vlmcp.model.expert_load import load_row
from vlmcp.model.loss import DEFAULT_LOSS_CHUNK_MB
from vlmcp.training.ds.config import fill_deepspeed_config, load_deepspeed_config
from vlmcp.training.ds.edits import DeepSpeedEdits
from vlmcp.training.ds.expert_comms import fill_comms_logger

SPEC = RouteSpec(layers=4, top_k=2, num_experts=4)
WORLD = 2
#: One pack per rank: (length, image grids) per sample; no shard padding at SP 1.
PACKS = [[(17, []), (12, [(1, 4, 4)])], [(21, []), (9, [])]]
#: The MoE layer whose routes send every token to experts 0 and 1 (EP rank 0's at EP 2): the worst.
WORST = 2


def designed_routes(length: int) -> torch.Tensor:
    """A sample's routes [T, 4, 2] long, token t of the sample: layer 0 {t%4, (t+1)%4} (about
    balanced), layer 1 {0, 1} for three tokens in four and {2, 3} for the fourth (max / mean about
    1.5), layer 2 {0, 1} for every token (2.0, the most K=2 of E=4 can be), layer 3 {t%2, 2+t%2}."""
    t = torch.arange(length)
    quarter = (t % 4 == 3).long() * 2
    layers = [torch.stack([t % 4, (t + 1) % 4], -1), torch.stack([quarter, quarter + 1], -1),
              torch.stack([t % 2, 1 - t % 2], -1), torch.stack([t % 2, 2 + t % 2], -1)]
    return torch.stack(layers, dim=1)


def expected_load(routes: list[torch.Tensor]) -> torch.Tensor:
    """The world's tokens per expert [4, E] float64 that `routes` dictate."""
    load = torch.zeros(SPEC.layers, SPEC.num_experts, dtype=torch.float64)
    for sample in routes:
        for layer in range(SPEC.layers):
            load[layer] += torch.bincount(sample[:, layer].reshape(-1), minlength=SPEC.num_experts)
    return load


@functools.cache
def _engine_results(tmp_root) -> tuple[dict, list, int]:
    """(each rank's results by case, every sample's routes, hidden size): EP 1 and EP 2 over the
    same replayed packs, gradient checkpointing on, ZeRO 2."""
    model = build_model(moe=True)
    checkpoint = tmp_root / "tiny_moe"
    model.save_pretrained(checkpoint)
    gen = torch.Generator().manual_seed(31)
    per_rank = [[make_sample(gen, model.config, n, grids) for n, grids in layout] for layout in PACKS]
    routes = [[designed_routes(len(s.input_ids)) for s in samples] for samples in per_rank]

    def batch_of(rank: int):
        batch = pack(per_rank[rank], model)
        batch.routes = pack_routes([parse_routes(r.tolist(), len(s.input_ids), SPEC, f"r{rank}:{i}")
                                    for i, (s, r) in enumerate(zip(per_rank[rank], routes[rank]))],
                                   batch.seq_lens)
        return batch

    case = dict(checkpoint=str(checkpoint), stage=2, mode="state", grad_accum=1,
                loss_chunk_mb=DEFAULT_LOSS_CHUNK_MB, checkpointing=True,
                packs=[[batch_of(rank)] for rank in range(WORLD)])
    cases = {"ep1": {**case, "ep": 1}, "ep2": {**case, "ep": 2}}
    results = run_ranks(engine_step, WORLD, 1, cases)
    return results, [r for rank in routes for r in rank], model.config.text_config.hidden_size


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("expert_load")


def test_the_load_row_reports_the_worst_layers_max_over_mean_its_index_max_and_mean():
    load = torch.tensor([[3.0, 3.0, 3.0, 3.0], [6.0, 2.0, 2.0, 2.0], [0.0, 0.0, 9.0, 3.0]])
    assert load_row(load) == {"expert_load_max_over_mean": 3.0, "expert_load_layer": 2,
                              "expert_load_max": 9, "expert_load_mean": 3.0}
    assert load_row(torch.zeros(3, 4)) == dict.fromkeys(load_row(load))


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["ep1", "ep2"])
def test_the_steps_expert_load_is_what_the_routes_dictate_counted_once_under_checkpointing(
        name, tmp_root):
    """Every rank's row: the world's tokens per expert that the replayed routes dictate, the worst
    layer (every token to experts 0 and 1) found, its mean = the world's tokens x K / E (a counted
    recompute would double it), with transformers' router (EP 1) and AutoEP's (EP 2)."""
    results, routes, _ = _engine_results(tmp_root)
    expected = load_row(expected_load(routes))
    tokens = sum(len(r) for r in routes)
    assert expected["expert_load_layer"] == WORST
    assert expected["expert_load_max_over_mean"] == 2.0
    assert expected["expert_load_max"] == tokens
    assert expected["expert_load_mean"] == tokens * SPEC.top_k / SPEC.num_experts
    for rank in range(WORLD):
        assert results[rank][name]["expert_load"] == expected
        assert results[rank][name]["replay"]["router_replay_tokens"] == tokens * SPEC.layers


@pytest.mark.e2e
def test_under_ep2_the_expert_all_to_all_bytes_are_the_steps_rows_and_counts_and_take_time(tmp_root):
    """Per MoE layer, over the world: each forward (the step's and checkpointing's recompute) sends
    every rank's [E] int32 tokens per expert, then the T x K routed rows [T*K, H] fp32 out
    (dispatch) and back (combine); backward sends both row transfers once more, reversed."""
    results, routes, hidden = _engine_results(tmp_root)
    rows = sum(len(r) for r in routes) * SPEC.top_k
    forwards = 2  # the step's forward and the recompute in backward
    per_layer = forwards * (WORLD * SPEC.num_experts * 4 + 2 * rows * hidden * 4) \
        + 2 * rows * hidden * 4
    for rank in range(WORLD):
        a2a = results[rank]["ep2"]["expert_a2a"]
        assert a2a["expert_a2a_bytes"] == SPEC.layers * per_layer
        assert a2a["expert_a2a_s"] > 0
    assert results[0]["ep2"]["expert_a2a"] == results[1]["ep2"]["expert_a2a"]
    assert results[0]["ep1"]["expert_a2a"] is None


JOB = {"model": {"path": "ckpt"}, "data": {"train": "train.jsonl"}}


def _filled(raw: dict, ep_size: int = 2) -> dict:
    job = job_from_dict({**JOB, "deepspeed": raw, "parallel": {"ep_size": ep_size}})
    return fill_deepspeed_config(load_deepspeed_config(job), job, dp_size=2, hidden_size=8,
                                 moe_top_k=2)


def test_ep_turns_deepspeeds_comms_logger_on_for_the_expert_all_to_all_only():
    assert _filled({})["comms_logger"] == {"enabled": True, "prof_all": False,
                                           "prof_ops": ["all_to_all_single"], "verbose": False,
                                           "debug": False}
    assert "comms_logger" not in _filled({}, ep_size=1)


def test_on_cuda_ep_leaves_the_comms_logger_off_unless_the_config_has_one():
    """DeepSpeed's logger syncs the device after every collective: on CUDA it is the user's
    choice (the rows' expert_a2a entries are then null), a section of theirs is kept."""
    edits = DeepSpeedEdits()
    config: dict = {}
    fill_comms_logger(config, 2, edits, on_cuda=True)
    assert config == {} and not edits.problems
    mine = {"comms_logger": {"enabled": True, "prof_ops": ["all_to_all_single"]}}
    fill_comms_logger(mine, 2, edits, on_cuda=True)
    assert mine == {"comms_logger": {"enabled": True, "prof_ops": ["all_to_all_single"]}}


def test_a_users_comms_logger_is_kept_turned_off_by_enabled_false_or_refused_without_the_op():
    mine = {"enabled": True, "prof_all": True, "verbose": True}
    assert _filled({"comms_logger": mine})["comms_logger"] == mine
    # DeepSpeed 0.19.8 logs whenever the section exists, whatever `enabled` says: it goes
    assert "comms_logger" not in _filled({"comms_logger": {"enabled": False}})
    with pytest.raises(ConfigError) as caught:
        _filled({"comms_logger": {"prof_all": False, "prof_ops": ["all_reduce"]}})
    assert len(caught.value.problems) == 1
    assert "deepspeed.comms_logger.prof_ops" in caught.value.problems[0]
    assert "all_to_all_single" in caught.value.problems[0]


@pytest.mark.e2e
def test_vlmcp_train_at_ep2_writes_the_expert_load_and_all_to_all_keys(tiny_moe_checkpoint,
                                                                        tmp_path):
    """`vlmcp train` over torchrun, world 2, parallel.ep_size 2: the step's row carries the load
    (its mean the step's tokens x K / E) and the all-to-all's exact bytes (no recompute) and
    seconds."""
    gen = torch.Generator().manual_seed(6)
    records = []
    for n in (19, 26, 11, 30):
        ids = torch.randint(10, 400, (n,), generator=gen).tolist()
        records.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 4 + ids[4:]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = tiny_job(tiny_moe_checkpoint, data, tmp_path / "out", train={"max_steps": 1},
                   parallel={"ep_size": 2}, deepspeed={"zero_optimization": {"stage": 2}},
                   data={"cache_dir": str(tmp_path / "cache"), "max_seq_len": 96})
    assert_ok(run_vlmcp(["train", str(write_job(tmp_path / "job.json", job))],
                        launcher="torchrun", nproc=WORLD))
    config = json.loads((tiny_moe_checkpoint / "config.json").read_text())["text_config"]
    rows = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "loss" in r)
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    assert row["expert_load_mean"] == row["tokens"] * top_k / experts
    assert 1.0 <= row["expert_load_max_over_mean"] <= experts / top_k
    assert 0 <= row["expert_load_layer"] < config["num_hidden_layers"]
    per_layer = WORLD * experts * 4 + 4 * row["tokens"] * top_k * config["hidden_size"] * 4
    assert row["expert_a2a_bytes"] == config["num_hidden_layers"] * per_layer
    assert row["expert_a2a_s"] > 0
