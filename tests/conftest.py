"""Shared fixtures: tiny checkpoints, their processor, a digits dataset, a JSONL writer.

Session-scoped fixtures build each asset once per test run (a tiny checkpoint takes ~0.2 s).

A test that starts processes (ranks, launchers, the CLI in a subprocess, DataLoader workers) is
marked `e2e`, so that `pytest -m "not e2e"` is the fast part of the suite; a test that starts a
process without the mark fails, so the mark stays true.

The suite means CPU: GPUs are hidden (CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR=cpu, set before
anything touches CUDA, and inherited by every process a test starts), so `make test` on a GPU
machine runs exactly what it runs in CI. Only with VLMCP_TEST_CUDA=1 (set by `make gpu-check`)
do GPUs stay visible, for the tests marked `cuda`.
"""

from __future__ import annotations

import os

import atexit
import shutil
import tempfile

# The length index cache (data.cache_dir's default) of every run the suite starts stays in a
# temporary directory, not in the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="vlmcp-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

if os.environ.get("VLMCP_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cpu"

import json
import multiprocessing.process
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.images import save_png
from vlmcp.data.processor import VLProcessor, load_processor
from vlmcp.demo.assets import write_digits_dataset
from vlmcp.model.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a dense tiny Qwen3.5 checkpoint (published layout, seed 0)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_dense"), moe=False, seed=0)


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a tiny Qwen3.5-MoE checkpoint (published layout, seed 0)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_moe"), moe=True, seed=0)


@pytest.fixture(scope="session")
def tiny_processor(tiny_checkpoint: Path) -> VLProcessor:
    """`VLProcessor` of `tiny_checkpoint` (a 32x32 image is 2x2 patches, 1 image token)."""
    return load_processor(tiny_checkpoint)


@pytest.fixture(scope="session")
def digits_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory with train.jsonl (64 samples), eval.jsonl (16) and images/ of digits."""
    out = tmp_path_factory.mktemp("digits")
    write_digits_dataset(out, n_train=64, n_eval=16, seed=0)
    return out


@pytest.fixture
def make_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Factory: make_jsonl(lines, images={"img/a.png": (w, h)}, name="data.jsonl") -> path.

    Lines are dicts (JSON-encoded) or raw strings (written as is); images are random PNGs
    written relative to the JSONL file.
    """

    def make(
        lines: list[dict[str, Any] | str],
        images: dict[str, tuple[int, int]] | None = None,
        name: str = "data.jsonl",
    ) -> Path:
        for i, (rel, (width, height)) in enumerate((images or {}).items()):
            save_png(tmp_path / rel, width, height, seed=i)
        path = tmp_path / name
        path.write_text(
            "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
        )
        return path

    return make


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked NEEDS_ENGINE skips where the engine venv is missing, and fails in CI
    (`tests/helpers/engine_reference.py`), before its fixtures start anything."""
    if item.get_closest_marker("needs_engine") is not None:
        from tests.helpers.engine_reference import in_ci, require_engine
        from vlmcp.engine.venv import missing_engine, named_engine_python

        require_engine(missing_engine(named_engine_python()), in_ci())


@pytest.fixture(autouse=True)
def _processes_only_in_e2e_tests(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that starts a process (subprocess or multiprocessing) without the e2e mark."""
    if request.node.get_closest_marker("e2e") is not None:
        yield
        return
    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def recording_popen_init(self, args, *rest, **kwargs):
        started.append(f"subprocess {args!r:.80}")
        popen_init(self, args, *rest, **kwargs)

    def recording_start(self):
        started.append(f"process {self.name}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    yield
    if started:
        pytest.fail(f"this test starts processes ({started[0]}) but is not marked e2e")
