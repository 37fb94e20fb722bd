"""publish.dir beside the other directories of a job, without training: overlapping directories
are refused (nested, through a symlink, relative), a published step and a rollout step are told
apart by their STABLE's content, a fresh run refuses an earlier run's publish.dir and a resume
sets aside the steps published beyond its checkpoint, leftovers of an interrupted publish are
swept, `publish.keep` never removes the step just published, every file of a published
directory is on the disk before its marker and its rename, and any exception of rank 0's write
becomes one agreed error on every rank (2 processes over gloo)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.launching import tiny_job, write_job
from vlmcp.cli import main
from vlmcp.config import job_from_dict
from vlmcp.data.rollouts import PUBLISHED_BY, STABLE, step_files
from vlmcp.errors import CheckpointError, ConfigError, DataError
from vlmcp.training import atomic
from vlmcp.training.weights.hf_format import write_dir_atomically, write_on_rank0
from vlmcp.training.weights.publish import SET_ASIDE, Publisher, published_steps


def _rl_job(checkpoint, tmp_path, **sections) -> dict:
    raw = tiny_job(checkpoint, tmp_path / "unused", tmp_path / "out",
                   rollouts={"dir": str(tmp_path / "rollouts")},
                   publish={"dir": str(tmp_path / "weights")})
    del raw["data"]["train"]
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values} if isinstance(values, dict) else values
    return raw


def _overlaps(raw: dict) -> list[str]:
    try:
        job_from_dict(raw)
    except ConfigError as exc:
        return [p for p in exc.problems if "overlap" in p]
    return []


def _published(root: Path, step: int) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / STABLE).write_text(json.dumps({"step": step, "written_by": PUBLISHED_BY}))
    return path


def _rollout_step(root: Path, step: int) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "rollouts.jsonl").write_text("{}\n")
    (path / STABLE).write_text("")
    return path


def test_overlapping_publish_rollout_and_output_dirs_are_refused_naming_both_keys(
        tiny_checkpoint, tmp_path, monkeypatch, capsys):
    same = _rl_job(tiny_checkpoint, tmp_path, publish={"dir": str(tmp_path / "rollouts")})
    (problem,) = _overlaps(same)
    assert problem.startswith("config keys 'publish.dir' and 'rollouts.dir' overlap: ")
    assert f"{tmp_path / 'rollouts'} is {tmp_path / 'rollouts'}" in problem
    inside = _rl_job(tiny_checkpoint, tmp_path, publish={"dir": str(tmp_path / "rollouts/w")})
    assert "'publish.dir' and 'rollouts.dir' overlap" in _overlaps(inside)[0]
    around = _rl_job(tiny_checkpoint, tmp_path, rollouts={"dir": str(tmp_path / "weights/r")})
    assert "'rollouts.dir' and 'publish.dir' overlap" in _overlaps(around)[0]
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "rollouts")
    linked = _rl_job(tiny_checkpoint, tmp_path, publish={"dir": str(tmp_path / "link")})
    assert "'publish.dir' and 'rollouts.dir' overlap" in _overlaps(linked)[0]
    monkeypatch.chdir(tmp_path)
    relative = _rl_job(tiny_checkpoint, tmp_path, publish={"dir": "rollouts/../rollouts"})
    assert "'publish.dir' and 'rollouts.dir' overlap" in _overlaps(relative)[0]
    in_final = _rl_job(tiny_checkpoint, tmp_path, publish={"dir": str(tmp_path / "out/final")})
    assert "'publish.dir' and 'output_dir' overlap" in _overlaps(in_final)[0]
    in_rollouts = _rl_job(tiny_checkpoint, tmp_path, output_dir=str(tmp_path / "rollouts/o"))
    assert "'output_dir' and 'rollouts.dir' overlap" in _overlaps(in_rollouts)[0]
    # Siblings, and steps published inside output_dir, are fine.
    assert _overlaps(_rl_job(tiny_checkpoint, tmp_path)) == []
    assert _overlaps(_rl_job(tiny_checkpoint, tmp_path,
                             publish={"dir": str(tmp_path / "out/weights")})) == []
    assert main(["validate", str(write_job(tmp_path / "job.json", same))]) == 1
    assert "'publish.dir' and 'rollouts.dir' overlap" in capsys.readouterr().err


def test_a_published_step_and_a_rollout_step_are_never_taken_for_each_other(tmp_path):
    _published(tmp_path, 2)
    _rollout_step(tmp_path, 3)
    (tmp_path / "step_4").mkdir()
    (tmp_path / "step_4" / STABLE).write_text('{"step": 4}')
    assert published_steps(tmp_path) == [2]
    with pytest.raises(DataError, match="a step of published weights"):
        step_files(tmp_path / "step_2")
    assert [p.name for p in step_files(tmp_path / "step_3")] == ["rollouts.jsonl"]


def test_keep_never_removes_the_step_just_published_nor_anything_not_published(
        tiny_checkpoint, tmp_path):
    weights = tmp_path / "weights"
    for step in (3, 4, 7, 8):
        _published(weights, step)
    _rollout_step(weights, 1)
    publisher = Publisher(job_from_dict(_rl_job(tiny_checkpoint, tmp_path,
                                                publish={"keep": 1})), None, None,
                          start_step=8)
    publisher._prune(4)
    assert sorted(p.name for p in weights.iterdir()) == ["step_1", "step_4", "step_7", "step_8"]


def test_a_fresh_run_refuses_an_earlier_runs_publish_dir_and_keep_1_warns(
        tiny_checkpoint, tmp_path, capsys, caplog):
    raw = _rl_job(tiny_checkpoint, tmp_path, publish={"keep": 1})
    job = write_job(tmp_path / "job.json", raw)
    assert main(["validate", str(job)]) == 0
    assert "publish.keep=1: each publish deletes the previous step" in caplog.text
    _published(tmp_path / "weights", 5)
    assert main(["validate", str(job)]) == 1
    err = capsys.readouterr().err
    assert f"config key 'publish.dir': {tmp_path / 'weights'} already holds the published " \
           "weights of an earlier run (newest: step_5)" in err
    _rollout_step(tmp_path / "weights", 6)
    assert main(["validate", str(job), "--set", "train.resume=true"]) == 1
    assert "holds step directories that vlmcp's publish did not write (step_6" in \
        capsys.readouterr().err


def test_a_resume_sets_aside_steps_published_beyond_its_checkpoint_and_sweeps_leftovers(
        tiny_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    weights = tmp_path / "weights"
    for step in (2, 3, 4, 5):
        _published(weights, step)
    for stale in (".tmp-step_6", ".old-step_1"):
        (weights / stale).mkdir()
        (weights / stale / "model.safetensors").write_text("partial")
    Publisher(job_from_dict(_rl_job(tiny_checkpoint, tmp_path, train={"resume": True})),
              None, None, start_step=3)
    assert sorted(p.name for p in weights.iterdir()) == [SET_ASIDE, "step_2", "step_3"]
    (run,) = (weights / SET_ASIDE).iterdir()
    assert sorted(p.name for p in run.iterdir()) == ["step_4", "step_5"]
    assert published_steps(weights) == [3, 2]
    assert "resuming at step 3, set aside the published steps 4, 5" in caplog.text
    assert str(run) in caplog.text


def test_a_published_directory_is_on_the_disk_before_its_marker_and_its_rename(
        tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", recording_fsync)
    out = tmp_path / "weights" / "step_1"
    tmp = out.with_name(".tmp-step_1")

    def fill(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"w" * 100)
        (directory / "sub").mkdir()
        (directory / "sub" / "tokenizer.json").write_text("{}")

    def seal(directory: Path) -> None:
        assert {str(tmp / "model.safetensors"), str(tmp / "sub" / "tokenizer.json"),
                str(tmp / "sub"), str(tmp)} <= set(synced)
        synced.append("sealed")
        atomic.write_text_atomic(directory / STABLE, "{}")

    write_dir_atomically(out, STABLE, "published weights", fill, 100, seal=seal)
    after_seal = synced[synced.index("sealed"):]
    assert str(tmp / f".{STABLE}.tmp") in after_seal and str(tmp) in after_seal
    assert synced[-1] == str(tmp_path / "weights"), "the rename is flushed in the parent"


def _rank0_write_raises() -> list[str]:
    from vlmcp.parallel import comm

    def write() -> None:
        raise ValueError("header too large")

    try:
        write_on_rank0({} if comm.rank() == 0 else None, write, Path("/w/step_3"))
    except CheckpointError as exc:
        return exc.problems
    return ["no error"]


@pytest.mark.e2e
def test_any_exception_of_rank_0s_write_is_one_error_on_every_rank_naming_the_file():
    rank0, rank1 = run_ranks(_rank0_write_raises, 2)
    assert rank0 == ["writing /w/step_3: ValueError: header too large"]
    assert rank1 == []


def test_the_writer_keys_name_what_they_need(tiny_checkpoint, tmp_path):
    both = _rl_job(tiny_checkpoint, tmp_path, publish={"sharded": False, "background": True})
    with pytest.raises(ConfigError) as info:
        job_from_dict(both)
    assert info.value.problems == [
        "config key 'publish.background' is true but 'publish.sharded' is false: the background "
        "write is the rank-parallel one; set publish.sharded to true"]
    assert not job_from_dict(_rl_job(tiny_checkpoint, tmp_path,
                                     publish={"sharded": False})).publish.sharded
    lora = _rl_job(tiny_checkpoint, tmp_path, lora={"r": 4}, publish={"background": False})
    with pytest.raises(ConfigError) as info:
        job_from_dict(lora)
    assert info.value.problems == [
        "config key 'publish.background' does not apply under LoRA (lora.r > 0): the adapter is "
        "small and rank 0 writes it"]


def test_a_pinned_staging_buffer_counts_the_power_of_two_the_host_allocator_holds():
    from vlmcp.training.weights.shards import buffers_held_bytes, held_bytes

    assert [held_bytes(n, True) for n in (1, 4096, 4097, 2 * 2**30 + 1)] == [
        1, 4096, 8192, 4 * 2**30]
    assert [held_bytes(n, False) for n in (0, 4097, 2 * 2**30 + 1)] == [0, 4097, 2 * 2**30 + 1]
    assert held_bytes(0, True) == 0
    pageable = {"a": torch.empty(1000, dtype=torch.float32), "b": torch.empty(3, dtype=torch.bfloat16)}
    assert buffers_held_bytes(pageable) == 4006
