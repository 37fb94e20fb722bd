"""`vlmcp bench --length-mix`: the seeded RL-like lengths, the flags it refuses, and one short run
(fresh SP 2 ranks both ways, under the profiler too) that reports every field, trains the same
first step both ways, and splits the dynamic steps' tokens between the degrees."""

from __future__ import annotations

import json
import math

import pytest

from vlmcp.bench.length_mix import COLLECTIVES, mix_lengths
from vlmcp.cli import main


def test_mix_lengths_are_seeded_with_the_long_samples_at_the_limit_and_the_rest_within_it():
    lengths = mix_lengths(64, 256, 2, 4096, seed=3)
    assert lengths == mix_lengths(64, 256, 2, 4096, seed=3) != mix_lengths(64, 256, 2, 4096, seed=4)
    limit = max(lengths)
    assert lengths.count(limit) >= 2 and limit < 4096
    assert all(32 <= n <= limit for n in lengths)
    short = sorted(n for n in lengths if n < limit)
    assert 128 < short[len(short) // 2] < 512  # the median of the log-normal draw is near 256


def test_the_length_mix_refuses_flags_it_does_not_use_and_its_flags_without_it(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--length-mix", "--moe", "--images", "2", "--out", str(out)]) == 1
    assert "--length-mix does not use --moe, --images" in capsys.readouterr().err
    assert main(["bench", "--data-scale", "4", "--mix-samples", "8", "--out", str(out)]) == 1
    assert "--mix-samples: flags of --length-mix" in capsys.readouterr().err
    assert main(["bench", "--length-mix", "--sp-size", "1", "--out", str(out)]) == 1
    assert "--length-mix compares SP degrees" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.e2e
def test_the_length_mix_trains_the_same_steps_both_ways_and_reports_the_degrees(tmp_path):
    out = tmp_path / "mix.json"
    assert main(["bench", "--length-mix", "--mix-samples", "6", "--mix-median", "64",
                 "--mix-long", "1", "--mix-max-len", "512", "--steps", "1", "--warmup", "1",
                 "--repeats", "1", "--mix-profile", "--scratch", str(tmp_path / "scratch"),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "length_mix" and report["world"] == report["sp_size"] == 2
    fixed, dynamic = report["runs"]["fixed"][0], report["runs"]["dynamic"][0]
    assert fixed["tokens"] == dynamic["tokens"] > 0
    assert fixed["tokens_per_s"] > 0 and 0 < dynamic["mfu"] < 1
    assert report["tokens_per_s_ratio"] == round(dynamic["tokens_per_s"] / fixed["tokens_per_s"], 3)
    plan = report["plan"]
    assert set(plan["packs"]) == {"1", "2"} and plan["packs"]["1"] >= 2 and plan["packs"]["2"] >= 1
    assert sum(plan["tokens"].values()) == dynamic["tokens"]
    losses = report["first_step_loss"]
    assert math.isclose(losses["fixed"], losses["dynamic"], rel_tol=1e-5)
    for way in ("fixed", "dynamic"):
        profile = report["profile"][way]
        assert set(profile["collective_s"]) == set(COLLECTIVES) and profile["step_time_s"] > 0
        assert all(len(per_rank) == 2 for per_rank in profile["collective_s"].values())
    assert report["profile"]["fixed"]["collective_s"]["all_to_all"][0] > 0
    assert not any((tmp_path / "scratch").iterdir())
