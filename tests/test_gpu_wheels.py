"""The GPU check's preparation, without a GPU: the wheel-set check names a requirement that neither
the set nor the lent machine meets, a version below one, a torch wheel and a set over 64 MiB, and
accepts vlmcp's own torch floor there; every run-time requirement of vlmcp (PyAV included) is
downloaded, built or on the lent machine; `scripts/gpu_check.py` without a GPU exits 2 at once, before
it installs anything, with a report saying so; its bench parts record each length's MFU, shown
here on a real CPU bench. (`make gpu-rehearsal` does the download and the
install into a fresh --target; it needs registry access, so it is not part of the suite.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_set_check_names_each_unmet_requirement_a_carried_torch_and_the_size_limit():
    wheels = _script("gpu_wheels")
    machine = {"torch": "2.11.0", "numpy": None}
    ready = {"vlmcp": ("0.1.0", ["torch>=2.13", "deepspeed>=0.17", "numpy>=1.24"]),
             "deepspeed": ("0.19.8", ["torch", "hjson", 'tomli; python_version < "3.11"']),
             "hjson": ("3.1.0", [])}
    assert wheels.set_problems(ready, 10 * 2**20, machine) == []
    broken = {**ready, "deepspeed": ("0.19.8", ["pydantic>=2", "hjson>=4"]), "torch": ("2.13.0", [])}
    problems = wheels.set_problems(broken, 65 * 2**20, machine)
    assert any("65.0 MiB" in p for p in problems)
    assert any(p.startswith("torch must not be carried") for p in problems)
    assert any("needs pydantic>=2, which neither" in p for p in problems)
    assert any("needs hjson>=4, but the wheel set has hjson 3.1.0" in p for p in problems)


def test_every_run_time_requirement_of_vlmcp_is_carried_or_on_the_lent_machine():
    wheels = _script("gpu_wheels")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    carried = {canonicalize_name(name) for name in wheels.DOWNLOAD + wheels.BUILD}
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = [line for line in declared
               if canonicalize_name(Requirement(line).name) not in carried | wheels.LENT_MACHINE.keys()]
    assert missing == []
    assert carried & wheels.NEVER_CARRIED == set()


@pytest.mark.e2e
def test_gpu_check_without_a_gpu_exits_2_at_once_before_installing_anything(tmp_path):
    out = tmp_path / "gpu-check.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out),
                           "--wheels", str(tmp_path / "no-wheels")],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cuda"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - started < 60
    report = json.loads(out.read_text())
    assert not report["passed"] and report["error"].startswith("no CUDA device")
    assert report["checks"] == {} and "install" not in report
    assert "no CUDA device" in proc.stderr


@pytest.mark.e2e
def test_gpu_check_bench_part_records_the_mfu_of_every_length_from_a_real_bench(tmp_path):
    check = _script("gpu_check")
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    part = check.bench_part(["--seq-lens", "128,256", "--samples-per-pack", "1", "--steps", "1",
                             "--warmup", "0"], tmp_path / "bench.json", env, 300, [128, 256])
    assert part["passed"], part["output_tail"]
    assert set(part["mfu"]) == {"128", "256"} and all(mfu > 0 for mfu in part["mfu"].values())
    assert part["peak_tflops"] > 0 and part["peak_source"].startswith("measured")
    compare = [{"seq_len": 16384, "mfu": {"vlmcp": 0.3, "alst": 0.25}}, {"seq_len": 65536, "error": "x"}]
    assert check.mfu_by_length(compare) == {"16384": {"vlmcp": 0.3, "alst": 0.25}, "65536": None}
