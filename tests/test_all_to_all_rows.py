"""The routing collective over real gloo processes: `all_to_all_rows_autograd` delivers uneven
row counts (including a rank that sends and receives nothing) in source-rank order, and its
backward hands every row's gradient back to the rank that sent it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.e2e

# COUNTS[s][d]: rows rank s sends to rank d. Rank 1 sends and receives nothing.
COUNTS = [[2, 0, 1], [0, 0, 0], [3, 0, 2]]


def _row(src: int, dst: int, k: int) -> list[float]:
    return [100.0 * src + 10.0 * dst + k, -1.0 * k]


def _route_and_backward() -> dict:
    from vlmcp.parallel import comm
    from vlmcp.parallel.groups import SequenceParallel

    sp = SequenceParallel.initialize(3)
    me = sp.rank
    send = COUNTS[me]
    recv = [COUNTS[s][me] for s in range(3)]
    rows = torch.tensor([_row(me, d, k) for d in range(3) for k in range(send[d])]).reshape(-1, 2)
    rows.requires_grad_(True)
    out = comm.all_to_all_rows_autograd(rows, send, recv, sp.group)
    weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape) + 1000.0 * me
    (out * weights).sum().backward()
    return {"out": out.detach(), "grad": rows.grad}


def test_uneven_rows_reach_their_ranks_and_gradients_return_to_their_senders():
    results = run_ranks(_route_and_backward, 3)
    for me, result in enumerate(results):
        expected = [_row(s, me, k) for s in range(3) for k in range(COUNTS[s][me])]
        assert result["out"].tolist() == expected
    for me, result in enumerate(results):
        grads = []
        for d in range(3):
            before = sum(COUNTS[s][d] for s in range(me))
            for k in range(COUNTS[me][d]):
                row = before + k
                grads.append([1000.0 * d + 2 * row, 1000.0 * d + 2 * row + 1])
        assert result["grad"].reshape(-1, 2).tolist() == grads
