"""`ShardedWrite` on 2 real ranks over gloo: a rank that writes no shard never touches the
directory, so rank 0 may finish it (index, rename) before that rank's writer thread has run.

The model here is one tensor, so rank 0 writes the only shard and rank 1 none. Rank 1 starts its
background part only once rank 0 has renamed the finished directory into place: the order a
loaded CI machine produced in the RL loop's publish, where rank 1 then wrote its mark into the
renamed `.tmp-` directory and the publish failed on every rank.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import run_ranks
from vlmcp.parallel import comm
from vlmcp.training.hf_format import WEIGHTS_NAME
from vlmcp.training.sharded_write import ShardedWrite
from vlmcp.training.shards import SharePlan

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
