"""`vlmcp bench --ep-size`: the flags it refuses, its layout's expert share, which weights count
as routed experts, and how a way's row and the target ratios are made from the ranks' numbers
(the run itself starts 6 worlds of 2 ranks: docs/benchmarks.md has its measured table)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

from vlmcp.bench.expert_parallel import (COLLECTIVES, DEFAULT_HIDDEN, TARGETS, _ratios, _row,
                                         _table, ep_layout, is_expert)
from vlmcp.cli import build_parser, main
from vlmcp.model.tiny import tiny_qwen3_5_config


@pytest.mark.parametrize("ep_size", ["1", "3", "4"])
def test_the_ep_bench_refuses_an_ep_size_not_dividing_its_world_of_2_and_its_experts(ep_size, tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--ep-size", ep_size, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"--ep-size {ep_size}: the experts split over E >= 2 ranks, E dividing the bench's world (2)" in err
    assert not out.exists()


def test_the_ep_bench_world_must_hold_2_ranks_divide_by_e_and_belongs_to_ep_size(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--ep-size", "4", "--ep-world", "6", "--out", str(out)]) == 1
    assert "--ep-size 4: the experts split over E >= 2 ranks, E dividing the bench's world (6)" in \
        capsys.readouterr().err
    assert main(["bench", "--ep-size", "2", "--ep-world", "1", "--out", str(out)]) == 1
    assert "--ep-world 1: the bench's world needs at least 2 ranks" in capsys.readouterr().err
    assert main(["bench", "--ep-world", "8", "--out", str(out)]) == 1
    assert "--ep-world: a flag of --ep-size" in capsys.readouterr().err
    assert not out.exists()


def test_the_ep_bench_refuses_other_modes_and_step_flags_in_one_error(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--ep-size", "3", "--compare-alst", "--moe", "--sp-size", "2", "--tiled-mlp",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert "--ep-size does not use --moe, --sp-size, --tiled-mlp, --compare-alst" in err
    assert "--ep-size 3: the experts split over E >= 2 ranks" in err
    assert not out.exists()


def test_the_ep_bench_takes_one_length_of_tokens_a_rank(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--ep-size", "2", "--seq-lens", "64,128", "--out", str(out)]) == 1
    assert "--ep-size takes one --seq-lens length >= 2 (tokens a rank), not '64,128'" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "--ep-size", "2"]).ep_size == 2


def test_the_default_layout_routes_8_of_64_experts_holding_over_80_percent_of_the_parameters():
    layout = ep_layout(DEFAULT_HIDDEN)
    assert (layout["num_experts"], layout["num_experts_per_tok"]) == (64, 8)
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(tiny_qwen3_5_config(moe=True, **layout))
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in sizes.items() if is_expert(name))
    assert experts / sum(sizes.values()) >= 0.8


def test_routed_expert_weights_are_named_in_every_form_and_the_shared_expert_is_not_one():
    layer = "model.language_model.layers.3.mlp"
    for name in ("experts.gate_up_proj", "experts.down_proj", "experts.w1", "experts.w2",
                 "experts.w3", "experts.17.up_proj.weight"):
        assert is_expert(f"{layer}.{name}"), name
    for name in ("shared_expert.gate_proj.weight", "shared_expert_gate.weight", "gate.weight",
                 "router.gate.weight"):
        assert not is_expert(f"{layer}.{name}"), name


def _rank(process, model, peak, saved, expert, collective, steps):
    return [process, model, peak, saved, *expert, *collective, *(v for step in steps for v in step)]


def test_a_way_row_times_each_step_by_its_slowest_rank_and_keeps_each_ranks_memory():
    expert_keys = ["params", "grads", "master", "optimizer_state", "total"]
    collectives = [0.0] * len(COLLECTIVES)
    # per step: wall, forward, backward, optimizer, process CPU seconds
    table = torch.tensor([
        _rank(500, 900, 1500, 2**20, [4, 2, 2, 4, 12], collectives, [[2, 1, 0.5, 0.5, 1], [4, 2, 1, 1, 2]]),
        _rank(510, 910, 1600, 2**21, [4, 2, 2, 4, 12], collectives, [[3, 1, 1, 1, 1.5], [1, 1, 0, 0, 1]]),
    ], dtype=torch.float64)
    row = _row(table, expert_keys, list(COLLECTIVES), steps=2, loss=1.5)
    assert row["step_time_s"] == {"min": 3.0, "median": 3.5, "max": 4.0, "each": [3.0, 4.0]}
    assert row["phase_s"] == {"forward": 1.5, "backward": 1.0, "optimizer": 1.0}
    assert row["step_cpu_s"] == 2.75 and row["peak_rss_mb"] == 1600 and row["expert_state_bytes"] == 12
    assert row["peak_above_process_mb"] == 1090
    assert [r["saved_activation_mb"] for r in row["per_rank"]] == [1.0, 2.0]
    assert row["per_rank"][1]["expert_bytes"]["params"] == 4
    assert set(row["per_rank"][0]["collective_s"]) == set(COLLECTIVES)


def test_the_ratios_set_ep_against_zero2_state_and_zero3_peak_and_time_with_their_targets():
    """And the peak again above each rank's process floor (what a GPU's allocator counts)."""
    ways = {"zero3": {"ran": True, "expert_state_bytes": 10, "peak_rss_mb": 2000.0,
                      "peak_above_process_mb": 1500.0, "step_time_s": {"median": 8.0}},
            "zero2": {"ran": True, "expert_state_bytes": 12, "peak_rss_mb": 1900.0,
                      "peak_above_process_mb": 1400.0, "step_time_s": {"median": 6.0}},
            "ep_zero2": {"ran": True, "expert_state_bytes": 6, "peak_rss_mb": 1800.0,
                         "peak_above_process_mb": 1200.0, "step_time_s": {"median": 2.0}},
            "autoep_alone": {"ran": False, "why": "TypeError: no", "failed_attempts": {"a": "no"}}}
    ratios = _ratios(ways)
    assert [name for name, *_ in TARGETS] == list(ratios)
    assert ratios["expert_state_ep_over_zero2"] == {"value": 0.5, "target": 0.55, "met": True}
    assert ratios["peak_rss_ep_over_zero3"] == {"value": 0.9, "target": 0.8, "met": False}
    assert ratios["step_time_ep_over_zero3"] == {"value": 0.25, "target": 0.8, "met": True}
    assert ratios["peak_above_process_ep_over_zero3"] == {"value": 0.8, "target": 0.8, "met": True}
    assert _ratios({**ways, "zero3": {"ran": False}})["step_time_ep_over_zero3"]["value"] is None
    assert "autoep_alone  did not run (a): no" in _table({"ways": {"autoep_alone": ways["autoep_alone"]},
                                                         "ratios": ratios})
