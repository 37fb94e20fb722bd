"""`make gpu-check` (= `python scripts/gpu_check.py`, from a checkout): every CUDA check of vlmcp on
one GPU, one JSON report, within a time budget (default 9 minutes, the install included).

Steps:
  1. No CUDA device (torch sees none): the report says so and the check exits 2 at once, before
     anything is installed or imported from vlmcp.
  2. The wheels in `--wheels` (`make gpu-wheels` puts them in .whl/) are installed with
     `pip install --no-index --no-deps --target` into a temporary directory that goes first on
     PYTHONPATH for every part: nothing outside it changes, and no torch or triton wheel is
     accepted (the machine's own torch is used as it is, whatever its version).
  3. Parts, each in its own process under its own timeout (cut to what is left of the budget):
       cuda_kernels       pytest tests/cuda/test_cuda_kernels.py: the delta rule through vlmcp's pure-
                          torch kernel and through fla's (where the version gate allows fla), the
                          attention kernels, the DeltaNet conv; against float64 / CPU references
       loss_terms         pytest tests/cuda/test_cuda_loss_terms.py: every objective and option
                          (mismatch at both levels, several terms, pairs) and the chunked logprobs
                          with the model-side tensors on the GPU and the batch on the host, as in
                          training; against the same run on CPU
       deltanet_sp2_gloo  pytest tests/cuda/test_cuda_deltanet_sp.py: the DeltaNet hook at SP 2, two
                          ranks on cuda:0 over gloo, each kernel as above, against the CPU hook
       publish_staging    pytest tests/cuda/test_cuda_publish.py: a background publish's copy after
                          a real DeepSpeed step (ZeRO 2, 3) holds that step's weights bitwise, and
                          its pinned buffers take the host memory the publisher counts (`measured`)
       bench_bf16         vlmcp bench --dtype bfloat16 at --seq-lens, once plain
       bench_bf16_memory  and once with gradient checkpointing, train.tiled_mlp and
                          train.offload_activations
       compare_alst       vlmcp bench --compare-alst at 16k tokens (SP 1)
     Each records the DeltaNet kernel it ran (`kernels`): the pytest parts from their test ids
     ([torch], [fla]: passed, or skipped with the gate's reason), the bench parts from the
     bench's `deltanet_kernel_ran`. The bench parts also record the MFU of every length
     (`mfu`: seq_len -> mfu, both sides' for compare_alst) against the peak the bench used
     (`peak_tflops`, `peak_source`: the GPU's published dense peak). The benches run `model.deltanet_kernel` auto where the gate
     lets fla run, else torch (`deltanet_kernel_choice` says why).

The pytest parts run with VLMCP_TEST_CUDA=1 (the suite hides GPUs otherwise) and
TRITON_F32_DEFAULT=ieee (fla's fp32 dots in IEEE fp32, for the strict bounds); the benches with
Triton's defaults, as training does. The report is rewritten after every part, so a run cut short
keeps what finished. Exit status: 0 when every part passed, 1 when one failed, 2 without a CUDA
device.
"""

from __future__ import annotations

import argparse
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
PACKAGES = ["torch", "triton", "flash-linear-attention", "fla-core", "flash-attn", "transformers",
            "deepspeed", "peft", "accelerate", "vlmcp"]
#: Never installed from the wheel set: the machine's own builds stay in use.
NEVER_INSTALLED = ("torch", "triton")
TAIL_CHARS = 4000
#: Seconds for the whole check (install included) and each part's own limit.
BUDGET_S = 540.0
PART_LIMITS_S = {"install": 60, "cuda_kernels": 90, "loss_terms": 60, "deltanet_sp2_gloo": 90,
                 "publish_staging": 60, "bench_bf16": 75, "bench_bf16_memory": 75,
                 "compare_alst": 90}
MEMORY_FLAGS = ["--gradient-checkpointing", "--tiled-mlp", "--offload-activations"]


class Deadline:
    """What is left of the check's budget."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def limit(self, part: str) -> float:
        return max(1.0, min(PART_LIMITS_S[part], self.end - time.monotonic()))


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run `cmd` in the checkout; returns command, returncode (None on timeout), seconds, output tail."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        output = f"{_text(exc.stdout)}{_text(exc.stderr)}\ntimed out after {timeout_s:.0f} s"
    return {"command": " ".join(cmd), "returncode": returncode, "timeout_s": round(timeout_s),
            "duration_s": round(time.perf_counter() - started, 1), "output_tail": output[-TAIL_CHARS:]}


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def install_wheels(wheels: Path, target: Path, timeout_s: float) -> dict[str, Any]:
    """pip install --no-index --no-deps --target `target` of every wheel in `wheels`."""
    files = sorted(wheels.glob("*.whl"))
    refused = [f.name for f in files if f.name.split("-")[0].lower() in NEVER_INSTALLED]
    step: dict[str, Any] = {"wheels": [f.name for f in files], "target": str(target)}
    if refused or not files:
        step.update(passed=False, errors=[f"refusing to install {refused}: the machine's own build "
                                          "is used" if refused else f"no wheels in {wheels} (run make gpu-wheels "
                                          "on a machine with registry access)"])
        return step
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--target", str(target), *map(str, files)]
    step.update(_run(cmd, dict(os.environ), timeout_s))
    step["errors"] = [] if step["returncode"] == 0 else [f"pip exited with {step['returncode']}"]
    step["passed"] = not step["errors"]
    return step


def environment(env: dict[str, str]) -> dict[str, Any]:
    """Versions (as the parts will see them), the GPU, and the DeltaNet kernel the benches use."""
    probe = (
        "import importlib.metadata as m, json, torch\n"
        f"names = {PACKAGES!r}\n"
        "def version(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return None\n"
        "from vlmcp.model.deltanet_kernel import installed_fla_problem\n"
        "p = torch.cuda.get_device_properties(0)\n"
        "print(json.dumps({'python': __import__('sys').version.split()[0],"
        " 'packages': {n: version(n) for n in names}, 'torch_cuda': torch.version.cuda,"
        " 'gpu': p.name, 'capability': f'{p.major}.{p.minor}',"
        " 'gpu_memory_gib': round(p.total_memory / 2**30, 1), 'gpus': torch.cuda.device_count(),"
        " 'fla_gate': installed_fla_problem(torch.device('cuda', 0))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode:
        return {"error": proc.stderr[-TAIL_CHARS:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def kernels_of_tests(tests: dict[str, dict[str, str]]) -> dict[str, str]:
    """Per DeltaNet kernel in the test ids ([torch], [fla]): "ran" when a test of it passed, else
    its tests' outcome and message (a gated fla is skipped with the gate's reason)."""
    kernels: dict[str, str] = {}
    for name, result in tests.items():
        for kernel in ("torch", "fla"):
            if f"[{kernel}]" in name:
                if result["outcome"] == "passed":
                    kernels[kernel] = "ran"
                else:
                    kernels.setdefault(kernel, f"{result['outcome']}: {result['message'][:300]}")
    return kernels


def pytest_part(test_file: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """The `cuda` tests of `test_file`: each one's outcome, the DeltaNet kernels they ran, and
    what they measured (`measured`: the JSON lines they appended to VLMCP_GPU_CHECK_NOTES)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml, notes = Path(tmp) / "junit.xml", Path(tmp) / "notes.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
               f"--junitxml={xml}", test_file]
        part = _run(cmd, {**env, "VLMCP_TEST_CUDA": "1", "TRITON_F32_DEFAULT": "ieee",
                          "VLMCP_GPU_CHECK_NOTES": str(notes)}, timeout_s)
        part["tests"] = _junit_results(xml)
        if notes.exists():
            part["measured"] = [json.loads(line) for line in notes.read_text().splitlines()]
    outcomes = [t["outcome"] for t in part["tests"].values()]
    part["kernels"] = kernels_of_tests(part["tests"])
    part["errors"] = [f"{name}: {t['message']}" for name, t in part["tests"].items()
                      if t["outcome"] in ("failed", "error")]
    if part["returncode"] != 0 and not part["errors"]:
        part["errors"].append(f"pytest exited with {part['returncode']}; see output_tail")
    if "passed" not in outcomes:
        part["errors"].append(f"no test passed (outcomes: {sorted(set(outcomes)) or 'none collected'})")
    part["passed"] = part["returncode"] == 0 and not part["errors"]
    return part


def bench_part(args: list[str], out: Path, env: dict[str, str], timeout_s: float,
               expected: list[int]) -> dict[str, Any]:
    """`vlmcp bench ARGS --out OUT`; its rows, which DeltaNet kernel they ran, and errors."""
    cmd = [sys.executable, "-m", "vlmcp", "bench", *args, "--out", str(out)]
    out.unlink(missing_ok=True)
    part = _run(cmd, env, timeout_s)
    report = json.loads(out.read_text()) if out.exists() else {}
    part["report_file"] = str(out)
    part["results"] = report.get("results", [])
    part["kernels"] = sorted({row["deltanet_kernel_ran"] for row in part["results"] if "deltanet_kernel_ran" in row})
    part["mfu"] = mfu_by_length(part["results"])
    part["peak_tflops"], part["peak_source"] = report.get("peak_tflops"), report.get("peak_source")
    measured = {row.get("seq_len") for row in part["results"] if "error" not in row}
    part["errors"] = [f"no result for seq_len {n}" for n in expected if n not in measured]
    if part["returncode"] != 0:
        part["errors"].append(f"vlmcp bench exited with {part['returncode']}; see output_tail")
    part["passed"] = not part["errors"]
    return part


def mfu_by_length(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A bench report's MFU per length: a step row's `mfu`, a compare-alst row's {"vlmcp", "alst"}
    medians; None where the row has none (an error row, or a GPU without a known peak)."""
    return {str(row.get("seq_len")): row.get("mfu") for row in results}


def _write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def _no_gpu(report: dict[str, Any], out: Path) -> int:
    report["error"] = "no CUDA device: torch sees no GPU"
    _write(report, out)
    print(f"gpu-check: {report['error']}; nothing was run (report: {out})", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu-check.json", help="the JSON report")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="wheels to install first (make gpu-wheels)")
    parser.add_argument("--seq-lens", default="16384,65536,131072", help="bench pack lengths")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole check")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    deadline = Deadline(args.budget_s)
    report: dict[str, Any] = {"passed": False, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "budget_s": args.budget_s, "checks": {}}
    import torch

    if os.environ.get("DS_ACCELERATOR", "cuda") != "cuda" or not torch.cuda.is_available():
        return _no_gpu(report, out)
    with tempfile.TemporaryDirectory(prefix="vlmcp-gpu-site-") as site:
        install = install_wheels(Path(args.wheels), Path(site), deadline.limit("install"))
        report["install"] = install
        _write(report, out)
        if not install["passed"]:
            print(f"gpu-check: installing the wheels failed: {install['errors']}", file=sys.stderr)
            return 1
        env = {**os.environ, "DS_ACCELERATOR": "cuda",
               "PYTHONPATH": os.pathsep.join(filter(None, [site, str(ROOT), os.environ.get("PYTHONPATH")]))}
        report["environment"] = environment(env)
        kernel = "torch" if report["environment"].get("fla_gate") else "auto"
        report["deltanet_kernel_choice"] = {"bench_kernel": kernel,
                                            "why": report["environment"].get("fla_gate") or "fla is not gated"}
        _write(report, out)
        _run_parts(report, args, env, kernel, deadline, out)
    report["passed"] = all(part["passed"] for part in report["checks"].values())
    _write(report, out)
    for name, part in report["checks"].items():
        print(f"gpu-check {name}: {'pass' if part['passed'] else 'FAIL'} ({part['duration_s']} s, "
              f"kernels {part.get('kernels')}" + (f", mfu {part['mfu']}" if part.get("mfu") else "") + ")")
        for error in part["errors"]:
            print(f"  {error.splitlines()[0] if error else error}")
    print(f"gpu-check: report in {out}")
    return 0 if report["passed"] else 1


def _run_parts(report: dict[str, Any], args: argparse.Namespace, env: dict[str, str], kernel: str,
               deadline: Deadline, out: Path) -> None:
    lengths = [int(n) for n in args.seq_lens.split(",")]
    parts = {
        "cuda_kernels": lambda limit: pytest_part("tests/cuda/test_cuda_kernels.py", env, limit),
        "loss_terms": lambda limit: pytest_part("tests/cuda/test_cuda_loss_terms.py", env, limit),
        "deltanet_sp2_gloo": lambda limit: pytest_part("tests/cuda/test_cuda_deltanet_sp.py", env, limit),
        "publish_staging": lambda limit: pytest_part("tests/cuda/test_cuda_publish.py", env, limit),
        "bench_bf16": lambda limit: bench_part(
            ["--dtype", "bfloat16", "--seq-lens", args.seq_lens, "--steps", "2", "--warmup", "1",
             "--deltanet-kernel", kernel], out.with_name(out.stem + "-bench.json"), env, limit, lengths),
        "bench_bf16_memory": lambda limit: bench_part(
            ["--dtype", "bfloat16", "--seq-lens", args.seq_lens, "--steps", "2", "--warmup", "1",
             "--deltanet-kernel", kernel, *MEMORY_FLAGS], out.with_name(out.stem + "-bench-memory.json"),
            env, limit, lengths),
        "compare_alst": lambda limit: bench_part(
            ["--compare-alst", "--seq-lens", "16384", "--steps", "2", "--warmup", "1", "--repeats", "1"],
            out.with_name(out.stem + "-alst.json"), env, limit, [16384]),
    }
    for name, run in parts.items():
        report["checks"][name] = run(deadline.limit(name))
        _write(report, out)


if __name__ == "__main__":
    sys.exit(main())
