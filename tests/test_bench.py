"""`vlmcp bench`: its flags parse, its synthetic packs are valid, the max-length search finds the
boundary within its probe limit, and one fresh-process run of each mode writes every reported field.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.engine_reference import NEEDS_ENGINE
from vlmcp.bench.engine_mismatch import SIDES
from vlmcp.bench.run import search_max_len
from vlmcp.bench.inputs import image_grids, synthetic_pack, synthetic_pairs
from vlmcp.cli import build_parser, main
from vlmcp.data.batch import IGNORE_INDEX
from vlmcp.model.loss import CE_BYTES_PER_LOGIT
from vlmcp.model.tiny import tiny_qwen3_5_config

UTILISATION_FIELDS = {"model_tflops", "tflops_per_s", "mfu"}
STEP_FIELDS = {"seq_len", "step_time_s", "tokens_per_s", "model_memory_mb", "peak_memory_mb",
               "activation_memory_mb", "vision_s", "per_rank", "fresh_process", "peak_is_cumulative",
               *UTILISATION_FIELDS}
LOSS_FIELDS = {"seq_len", "vocab_size", "hidden_size", "chunk_rows", "loss_time_s",
               "loss_peak_transient_mb", "logits_peak_transient_mb", "lm_head_grad_mb",
               *UTILISATION_FIELDS}


def test_bench_parses_every_flag():
    args = build_parser().parse_args([
        "bench", "--seq-lens", "16384,65536", "--steps", "2", "--warmup", "1", "--dtype", "bfloat16",
        "--out", "x.json", "--sp-size", "2", "--deltanet-cp", "heads", "--samples-per-pack", "1",
        "--moe", "--vocab-size", "248320", "--hidden-size", "256", "--images", "8",
        "--loss-chunk-mb", "128", "--loss-only", "--find-max-len", "--memory-budget-gb", "4",
        "--granularity", "2048", "--max-probes", "6", "--pairs", "--deltanet-kernel", "torch",
        "--intermediate-size", "768", "--gradient-checkpointing", "--tiled-mlp",
        "--offload-activations", "--saved-bytes", "--compare-alst", "--repeats", "2", "--routes",
        "--engine-mismatch", "--weights", "runs/rl/weights", "--temperature", "0.7"])
    assert (args.seq_lens, args.steps, args.warmup, args.dtype, args.sp_size) == ("16384,65536", 2, 1, "bfloat16", 2)
    assert (args.vocab_size, args.hidden_size, args.images, args.loss_chunk_mb) == (248320, 256, 8, 128.0)
    assert args.loss_only and args.find_max_len and args.moe and args.pairs
    assert (args.memory_budget_gb, args.granularity, args.max_probes) == (4.0, 2048, 6)
    assert (args.deltanet_kernel, args.intermediate_size, args.repeats) == ("torch", 768, 2)
    assert args.gradient_checkpointing and args.tiled_mlp and args.offload_activations
    assert args.saved_bytes and args.compare_alst and args.routes
    assert args.engine_mismatch and (args.weights, args.temperature) == ("runs/rl/weights", 0.7)
    assert args.routes == "recorded"
    assert build_parser().parse_args(["bench", "--routes", "random"]).routes == "random"


@pytest.mark.parametrize("mode,given,named", [
    ("--saved-bytes", ["--videos", "2", "--images", "2"], "--images, --videos"),
    ("--compare-alst", ["--moe", "--tiled-mlp", "--dtype", "bfloat16"], "--moe, --dtype, --tiled-mlp"),
    ("--loss-only", ["--videos", "1", "--gradient-checkpointing"], "--videos, --gradient-checkpointing"),
    ("--engine-mismatch", ["--dtype", "bfloat16", "--moe"], "--moe, --dtype"),
])
def test_a_bench_mode_refuses_the_flags_it_does_not_use_by_name(mode, given, named, tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", mode, *given, "--out", str(out)]) == 1
    assert f"{mode} does not use {named}" in capsys.readouterr().err and not out.exists()


def test_the_engine_mismatch_flags_are_refused_without_their_mode(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--weights", str(tmp_path), "--out", str(out)]) == 1
    assert "--weights and --temperature are flags of --engine-mismatch" in capsys.readouterr().err
    assert not out.exists()


def test_synthetic_pack_places_every_image_and_keeps_targets_off_placeholders():
    config = tiny_qwen3_5_config()
    batch = synthetic_pack(2048, 3, config, images=5)
    grids = torch.tensor(image_grids(5))
    assert batch.num_tokens == 2048 and sum(batch.seq_lens) == 2048
    assert batch.pixel_values.shape[0] == int(grids.prod(dim=1).sum())
    image = batch.input_ids == config.image_token_id
    assert int(image.sum()) == int(grids.prod(dim=1).sum()) // 4 == int(batch.mm_token_type_ids.sum())
    assert not bool(torch.isin(batch.targets[batch.targets != IGNORE_INDEX],
                               torch.tensor([config.image_token_id])).any())
    assert sorted(image_grids(8)) != [image_grids(8)[0]] * 8  # mixed sizes


def test_synthetic_pairs_hold_the_shared_prompt_images_once_and_the_unshared_twice():
    config = tiny_qwen3_5_config()
    grids = torch.tensor(image_grids(3))
    shared = synthetic_pairs(1024, 2, config, images=3)
    twice = synthetic_pairs(1024, 2, config, images=3, shared=False)
    assert shared.pairs == [(0, 1), (2, 3)] and not twice.pairs
    assert torch.equal(shared.input_ids, twice.input_ids)
    assert shared.pixel_values.shape[0] == int(grids.prod(dim=1).sum())
    assert twice.pixel_values.shape[0] == 2 * int(grids.prod(dim=1).sum())
    assert shared.image_index.tolist() == [0, 1, 0, 1, 2, 2] and twice.image_index is None
    chosen, rejected = shared.input_ids.split(shared.seq_lens)[:2]
    prompt = 1 + next(t for t, target in enumerate(shared.targets.tolist()) if target != IGNORE_INDEX)
    assert torch.equal(chosen[:prompt], rejected[:prompt]) and not torch.equal(chosen, rejected)


def test_max_len_search_finds_the_boundary_within_its_probe_limit():
    for limit, expected in [(0, None), (1024, 1024), (5000, 4096), (40_000, 39_936)]:
        probed = []
        found = search_max_len(lambda n: probed.append(n) or n <= limit, 1024, 12)
        assert found == expected and len(probed) <= 12, (limit, found, probed)
    probed = []
    assert search_max_len(lambda n: probed.append(n) or True, 1024, 3) == 4096 and len(probed) == 3


@pytest.mark.e2e
def test_loss_only_reports_the_loss_transient_from_fresh_processes(tmp_path):
    out = tmp_path / "loss.json"
    assert main(["bench", "--loss-only", "--vocab-size", "2000", "--hidden-size", "16",
                 "--seq-lens", "96", "--loss-chunk-mb", "0.25", "--steps", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["mode"] == "loss_only" and LOSS_FIELDS <= set(row)
    assert row["chunk_rows"] == int(0.25 * 2**20) // (2000 * CE_BYTES_PER_LOGIT) and row["fresh_process"]
    assert row["loss_peak_transient_mb"] >= 0 and row["loss_time_s"] > 0
    assert row["model_tflops"] == 6 * 96 * 16 * 2000 / 1e12 and row["mfu"] > 0


@pytest.mark.e2e
def test_step_bench_writes_every_field_from_a_fresh_process(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--seq-lens", "256", "--samples-per-pack", "1", "--images", "1",
                 "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["mode"] == "step" and STEP_FIELDS <= set(row), set(row)
    assert row["fresh_process"] and not row["peak_is_cumulative"]
    assert row["peak_memory_mb"] >= row["model_memory_mb"] > 0 and row["vision_s"] > 0
    assert row["activation_memory_mb"] == row["peak_memory_mb"] - row["model_memory_mb"]
    assert report["peak_source"].startswith("measured") and report["peak_tflops"] > 0
    assert row["tflops_per_s"] == pytest.approx(row["model_tflops"] / row["step_time_s"])
    assert row["mfu"] == pytest.approx(row["tflops_per_s"] / report["peak_tflops"])


@pytest.mark.e2e
def test_saved_bytes_mode_reports_bytes_per_token_per_module_and_layer_kind(tmp_path):
    out = tmp_path / "saved.json"
    assert main(["bench", "--saved-bytes", "--seq-lens", "128", "--samples-per-pack", "1", "--tiled-mlp",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["mode"] == "saved_bytes" and report["tiled_mlp"] and row["local_tokens"] == 128
    kinds = {kind["module"]: kind for kind in row["per_layer_kind"]}
    assert kinds["language_model.layers.*.linear_attn"]["layers"] == 2
    # a tiled MLP keeps only its input, [S, hidden] fp32
    assert kinds["language_model.layers.*.mlp"]["bytes_per_token"] == 64 * 4
    assert abs(sum(r["bytes_per_token"] for r in row["per_module"]) - row["total_bytes_per_token"]) < 1e-6


@pytest.mark.e2e
def test_compare_alst_runs_both_sides_in_fresh_processes_and_their_losses_agree(tmp_path):
    out = tmp_path / "alst.json"
    assert main(["bench", "--compare-alst", "--seq-lens", "128", "--steps", "1", "--warmup", "0",
                 "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["mode"] == "compare_alst" and row["sp_size"] == 1
    assert [run["side"] for run in row["vlmcp"] + row["alst"]] == ["vlmcp", "alst"]
    assert row["step_time_ratio"]["median"] > 0 and row["activation_memory_ratio"]["each"]
    assert row["step_cpu_time_ratio"]["median"] > 0
    assert all(run["step_cpu_time_s"] > 0 for run in row["vlmcp"] + row["alst"])
    assert row["loss_rel_diff"] <= 1e-4
    # one model-FLOPs count for both sides: their MFUs differ as their step times do
    runs = row["vlmcp"] + row["alst"]
    assert all(run["model_tflops"] == row["model_tflops"] > 0 and run["mfu"] > 0 for run in runs)
    assert row["mfu"]["vlmcp"] / row["mfu"]["alst"] == pytest.approx(1 / row["step_time_ratio"]["median"])


def test_routes_need_a_moe_model_and_one_vision_mode(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--routes", "--out", str(out)]) == 1
    assert "--routes replays MoE routes: it needs --moe" in capsys.readouterr().err
    assert main(["bench", "--routes", "--moe", "--pairs", "--images", "2", "--out", str(out)]) == 1
    assert "--routes compares replay with native routing" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.e2e
def test_routes_bench_replays_the_models_own_routes_in_full_agreement_in_fresh_processes(tmp_path):
    out = tmp_path / "routes.json"
    assert main(["bench", "--moe", "--routes", "--sp-size", "2", "--seq-lens", "128",
                 "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["routes"] == "recorded"
    assert STEP_FIELDS <= set(row["native"]) and STEP_FIELDS <= set(row["replayed"])
    assert not row["native"]["routes"] and row["replayed"]["routes"] == "recorded"
    assert row["replayed"]["router_replay_tokens"] > 0
    assert row["replayed"]["router_replay_agreement"] == 1.0
    assert row["replay_time_ratio"] == row["replayed"]["step_time_s"] / row["native"]["step_time_s"]
    assert row["replay_peak_memory_mb"] == row["replayed"]["peak_memory_mb"] - row["native"]["peak_memory_mb"]


@pytest.mark.e2e
@NEEDS_ENGINE
def test_engine_mismatch_scores_the_engines_samples_with_every_side_at_lag_0(tmp_path):
    """A vLLM server samples, `vlmcp score` and transformers score the same tokens: the fp32
    trainer equals transformers fp32 on them within fp32's error (the rollout lines hold exactly
    the engine's tokens), and every side reports every field."""
    out = tmp_path / "mismatch.json"
    assert main(["bench", "--engine-mismatch", "--temperature", "0.8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["policies"]
    assert report["mode"] == "engine_mismatch" and (tmp_path / "mismatch-engine.log").exists()
    assert set(row["kinds"]) == {"image", "text"} and report["temperature"] == 0.8
    for kind in row["kinds"].values():
        assert set(SIDES) <= set(kind) and kind["tokens"] > 0
        assert kind["vlmcp_fp32"]["numeric"]["max_abs_from_hf_fp32"] < 1e-4
        assert kind["hf_fp32"]["numeric"]["max_abs_from_hf_fp32"] == 0.0
        # bf16's own error is far above fp32's, and the engine's within bf16's scale
        assert kind["vlmcp_bf16"]["numeric"]["max_abs_from_hf_fp32"] > 1e-3
        assert kind["vlmcp_fp32"]["numeric"]["max_abs_diff"] < 0.1
        assert 0 <= kind["vlmcp_fp32"]["numeric"]["mismatch_kl"] < 1e-3
    assert set(report["summary"]["image"]) >= {"vlmcp_fp32_numeric", "vlmcp_fp32_rows"}


@pytest.mark.e2e
def test_data_scale_bench_builds_the_index_once_then_reads_it_from_the_cache(tmp_path):
    out = tmp_path / "scale.json"
    assert main(["bench", "--data-scale", "4", "--steps", "1", "--data-workers", "0",
                 "--scratch", str(tmp_path / "scratch"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    first, second = report["results"]
    assert report["mode"] == "data_scale" and report["sp_size"] == 2
    assert (first["index"], second["index"]) == ("built", "loaded from cache")
    assert first["index_cache"] == second["index_cache"] and second["index_build_s"] is None
    assert len(first["peak_rss_mb_per_rank"]) == 2 and first["peak_rss_ratio"] == 1.0
    assert first["steps"] == second["steps"] == 1
    assert list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.e2e
def test_rollout_rss_bench_trains_every_step_size_in_a_fresh_process(tmp_path):
    out = tmp_path / "rss.json"
    assert main(["bench", "--rollout-rss", "1,2", "--steps", "1", "--rollout-image-size", "64",
                 "--data-workers", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "rollout_rss" and report["window_packs"] == 3
    assert [row["packs_per_step"] for row in report["results"]] == [1, 2]
    assert all(row["steps"] == 1 and row["peak_rss_mb"] > 0 for row in report["results"])
    assert report["results"][0]["peak_rss_ratio"] == 1.0
