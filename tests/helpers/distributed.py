"""Run a function on P real processes that talk over gloo (no mocks).

`run_ranks(fn, world_size, *args)` spawns `world_size` processes; each starts torch.distributed
and deepspeed.comm through `vlmcp.parallel.comm.init_distributed` (gloo on CPU), runs
`fn(*args)` and returns what it returned, per rank. A failing rank fails the call (mp.spawn ends
the others) instead of hanging. `env` overrides the ranks' environment (the CUDA tests put every
rank on one GPU over gloo with DS_ACCELERATOR=cuda, VLMCP_DIST_BACKEND=gloo, LOCAL_RANK=0).

Each rank runs `rank_threads()` OpenMP threads: 1, or VLMCP_TEST_RANK_THREADS when set (e.g. 2, to
check that no bound depends on the thread count); tests/launching.py gives `vlmcp` runs the same.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


#: Environment variable: OpenMP threads per process the suite starts (default 1).
RANK_THREADS_ENV = "VLMCP_TEST_RANK_THREADS"


def rank_threads() -> int:
    """Threads per rank of the processes the suite starts: VLMCP_TEST_RANK_THREADS, default 1."""
    return int(os.environ.get(RANK_THREADS_ENV, "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict[str, str]
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(rank_threads()),
            "DS_ACCELERATOR": "cpu",
            **env,
        }
    )
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from vlmcp.parallel import comm

    comm.init_distributed(timeout_s=300)
    result = fn(*args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    comm.barrier()
    torch.distributed.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    """[fn(*args) on rank 0, ..., on rank world_size-1], each computed in its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_args = (world_size, free_port(), out_dir, fn, args, env or {})
        mp.spawn(_entry, args=spawn_args, nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
