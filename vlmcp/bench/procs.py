"""Memory readings and fresh rank processes for `vlmcp bench`.

Memory is in MiB: CUDA allocated bytes of a device, else the process's resident set from
/proc/PID/status (Linux): VmRSS now, VmHWM its peak, which `/proc/self/clear_refs` resets.
`run_fresh` starts a world of new CPU processes over gloo for one measurement, so that a peak
belongs to that measurement alone, and can stop them when a rank's resident set passes a limit.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch

from vlmcp.parallel import comm

class Memory:
    """Memory of this process in MiB: CUDA allocated bytes of `device`, else the resident set."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_allocated" if device.type == "cuda" else "cpu_rss"

    def current_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20
        return _proc_status_mb("VmRSS")

    def reset_peak(self) -> bool:
        """Start a new peak from the current memory; False when the OS does not allow it."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    def fragmentation_mb(self) -> float | None:
        """CUDA: reserved - allocated at their peaks (what the caching allocator holds beyond the
        tensors); None on CPU."""
        if self.device.type != "cuda":
            return None
        return (torch.cuda.max_memory_reserved(self.device)
                - torch.cuda.max_memory_allocated(self.device)) / 2**20

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            return _proc_status_mb("VmHWM")
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _proc_status_mb(field: str, pid: int | str = "self") -> float:
    """A memory line of /proc/PID/status (kB) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise OSError(f"/proc/{pid}/status has no {field}")


def _rank_entry(rank: int, world: int, port: int, threads: int, out_dir: str, task: Any, distributed: bool,
                device: str) -> None:
    """Body of one fresh rank process: join the world over gloo, run `task`, write rank 0's row."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)})
    torch.set_num_threads(threads)
    if distributed:
        comm.init_distributed(timeout_s=600)
    row = task.run(torch.device(device))
    if rank == 0:
        Path(out_dir, "row.json").write_text(json.dumps(row))
    if distributed:
        comm.barrier()
        comm.shutdown()


class MemoryLimitExceeded(RuntimeError):
    """A fresh-process run stopped because a rank's resident set passed the limit."""


def run_fresh(task: Any, world: int, *, distributed: bool = True, limit_mb: float | None = None,
              device: str = "cpu") -> dict[str, Any]:
    """Run `task` on `world` new processes (gloo when `distributed`) on `device` ("cpu", or
    "cuda" for one process); rank 0's row.

    Each rank gets `OMP_NUM_THREADS` = this process's threads / world (at least 1). With
    `limit_mb`, a rank whose resident set passes it is stopped with its peers, and
    MemoryLimitExceeded is raised. A failing rank stops the others and raises.
    """
    import torch.multiprocessing as mp

    threads = max(1, torch.get_num_threads() // world)
    with tempfile.TemporaryDirectory(prefix="vlmcp-bench-") as out_dir:
        context = mp.start_processes(_rank_entry, args=(world, comm.free_local_port(), threads, out_dir, task, distributed, device),
                                     nprocs=world, join=False, start_method="spawn")
        while not context.join(timeout=0.5):
            if limit_mb is not None and _over_limit(context.pids(), limit_mb):
                for process in context.processes:
                    process.kill()
                for process in context.processes:
                    process.join()
                raise MemoryLimitExceeded(f"a rank's resident set passed {limit_mb:.0f} MiB")
        return json.loads(Path(out_dir, "row.json").read_text())


def _over_limit(pids: list[int], limit_mb: float) -> bool:
    for pid in pids:
        try:
            if _proc_status_mb("VmRSS", pid) > limit_mb:
                return True
        except OSError:
            continue
    return False
