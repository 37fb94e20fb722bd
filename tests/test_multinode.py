"""Two "nodes" on one host, one launcher each, train a job at SP 2 to the losses of one node.

Each node is one launcher process with one rank (`--nnodes 2 --node_rank i --nproc_per_node 1`
for torchrun with static rendezvous; `deepspeed --hostfile H --no_ssh --node_rank i` for the
DeepSpeed launcher), so the SP group of 2 ranks spans both nodes and every all-to-all, the
DeltaNet state hand-over and the ZeRO-2 partitions cross the "node" boundary. The reference is
the same world size on one node (torchrun --nproc_per_node 2): the same ranks run the same
computation with the same reductions, so the losses must be bitwise equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.launching import REPO, _tool, assert_ok, free_port, run_nodes, run_vlmcp, tiny_job, \
    train_losses, write_job

pytestmark = pytest.mark.e2e

NODES = 2


def _job(checkpoint: Path, data: Path, out: Path) -> Path:
    return write_job(out / "job.json", tiny_job(
        checkpoint, data / "train.jsonl", out / "run", parallel={"sp_size": 2},
        deepspeed=str(REPO / "ds_configs" / "zero2.json")))


def _node_commands(launcher: str, job: Path, port: int, hostfile: Path) -> list[list[str]]:
    """One launcher command per node, all meeting at 127.0.0.1:port."""
    if launcher == "torchrun":
        return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                 "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                 "--master_port", str(port), "-m", "vlmcp", "train", str(job)]
                for node in range(NODES)]
    return [[_tool("deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
             str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), "--module",
             "vlmcp", "train", str(job)] for node in range(NODES)]


@pytest.fixture(scope="module")
def one_node_losses(tiny_checkpoint, digits_jsonl, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("one_node")
    assert_ok(run_vlmcp(["train", str(_job(tiny_checkpoint, digits_jsonl, out))],
                        launcher="torchrun", nproc=NODES, timeout=300))
    return train_losses(out / "run")


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_two_nodes_train_sp2_to_the_losses_of_one_node(
        launcher, tiny_checkpoint, digits_jsonl, tmp_path, one_node_losses):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i} slots=1\n" for i in range(NODES)))
    job = _job(tiny_checkpoint, digits_jsonl, tmp_path)
    results = run_nodes(_node_commands(launcher, job, free_port(), hostfile), timeout=300)
    for result in results:
        assert_ok(result)
    assert "world 2 = sp 2 x dp 1, ZeRO stage 2" in results[0].stderr
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 2
    assert losses == one_node_losses
