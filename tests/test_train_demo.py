"""The demo job: trained with sp_size 2 on 2 ranks, its loss curve matches the sp_size 1 run of
the same seed to 1e-4 over 30 steps (in which the loss falls below half); and its plot is
written from metrics rows."""

from __future__ import annotations


import pytest

from tests.helpers.launching import assert_ok, run_vlmcp, train_losses, write_job
from vlmcp.demo.assets import write_digits_dataset
from vlmcp.demo.image import DEMO_MODEL, demo_job, plot_metrics
from vlmcp.model.tiny import build_tiny_checkpoint

STEPS = 30


@pytest.fixture(scope="module")
def demo_assets(tmp_path_factory):
    assets = tmp_path_factory.mktemp("demo_assets")
    build_tiny_checkpoint(assets / "checkpoint", seed=0, **DEMO_MODEL)
    write_digits_dataset(assets / "digits", seed=0)
    return assets


def _run(assets, out, sp_size, nproc):
    job = demo_job(assets, out, sp_size)
    job["train"].update({"max_steps": STEPS, "eval_every": 0})
    job["eval"]["generate"] = False
    path = write_job(out / "job.json", job)
    assert_ok(run_vlmcp(["train", str(path)], launcher="torchrun" if nproc > 1 else None,
                        nproc=nproc, timeout=300))
    return train_losses(out)


@pytest.mark.e2e
def test_demo_loss_curve_with_sp2_matches_sp1_over_30_steps(demo_assets, tmp_path):
    sp2 = _run(demo_assets, tmp_path / "sp2", sp_size=2, nproc=2)
    sp1 = _run(demo_assets, tmp_path / "sp1", sp_size=1, nproc=1)
    assert len(sp1) == len(sp2) == STEPS
    assert max(abs(a - b) for a, b in zip(sp1, sp2)) <= 1e-4
    assert sp1[-1] < 0.5 * sp1[0]


@pytest.mark.e2e
def test_demo_plot_is_written_from_metrics_rows(tmp_path):
    rows = [{"step": s, "loss": 3.0 / s} for s in range(1, 11)]
    rows += [{"step": 5, "eval_loss": 1.0, "eval_accuracy": 0.5},
             {"step": 10, "eval_loss": 0.5, "eval_accuracy": 0.95}]
    path = plot_metrics(rows, tmp_path / "loss_accuracy.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
