"""The push's sessions (vlmcp/engine/push_wire.py, training/weights/engine_push.py) between real
trainer ranks (processes over gloo, `EnginePush` as `vlmcp train` builds it) and a stand-in
engine whose workers follow the same protocol (tests/helpers/fake_push_engine.py: real gloo
members, vLLM's HTTP routes without vLLM): a rank whose send fails ends the push at once with its
own error, staged and streamed, and a failed staged push leaves the engine unpaused and holding
no staged copy; the rendezvous store holds no more keys after 20 pushes than after one; an
attempt at the group that fails on one member is retried, and one that fails every time fails the
push naming it; publish.push_dtype sends each tensor in the dtype the engine holds it in; the
store listens only on the address the engines reach. Sparse pushes (publish.dense_every) carry
only the changed elements and leave the weights of a dense push; an engine of two data-parallel
replicas of two tensor-parallel workers gets every tensor in both replicas; a sparse push into a
restarted engine, or one whose patch fails part-way, is followed by a dense one that lands; a
delivery check that fails (a tensor held as zeros, one the loader dropped) is one line naming
the tensor; without publish.verify_push sparse pushes still land, unchecked. A `WorkWatch` ended
before its owner waited leaves the owner a receive that had arrived and ends the others at once."""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.request
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_ranks
from tests.helpers.fake_push_engine import RESTART, FakePushEngine

pytestmark = pytest.mark.e2e

#: Long enough that a push which waited for it is told from one that did not (seconds).
TIMEOUT_S = 120.0
BUCKET_BYTES = 4096


def _share(rank: int, broken: bool, step: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors at step `step`: four buckets of BUCKET_BYTES (fp32, 64 x 16),
    distinct per rank, every 50th element of t0 changed at each step after the first, every
    element of t1 at step 3 (t2 and t3 never); `broken`: the second bucket's tensor cannot be
    packed (a meta tensor: the rank's send fails after its first bucket went out)."""
    gen = torch.Generator().manual_seed(rank)
    share = {f"r{rank}.t{i}": torch.randn(BUCKET_BYTES // 64, 16, generator=gen)
             for i in range(4)}
    for later in range(2, step + 1):
        share[f"r{rank}.t0"].view(-1)[later::50] += later
    if step >= 3:
        share[f"r{rank}.t1"] += 0.5
    if broken:
        share[f"r{rank}.t1"] = torch.empty(BUCKET_BYTES // 64, 16, device="meta")
    return share


def _push_rank(url: str, pushes: int, staged: bool, broken_rank: int | None,
               dtype: str | None = None, dense_every: int = 1, restart_before: int = 0,
               verify: bool = True) -> list[dict]:
    """`pushes` pushes of this rank's share of steps 1, 2, ... into `url`
    (publish.on_engine_error "warn", publish.dense_every `dense_every`, publish.verify_push
    `verify`; rank 0 restarts the stand-in engine before push `restart_before`): per push its seconds, problem, mode, whether
    it re-anchored, its bytes, changed fraction and (rank 0) the store's key count, counted once
    every rank has left the push; then (rank 0) whether the store's address and another of this
    host reach it."""
    from vlmcp.parallel import comm
    from vlmcp.training.weights.engine_push import EnginePush, PushSettings

    push = EnginePush(PushSettings((url,), BUCKET_BYTES, TIMEOUT_S, "wait", "warn", None,
                                   getattr(torch, dtype) if dtype else None, staged,
                                   dense_every, verify))
    rows = []
    for step in range(1, pushes + 1):
        if step == restart_before and comm.rank() == 0:
            urllib.request.urlopen(urllib.request.Request(url + RESTART, data=b"{}")).read()
        share = _share(comm.rank(), comm.rank() == broken_rank, step)
        started = time.perf_counter()
        push.push(step, share)
        seconds = time.perf_counter() - started
        comm.barrier()  # every rank has left the push (its keys are settled), none is ahead
        outcome = push.outcomes[0]
        rows.append({"seconds": seconds, "problem": outcome.problem, "mode": outcome.mode,
                     "reanchored": outcome.reanchored, "bytes": push.pushed_bytes,
                     "changed": push.changed, "keys": push.keys() if comm.rank() == 0 else None})
        comm.barrier()
    if comm.rank() == 0:
        host, port = push.rendezvous.host, push.rendezvous.port
        rows[-1]["bound"] = {address: _reaches(address, port) for address in (host, "127.0.0.2")}
    return rows


def _reaches(address: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.connect((address, port))
        except ConnectionRefusedError:
            return False
    return True


BF16 = {"engine_dtype": torch.bfloat16}
#: name: (the stand-in engine's settings, the pushes: (count, staged, broken rank, push_dtype,
#: dense_every, the push a restart of the engine comes before, verify_push)).
SCENARIOS = {
    "staged_send_fails": ({}, (1, True, 1, None)),
    "streamed_send_fails": ({}, (1, False, 1, None)),
    "twenty_pushes": ({}, (20, True, None, None)),
    "retried_group": ({"fail_attempts": {0: 0}}, (1, True, None, None)),
    "failed_group": ({"fail_attempts": {0: 0, 1: 0, 2: 0}}, (1, True, None, None)),
    "push_dtype": ({"held": {"r0.t2": "float32", "r1.t0": "float32"}}, (2, True, None, "bfloat16")),
    "sparse": (BF16, (4, True, None, None, 10)),
    "sparse_streamed": (BF16, (2, False, None, None, 10)),
    "dp2_tp2": ({"replicas": 2, "tensor_parallel": 2, **BF16}, (3, True, None, None, 2)),
    "restarted": (BF16, (3, True, None, None, 10, 3)),
    "interrupted_patch": ({"fail_sparse": "r1.t0", **BF16}, (2, True, None, None, 10)),
    "corrupted": ({"corrupt": "r1.t2"}, (1, True, None, None)),
    "dropped": ({"drop": "r0.t3"}, (1, True, None, None)),
    "unverified": ({"corrupt": "r1.t2", **BF16}, (2, True, None, None, 10, 0, False)),
}


def _watch_rank() -> dict[str, Any]:
    """Rank 0 sends one of the two buckets rank 1 posted receives for under a WorkWatch; rank 1
    ends the watch (as a failed push's stop does) before it waits on either, then waits on each
    and posts a third: per receive, its seconds and whether it arrived (and what), or its
    error."""
    from vlmcp.engine.push_wire import Session, WorkWatch
    from vlmcp.parallel import comm

    rendezvous = comm.Rendezvous.open(TIMEOUT_S, "127.0.0.1")
    group = dist.ProcessGroupGloo(dist.PrefixStore("watch/", rendezvous.store), comm.rank(), 2,
                                  timedelta(seconds=TIMEOUT_S))
    session = Session(rendezvous.store, "watch/session/", comm.rank(), 2, TIMEOUT_S, workers=0)
    if comm.rank() == 0:
        group.send([torch.full((4,), 7.0)], 1, 0).wait()
        session.put("sent", "1")
        comm.barrier()
        return {}
    watch = WorkWatch(session, group)
    buffers = [torch.zeros(4) for _ in range(3)]
    works = [watch.post(group.recv([buffers[tag]], 0, tag)) for tag in range(2)]
    session.wait_key("sent", "rank 0's send")
    time.sleep(0.5)  # the first bucket has arrived; nobody waited on it yet
    watch.close()
    outcomes = {}
    for tag in range(3):
        started = time.perf_counter()
        try:
            watch.run(works[tag] if tag < 2 else group.recv([buffers[tag]], 0, tag), f"{tag}")
            outcomes[tag] = ("arrived", buffers[tag].tolist())
        except RuntimeError as exc:
            outcomes[tag] = ("ended", str(exc)[:80])
        outcomes[tag] += (time.perf_counter() - started,)
    comm.barrier()
    return outcomes


def _every_scenario(urls: dict[str, str]) -> dict[str, Any]:
    pushes = {name: _push_rank(urls[name], *SCENARIOS[name][1]) for name in SCENARIOS}
    return {**pushes, "watch": _watch_rank()}


@pytest.fixture(scope="module")
def pushed() -> dict[str, tuple[FakePushEngine, list[dict], list[dict]]]:
    """{scenario: (its engine, rank 0's rows, rank 1's rows)}: every scenario in one launch of
    two ranks, each against a stand-in engine of its own."""
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(FakePushEngine(**settings))
                   for name, (settings, _) in SCENARIOS.items()}
        rank0, rank1 = run_ranks(_every_scenario, 2, {n: e.url for n, e in engines.items()})
        yield {**{name: (engines[name], rank0[name], rank1[name]) for name in SCENARIOS},
               "watch": rank1["watch"]}


def _expected(world: int, step: int = 1) -> dict[str, torch.Tensor]:
    return {name: t for rank in range(world) for name, t in _share(rank, False, step).items()}


def test_a_watch_ended_before_its_owner_waited_leaves_an_arrived_receive_to_it_and_ends_the_rest_at_once(
        pushed):
    """A gloo operation completes to one wait only: the watch ends its member's operations
    through a receive of its own, never by waiting on the owner's (which took the arrived
    bucket's completion and left the owner waiting out the group's timeout: a failed staged
    push held the engine's shutdown request 120 s, 2 runs of 5 before this fix)."""
    outcomes = pushed["watch"]
    assert outcomes[0][:2] == ("arrived", [7.0] * 4), outcomes
    assert outcomes[1][0] == "ended" and outcomes[2][0] == "ended", outcomes
    assert all(seconds < TIMEOUT_S / 12 for *_, seconds in outcomes.values()), outcomes


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "streamed"])
def test_a_rank_whose_send_fails_ends_the_push_at_once_with_its_own_error(staged, pushed):
    engine, rank0, rank1 = pushed["staged_send_fails" if staged else "streamed_send_fails"]
    paths = engine.fake.paths()
    problem = rank0[0]["problem"]
    assert "trainer rank 1" in problem and "meta tensor" in problem, problem
    # rank 0 was sending its own buckets when rank 1 failed: it stopped within a poll, not at
    # the gloo timeout of the send the worker would never have taken
    assert rank0[0]["seconds"] < TIMEOUT_S / 4, rank0
    assert rank1[0]["problem"] in problem
    if staged:  # the failed send failed the push before the pause: the engine serves on
        assert not any(p.startswith("/pause") for p in paths), paths
        assert engine.staged_bytes() == 0
    else:  # paused for the transfer, and left paused: never resumed on half an update
        assert "/pause" in {p.split("?")[0] for p in paths} and "/resume" not in paths
        assert "stays paused" in problem


def test_the_store_holds_as_many_keys_after_20_pushes_as_after_one(pushed):
    engine, rank0, _ = pushed["twenty_pushes"]
    assert all(row["problem"] is None for row in rank0), rank0
    assert [row["keys"] for row in rank0] == [rank0[0]["keys"]] * 20
    assert _holds(engine.weights[0], _expected(2, 20))


def test_a_group_attempt_that_fails_on_one_member_is_retried_and_the_push_lands(pushed):
    engine, rank0, rank1 = pushed["retried_group"]
    assert rank0[0]["problem"] is None and rank1[0]["problem"] is None
    assert all(torch.equal(engine.weights[0][n], t) for n, t in _expected(2).items())


def test_a_group_that_fails_every_attempt_fails_the_push_naming_the_failing_member(pushed):
    problem = pushed["failed_group"][1][0]["problem"]
    assert "did not form in 3 attempts" in problem and "engine worker 0" in problem, problem


def test_push_dtype_sends_each_tensor_in_the_dtype_the_engine_holds_it_in(pushed):
    engine, rank0, _ = pushed["push_dtype"]
    assert rank0[-1]["problem"] is None
    weights, held = engine.weights[0], engine.held
    for name, tensor in _expected(2, 2).items():
        if name in held:  # the trainer's own fp32 bits, not bf16-rounded ones
            assert weights[name].dtype == torch.float32 and torch.equal(weights[name], tensor)
        else:
            assert torch.equal(weights[name], tensor.to(torch.bfloat16))


def test_the_push_store_listens_only_on_the_address_the_engines_reach(pushed):
    # the engines on 127.0.0.1, the ranks on this host: another address of this host
    # (127.0.0.2) finds nothing listening on the store's port
    assert pushed["twenty_pushes"][1][-1]["bound"] == {"127.0.0.1": True, "127.0.0.2": False}


def _bf16(world: int, step: int) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in _expected(world, step).items()}


def _holds(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return weights.keys() == expected.keys() and all(
        torch.equal(weights[n], t) for n, t in expected.items())


@pytest.mark.parametrize("scenario", ["sparse", "sparse_streamed"])
def test_a_sparse_push_sends_only_what_changed_in_the_engines_dtype_and_lands_as_a_dense_one(
        scenario, pushed):
    engine, rank0, _ = pushed[scenario]
    assert [row["problem"] for row in rank0] == [None] * len(rank0)
    assert [row["mode"] for row in rank0] == ["dense"] + ["sparse"] * (len(rank0) - 1)
    # step 2: every 50th element of a quarter of the tensors changed (0.5 % of the elements),
    # each costing its int32 index and its bf16 value against 4 dense fp32 bytes; step 3: one
    # tensor of four changed whole as well, sent dense
    changed, total = rank0[1]["changed"]
    assert 0 < changed / total < 0.01 and rank0[1]["bytes"] < rank0[0]["bytes"] / 50
    if len(rank0) > 2:
        changed, total = rank0[2]["changed"]
        assert 0.25 < changed / total < 0.26 and rank0[2]["bytes"] < rank0[0]["bytes"] / 6
    # exactly what a dense push of the last step leaves in a bf16 engine
    assert _holds(engine.weights[0], _bf16(2, len(rank0)))


def test_an_engine_with_data_and_tensor_parallelism_gets_every_tensor_in_every_replica(pushed):
    engine, rank0, _ = pushed["dp2_tp2"]
    assert [row["problem"] for row in rank0] == [None, None, None]
    assert [row["mode"] for row in rank0] == ["dense", "sparse", "dense"]  # dense_every 2
    assert "/get_world_size?include_dp=true" in engine.fake.paths()
    expected = _bf16(2, 3)
    for worker in engine.workers:  # vLLM's worker order: replica, then rank in the replica
        assert worker.index == 2 * worker.replica + worker.rank
        shard = {n: t[32 * worker.rank:32 * (worker.rank + 1)] for n, t in expected.items()}
        assert _holds(worker.loaded, shard), worker.index


@pytest.mark.parametrize("scenario, push", [("restarted", 2), ("interrupted_patch", 1)])
def test_a_sparse_push_the_engine_cannot_take_is_followed_by_a_dense_one_and_lands_whole(
        scenario, push, pushed):
    engine, rank0, rank1 = pushed[scenario]
    row = rank0[push]
    assert row["problem"] is None and row["reanchored"] and row["mode"] == "dense", row
    assert rank1[push]["reanchored"]
    assert _holds(engine.weights[0], _bf16(2, len(rank0)))


@pytest.mark.parametrize("scenario, tensor, says", [
    ("corrupted", "r1.t2", "holds other values than this push sent"),
    ("dropped", "r0.t3", "the engine holds it nowhere")])
def test_a_push_whose_delivery_check_fails_is_one_line_naming_the_tensor(scenario, tensor,
                                                                          says, pushed):
    problem = pushed[scenario][1][0]["problem"]
    assert problem is not None and "the delivery check failed" in problem, problem
    assert f"{tensor}: " in problem and says in problem and "\n" not in problem


def test_without_verify_push_a_sparse_push_lands_and_no_checksum_is_compared(pushed):
    """publish.verify_push false: the engine still reports where each tensor lies (the patches
    need it), but nothing is checksummed, so a tensor it holds as zeros goes unnoticed."""
    engine, rank0, _ = pushed["unverified"]
    assert [(row["problem"], row["mode"]) for row in rank0] == [(None, "dense"), (None, "sparse")]
    assert not engine.weights[0]["r1.t2"].any()

