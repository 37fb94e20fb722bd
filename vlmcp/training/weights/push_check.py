"""The delivery check of a push into an engine, on the trainer's side (publish.verify_push).

After a push, each engine worker reports where every pushed tensor lies in it and the checksum of
each place, read from what it computes with (vlmcp/engine/vllm_held.py, the session's
`report/<worker>` keys: {"worker", "replica", "token", "names": {name: [[source region, dtype,
digest], ...]}}). Every trainer rank checks the tensors of its own share against them
(`check_share`): each tensor must be held by every data-parallel replica of the engine, every
element of it by some worker of the replica (a tensor-parallel worker holds its shard, a
replicated parameter is held whole by each), and each place's checksum must be the checksum of
the same region of the rank's tensor in the dtype the engine holds it in (push_patch.digest_of).
So a tensor the loader dropped, one the engine never loaded (it holds the values of an older
step), a zero or stale value anywhere, and a report from another push all fail, each as one line
naming the tensor. Which dtype the engine holds each tensor in (`held_dtypes`) is what a sparse
push computes its delta in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmcp.engine.push_patch import Region, digest_of


@dataclass
class CheckResult:
    """What the reports say of one rank's share: `problems` (one line per tensor), `dtypes`
    {name: the dtype the engine holds it in}, `patchable` (every element of every tensor held
    somewhere on every replica: the engine can take patches of the share), `checked` bytes."""

    problems: list[str] = field(default_factory=list)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    patchable: bool = True
    checked: int = 0


def check_share(share: dict[str, torch.Tensor], reports: list[dict[str, Any]], token: str,
                *, digests: bool) -> CheckResult:
    """Check `share` ({name: the tensor this rank pushed}) against every worker's report of the
    push `token` (see the module docstring); with `digests`, the checksums too."""
    result = CheckResult()
    replicas: dict[int, list[dict[str, Any]]] = {}
    for report in reports:
        worker = report.get("worker")
        if "error" in report:
            result.problems.append(f"engine worker {worker} could not report what it holds: "
                                   f"{report['error']}")
            return result
        if report.get("token") != token:
            result.problems.append(f"engine worker {worker} reports version "
                                   f"{report.get('token')}, not this push's {token}")
            return result
        replicas.setdefault(int(report.get("replica", 0)), []).append(report)
    for name, tensor in share.items():
        result.problems += _check_tensor(name, tensor, replicas, digests, result)
    return result


def _check_tensor(name: str, tensor: torch.Tensor, replicas: dict[int, list[dict[str, Any]]],
                  digests: bool, result: CheckResult) -> list[str]:
    problems = []
    for replica, reports in sorted(replicas.items()):
        rows = [(report["worker"], row) for report in reports
                for row in report["names"].get(name, [])]
        where = f" (data-parallel replica {replica})" if len(replicas) > 1 else ""
        if not rows:
            result.patchable = False
            problems.append(f"{name}: the engine holds it nowhere{where}: its loader did not "
                            "place it into any parameter")
            continue
        covered = torch.zeros(tensor.numel(), dtype=torch.bool)
        for worker, (source, dtype_name, value) in rows:
            region = Region.from_json(source)
            dtype = getattr(torch, dtype_name)
            result.dtypes.setdefault(name, dtype)
            region.read(covered).fill_(True)
            if digests:
                result.checked += region.numel * dtype.itemsize
                if value != digest_of(tensor.to(dtype), region):
                    problems.append(f"{name}: engine worker {worker} holds other values than "
                                    f"this push sent{where} (elements {region.offset}.. of "
                                    f"{tuple(region.sizes)}, as {dtype_name})")
        missing = int((~covered).sum())
        if missing:
            result.patchable = False
            problems.append(f"{name}: the engine holds {tensor.numel() - missing} of its "
                            f"{tensor.numel()} elements{where}")
    return problems
