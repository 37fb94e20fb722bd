"""Each launcher starts 2 CPU ranks (gloo) that train the same job to the same losses.

The job runs sequence parallel over both ranks (sp_size 2), each launcher with another stock
DeepSpeed config from ds_configs/; its losses must equal those of one plain process training the
same job with sp_size 1 and ZeRO-0.
"""

from __future__ import annotations

import pytest

from tests.helpers.launching import REPO, assert_ok, run_vlmcp, tiny_job, train_losses, write_job
from vlmcp.training.weights.hf_format import INDEX_NAME

pytestmark = pytest.mark.e2e

#: launcher -> the stock DeepSpeed config its run uses.
LAUNCHER_ZERO = {"torchrun": "zero2", "deepspeed": "zero3", "accelerate": "zero1"}


@pytest.fixture(scope="module")
def single_process_losses(tiny_checkpoint, digits_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    job = write_job(out / "job.json", tiny_job(tiny_checkpoint, digits_jsonl / "train.jsonl", out))
    assert_ok(run_vlmcp(["train", str(job)]))
    return train_losses(out)


@pytest.mark.parametrize("launcher,zero", LAUNCHER_ZERO.items())
def test_launcher_trains_two_ranks_to_single_process_losses(
        launcher, zero, tiny_checkpoint, digits_jsonl, tmp_path, single_process_losses):
    job = write_job(tmp_path / "job.json", tiny_job(
        tiny_checkpoint, digits_jsonl / "train.jsonl", tmp_path / "out",
        parallel={"sp_size": 2}, deepspeed=str(REPO / "ds_configs" / f"{zero}.json")))
    result = run_vlmcp(["train", str(job)], launcher=launcher, nproc=2)
    assert_ok(result)
    assert f"world 2 = sp 2 x dp 1, ZeRO stage {zero[-1]}" in result.stderr
    losses = train_losses(tmp_path / "out")
    assert len(losses) == 2
    assert losses == pytest.approx(single_process_losses, rel=1e-5)
    final = tmp_path / "out" / "final"
    assert (final / "config.json").is_file() and (final / INDEX_NAME).is_file()
    assert len(list(final.glob("model-*-of-00002.safetensors"))) == 2
    assert (final / "tokenizer.json").is_file() and (final / "preprocessor_config.json").is_file()
