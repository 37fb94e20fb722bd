"""`ShardedWrite` on 2 real ranks over gloo, each case forcing the order it is about:

- a rank that writes no shard never touches the directory, so rank 0 may finish it (index,
  rename) before that rank's writer thread has run. The model here is one tensor, so rank 0
  writes the only shard and rank 1 none; rank 1 starts its background part only once rank 0 has
  renamed the finished directory into place (the order a loaded CI machine produced in the RL
  loop's publish, where rank 1 then wrote its mark into the renamed `.tmp-` directory);
- a shard whose write fails right after the agreement's look at "written" (the thread switch
  forced there) is never sealed: the ranks agree it is unwritten, then that it failed;
- rank 0's writer thread dying in its look for the other ranks' marks (a network filesystem's
  stale handle) fails the publish on every rank, with no directory left.
- a rank's writer thread held from the moment its mark shows until rank 0 has finished and
  renamed the directory: nothing of that rank's part comes after, so the ranks agree that the
  directory is complete (a flush of the mark after it showed failed on a loaded CI machine).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import run_ranks
from vlmcp.parallel import comm
from vlmcp.training.weights.hf_format import INDEX_NAME, WEIGHTS_NAME, shard_names
from vlmcp.training.weights.sharded_write import ShardedWrite
from vlmcp.training.weights.shards import SharePlan

pytestmark = pytest.mark.e2e

_WEIGHT = torch.arange(4, dtype=torch.float32)


def _rank1_starts_after_rank0_finished(out_dir: str) -> list[str]:
    plan = SharePlan(keys=("w",), files=(WEIGHTS_NAME,), keys_of=(("w",),), writer_of=(0,),
                     share_bytes=(_WEIGHT.nbytes,), total_parameters=0)
    out = Path(out_dir) / "step_1"
    write = ShardedWrite.begin(out, plan, what="published weights", replaceable=lambda _: True)
    if comm.rank() == 0:
        write.start({"w": _WEIGHT.clone()}, background=True)
    else:
        deadline = time.monotonic() + 120
        while not out.is_dir():
            assert time.monotonic() < deadline, "rank 0 never finished the directory"
            time.sleep(0.01)
        write.start({}, background=True)
    assert write.settle(wait=True)
    return sorted(p.name for p in out.iterdir())


def test_a_rank_without_a_shard_never_writes_into_the_directory_rank0_has_finished(tmp_path):
    for files in run_ranks(_rank1_starts_after_rank0_finished, 2, str(tmp_path)):
        assert files == [WEIGHTS_NAME]
    assert torch.equal(load_file(tmp_path / "step_1" / WEIGHTS_NAME)["w"], _WEIGHT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def _two_writers() -> SharePlan:
    """Ranks 0 and 1 each write one shard of a two-tensor model."""
    return SharePlan(keys=("a", "b"), files=tuple(shard_names(2)), keys_of=(("a",), ("b",)),
                     writer_of=(0, 1), share_bytes=(_WEIGHT.nbytes, _WEIGHT.nbytes),
                     total_parameters=0)


class _FailsBetweenTheLooks(threading.Event):
    """Rank 1's `written` event, forcing the thread switch of the race: right after the first
    look at it, the writer thread fails (released by `go`) and sets it, before any second look."""

    def __init__(self, go: threading.Event):
        super().__init__()
        self.go, self.looks = go, 0

    def is_set(self) -> bool:
        now = super().is_set()
        self.looks += 1
        if self.looks == 1:
            self.go.set()
            assert self.wait(60), "the writer thread never failed"
        return now


def _rank1_fails_between_the_looks(out_dir: str) -> tuple[list[bool], list[str]]:
    from vlmcp.errors import CheckpointError
    from vlmcp.training.weights import sharded_write

    out = Path(out_dir) / "step_1"
    write = ShardedWrite.begin(out, _two_writers(), what="published weights",
                               replaceable=lambda _: True)
    share = {"a": _WEIGHT.clone()} if comm.rank() == 0 else {"b": _WEIGHT.clone()}
    if comm.rank() == 1:
        go = threading.Event()
        write._written = _FailsBetweenTheLooks(go)

        def fails(tensors, path):
            go.wait()
            path.write_bytes(b"truncated!")
            raise OSError(5, "Input/output error (simulated)")

        sharded_write.write_shard = fails
    write.start(share, background=True)
    settled = []
    try:
        settled.append(write.settle(wait=comm.rank() == 0))
        settled.append(write.settle(wait=True))
    except CheckpointError as exc:
        return settled, exc.problems
    return settled, []


def test_a_shard_that_fails_between_the_two_looks_of_the_agreement_is_never_sealed(tmp_path):
    rank0, rank1 = run_ranks(_rank1_fails_between_the_looks, 2, str(tmp_path))
    assert rank0 == ([False], []) and rank1[0] == [False], (rank0, rank1)
    (line,) = rank1[1]
    assert f"cannot write {tmp_path / '.tmp-step_1' / shard_names(2)[1]}" in line, line
    assert "Input/output error (simulated)" in line, line
    assert not any(tmp_path.iterdir()), "no step_1, and no .tmp- directory"


def _rank0s_look_for_marks_fails(out_dir: str) -> list[str]:
    from vlmcp.errors import CheckpointError

    out = Path(out_dir) / "step_1"
    looked = Path(out_dir) / "rank0-looked"
    write = ShardedWrite.begin(out, _two_writers(), what="published weights",
                               replaceable=lambda _: True)
    if comm.rank() == 0:
        real = Path.exists

        def stale(path: Path) -> bool:
            if path.name.endswith(".written"):
                looked.touch()
                raise OSError(116, "Stale file handle (simulated)")
            return real(path)

        Path.exists = stale
        write.start({"a": _WEIGHT.clone()}, background=True)
    else:
        deadline = time.monotonic() + 120
        while not looked.exists():  # rank 0's thread has died in its look for the marks
            assert time.monotonic() < deadline, "rank 0 never looked for the marks"
            time.sleep(0.01)
        write.start({"b": _WEIGHT.clone()}, background=True)
    try:
        write.settle(wait=True)
    except CheckpointError as exc:
        return exc.problems
    return ["settled as complete"]


def test_a_writer_thread_that_dies_outside_its_writes_fails_the_publish_on_every_rank(tmp_path):
    rank0, rank1 = run_ranks(_rank0s_look_for_marks_fails, 2, str(tmp_path))
    (line,) = rank0
    assert rank1 == [], rank1
    assert f"writing the published weights to {tmp_path / 'step_1'}: " in line, line
    assert "Stale file handle (simulated)" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-looked"], \
        "no step_1, and no .tmp- directory"


class _HeldUntil(threading.Event):
    """Rank 1's `written` event: setting it first waits until `ready()` (rank 0 has finished the
    directory), so that nothing of rank 1's part can come after rank 0's finish by luck alone."""

    def __init__(self, ready):
        super().__init__()
        self.ready = ready

    def set(self) -> None:
        deadline = time.monotonic() + 60
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        super().set()


def _rank0_finishes_as_soon_as_rank1s_mark_shows(out_dir: str) -> list[str]:
    """Rank 1's writer thread is held from the moment its mark is visible (to rank 0's look for
    the marks) until rank 0 has renamed the finished directory into place."""
    from vlmcp.errors import CheckpointError
    from vlmcp.training.weights import sharded_write

    out = Path(out_dir) / "step_1"
    write = ShardedWrite.begin(out, _two_writers(), what="published weights",
                               replaceable=lambda _: True)
    share = {"a": _WEIGHT.clone()} if comm.rank() == 0 else {"b": _WEIGHT.clone()}
    if comm.rank() == 1:
        mark = write.tmp / ".rank-1.written"
        real = sharded_write.fsync_path

        def held(path: Path) -> None:
            if mark.exists():  # rank 0 may finish from here on
                deadline = time.monotonic() + 60
                while not out.is_dir() and time.monotonic() < deadline:
                    time.sleep(0.01)
            real(path)

        sharded_write.fsync_path = held
        write._written = _HeldUntil(out.is_dir)
    write.start(share, background=True)
    try:
        complete = write.settle(wait=True)
    except CheckpointError as exc:
        return exc.problems or ["CheckpointError on another rank"]
    return [f"complete {complete}"]


def test_a_directory_rank0_finished_once_every_mark_showed_is_complete_on_every_rank(tmp_path):
    # the order a loaded CI machine produced in the RL loop: rank 0 saw rank 1's mark and renamed
    # the directory before rank 1 flushed the mark, whose flush then failed (the file was gone),
    # so the ranks agreed on a failure while the step was published, and its row was lost
    for outcome in run_ranks(_rank0_finishes_as_soon_as_rank1s_mark_shows, 2, str(tmp_path)):
        assert outcome == ["complete True"], outcome
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert sorted(p.name for p in (tmp_path / "step_1").iterdir()) == [*shard_names(2), INDEX_NAME]
