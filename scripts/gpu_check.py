"""`make gpu-check` (= `python scripts/gpu_check.py`, from a checkout, with the checkout on PYTHONPATH): every CUDA check of vlmcp on
one GPU, one JSON report.

Parts, each in its own process with DS_ACCELERATOR=cuda, each recorded with pass/fail, errors and
numbers:
  cuda_kernels       pytest tests/cuda/test_cuda_kernels.py: fla's varlen delta rule with per-segment
                     initial states, the attention kernels (varlen_attn bf16, fused sdpa fp32,
                     flash-attn bf16 when installed), the DeltaNet conv; all against the CPU path
  deltanet_sp2_gloo  pytest tests/cuda/test_cuda_deltanet_sp.py: the DeltaNet hook at SP 2, two ranks on
                     cuda:0 over gloo (VLMCP_DIST_BACKEND=gloo), against the same hook on CPU
  bench_bf16         vlmcp bench --dtype bfloat16 at 16k, 64k and 128k tokens

The pytest parts run with VLMCP_TEST_CUDA=1 (the suite hides GPUs otherwise) and
TRITON_F32_DEFAULT=ieee (fla's fp32 dots in IEEE fp32, for the strict bounds); the bench runs with
Triton's defaults, as training does. The report is rewritten after every part, so a run cut short
keeps what finished. A torch or flash-linear-attention below pyproject's floors fails the check
too (the parts still run and are reported). Exit status: 0 when every part passed, 1 when one
failed, 2 when there is no CUDA device (nothing runs; the report says so).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTEST_PARTS = {
    "cuda_kernels": "tests/cuda/test_cuda_kernels.py",
    "deltanet_sp2_gloo": "tests/cuda/test_cuda_deltanet_sp.py",
}
PACKAGES = ["torch", "triton", "flash-linear-attention", "flash-attn", "transformers", "deepspeed"]
#: pyproject's floors for the CUDA path: below them fla's DeltaNet backward raises or is wrong
#: (fla issue #640) and torch's varlen_attn lacks the arguments vlmcp passes.
FLOORS = {"torch": "2.13", "flash-linear-attention": "0.6.0"}
TAIL_CHARS = 4000


def _environment() -> dict[str, Any]:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    from packaging.version import Version

    below = [f"{name} {versions[name]} < {floor}" for name, floor in FLOORS.items()
             if versions[name] is None or Version(versions[name]) < Version(floor)]
    env = {"python": sys.version.split()[0], "packages": versions, "torch_cuda": torch.version.cuda,
           "below_floors": below}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    return env


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run `cmd` in the checkout; returns command, returncode (None on timeout), seconds, output tail."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        output = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout_s:.0f} s"
    return {"command": " ".join(cmd), "returncode": returncode,
            "duration_s": round(time.perf_counter() - started, 1), "output_tail": output[-TAIL_CHARS:]}


def _junit_results(path: Path) -> dict[str, dict[str, str]]:
    """pytest's junit XML -> {test id: {"outcome": passed|failed|error|skipped, "message": ...}}."""
    if not path.exists():
        return {}
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (node.get("message") or node.text or "")[:TAIL_CHARS]
        results[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": outcome, "message": message}
    return results


def pytest_part(test_file: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
               f"--junitxml={xml}", test_file]
        part = _run(cmd, {**env, "VLMCP_TEST_CUDA": "1", "TRITON_F32_DEFAULT": "ieee"}, timeout_s)
        part["tests"] = _junit_results(xml)
    outcomes = [t["outcome"] for t in part["tests"].values()]
    part["errors"] = [f"{name}: {t['message']}" for name, t in part["tests"].items()
                      if t["outcome"] in ("failed", "error")]
    if part["returncode"] != 0 and not part["errors"]:
        part["errors"].append(f"pytest exited with {part['returncode']}; see output_tail")
    if "passed" not in outcomes:
        part["errors"].append(f"no test passed (outcomes: {sorted(set(outcomes)) or 'none collected'})")
    part["passed"] = part["returncode"] == 0 and not part["errors"]
    return part


def bench_part(seq_lens: str, out: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "vlmcp", "bench", "--dtype", "bfloat16", "--seq-lens", seq_lens,
           "--steps", "2", "--warmup", "1", "--out", str(out)]
    out.unlink(missing_ok=True)
    part = _run(cmd, env, timeout_s)
    report = json.loads(out.read_text()) if out.exists() else {}
    part["report_file"] = str(out)
    part["results"] = report.get("results", [])
    measured = {row.get("seq_len") for row in part["results"]}
    missing = [n for n in (int(x) for x in seq_lens.split(",")) if n not in measured]
    part["errors"] = [f"no result for seq_len {n}" for n in missing]
    if part["returncode"] != 0:
        part["errors"].append(f"vlmcp bench exited with {part['returncode']}; see output_tail")
    part["passed"] = not part["errors"]
    return part


def _write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu-check.json", help="the JSON report")
    parser.add_argument("--seq-lens", default="16384,65536,131072", help="bench pack lengths")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per part, seconds")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    os.environ["DS_ACCELERATOR"] = "cuda"
    from vlmcp.device import use_cuda
    from vlmcp.errors import DeviceError

    report: dict[str, Any] = {"passed": False, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "environment": _environment(), "checks": {}}
    try:
        use_cuda()
    except DeviceError as exc:
        report["error"] = f"no CUDA device: {exc}"
        _write(report, out)
        print(f"gpu-check: {report['error']}; nothing was run (report: {out})", file=sys.stderr)
        return 2
    missing = [f for f in PYTEST_PARTS.values() if not (ROOT / f).exists()]
    if missing:
        print(f"gpu-check: run it from a vlmcp checkout ({', '.join(missing)} not found under {ROOT})",
              file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name, test_file in PYTEST_PARTS.items():
        report["checks"][name] = pytest_part(test_file, env, args.timeout_s)
        _write(report, out)
    report["checks"]["bench_bf16"] = bench_part(args.seq_lens, out.with_name(out.stem + "-bench.json"), env,
                                                args.timeout_s)
    below = report["environment"]["below_floors"]
    report["passed"] = not below and all(part["passed"] for part in report["checks"].values())
    _write(report, out)
    for line in below:
        print(f"gpu-check: {line} (pyproject's floor): the CUDA path is not supported there")
    for name, part in report["checks"].items():
        print(f"gpu-check {name}: {'pass' if part['passed'] else 'FAIL'} ({part['duration_s']} s)")
        for error in part["errors"]:
            print(f"  {error.splitlines()[0] if error else error}")
    print(f"gpu-check: report in {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
