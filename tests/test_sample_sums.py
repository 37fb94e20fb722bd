"""`SampleTargets.sums` over real gloo processes: a shard that holds none of the pack's targets
(a long prompt over rank 0's shard of a spread pair) still joins the sums' all-reduce in the
backward, so the other ranks' gradients arrive instead of every rank waiting on another
collective (the SP 4 dynamic pair step of tests/test_objective_parity.py hung so)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.e2e


def _sums_and_backward() -> dict:
    from vlmcp.model.sample_sums import SampleTargets
    from vlmcp.parallel.groups import SequenceParallel

    sp = SequenceParallel.initialize(2)
    # one sample: its three targets all on rank 1; rank 0's columns are empty and need no
    # gradient (as `TokenLogprobs` holds them for a shard without targets)
    local = torch.zeros(3 * sp.rank, dtype=torch.long)
    targets = SampleTargets(local, torch.zeros(3, dtype=torch.long),
                            torch.tensor([3.0], dtype=torch.float64), 1, sp.group)
    if sp.rank:
        columns = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    else:
        columns = torch.zeros((0, 1))
    sums = targets.sums(columns)
    # every rank's loss uses the whole sums (rank r with weight r + 1)
    (sums.sum() * (sp.rank + 1)).backward()
    return {"sums": sums.detach(), "requires_grad": sums.requires_grad,
            "grad": columns.grad if sp.rank else None}


def test_a_shard_without_targets_joins_the_backward_of_the_sums():
    results = run_ranks(_sums_and_backward, 2)
    for result in results:
        assert result["requires_grad"]
        assert result["sums"].tolist() == [[6.0]]
    # rank 1's targets receive both ranks' gradients: 1 + 2
    assert results[1]["grad"].tolist() == [[3.0], [3.0], [3.0]]
