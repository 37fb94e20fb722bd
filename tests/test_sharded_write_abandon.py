"""`ShardedWrite.abandon` against a finish already under way, at world 1 (no process group): rank
0's thread past its look at `abandoned` renames the directory into place, so `abandon` waits for
it and `complete` says so when it returns (`Publisher.close(agreed=False)` reads it right then to
write the row of a publish that completed; read earlier, the step appeared with no row)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vlmcp.training.weights.hf_format import WEIGHTS_NAME
from vlmcp.training.weights.sharded_write import ShardedWrite
from vlmcp.training.weights.shards import SharePlan


def test_an_abandon_during_rank0s_finish_returns_once_the_directory_is_in_place(tmp_path):
    weight = torch.arange(4, dtype=torch.float32)
    plan = SharePlan(keys=("w",), files=(WEIGHTS_NAME,), keys_of=(("w",),), writer_of=(0,),
                     share_bytes=(weight.nbytes,), total_parameters=0)
    writes: list[ShardedWrite] = []

    def seal(tmp: Path) -> None:  # in the finish, past its look: held until the abandon comes
        assert writes[0]._abandoned.wait(60), "never abandoned"

    write = ShardedWrite.begin(tmp_path / "step_1", plan, what="published weights",
                               replaceable=lambda _: True, seal=seal)
    writes.append(write)
    write.start({"w": weight.clone()}, background=True)
    deadline = time.monotonic() + 60
    while not write._finished:  # the thread has taken the finish (under its lock)
        assert time.monotonic() < deadline, "rank 0's thread never began the finish"
        time.sleep(0.001)
    write.abandon(None)
    assert write.complete and (tmp_path / "step_1" / WEIGHTS_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
