"""`vlmcp bench --publish`: it refuses the step benchmark's flags it does not use, and one run (a
narrow model, one round) writes every reported field for each way of publishing."""

from __future__ import annotations

import json

import pytest

from vlmcp.bench.publish import WAYS
from vlmcp.cli import main

FIELDS = {"critical_s", "fence_wait_s", "total_s", "rank0_peak_rss_mb", "rank0_rss_before_mb",
          "rank0_rss_increase_mb", "rank0_host_buffers_mb", "rank0_step_rss_increase_mb",
          "steps_meanwhile"}


def test_the_publish_bench_refuses_flags_it_does_not_use(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--publish", "--moe", "--images", "2", "--out", str(out)]) == 1
    assert "--publish does not use --moe, --images" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.e2e
def test_the_publish_bench_reports_every_way_from_fresh_ranks(tmp_path):
    out = tmp_path / "publish.json"
    assert main(["bench", "--publish", "--hidden-size", "64", "--repeats", "1",
                 "--scratch", str(tmp_path / "scratch"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "publish" and report["world"] == 2 and report["zero_stage"] == 3
    assert report["published_bytes"] > 10**5
    for way in WAYS:
        assert set(report[way]) == FIELDS, way
        (run,) = report["runs"][way]
        assert run["total_s"] > 0 and run["critical_s"] > 0
    assert report["background"]["steps_meanwhile"]["min"] >= 1
    assert report["background"]["rank0_host_buffers_mb"]["min"] > 0
    assert report["serial"]["rank0_host_buffers_mb"]["max"] == 0
    assert set(report["ratios"]) >= {"background_critical_vs_serial", "parallel_total_vs_serial",
                                     "parallel_rank0_peak_rss_vs_serial"}
    assert not any((tmp_path / "scratch").iterdir())
