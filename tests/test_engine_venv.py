"""Which engine venv counts, and what happens without one: only a venv holding the stamp its build
writes last is the engine venv (`vlmcp.engine.venv`), the build script and the Makefile name the
same stamp, and without the venv the engine tests and `make test` skip with a line on a
developer's machine but fail in CI."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest

from tests.helpers.engine_reference import in_ci, require_engine
from tests.helpers.launching import REPO
from vlmcp.engine.venv import STAMP, engine_python, missing_engine


def test_only_a_venv_holding_the_build_stamp_counts_as_the_engine_venv(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setenv("VLMCP_ENGINE_PYTHON", str(python))
    assert engine_python() is None and "does not exist" in missing_engine(python)
    python.parent.mkdir(parents=True)
    python.write_text("")  # the interpreter is there from the build's first minute
    assert engine_python() is None
    assert f"not finished: no {tmp_path / 'venv' / STAMP}" in missing_engine(python)
    (tmp_path / "venv" / STAMP).write_text("digest\n")
    assert engine_python() == python and missing_engine(python) is None


def test_the_build_script_and_the_makefile_name_the_stamp_the_engine_venv_is_judged_by():
    spec = importlib.util.spec_from_file_location("engine_venv_script",
                                                  REPO / "scripts" / "engine_venv.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.STAMP == STAMP
    (line,) = re.findall(r"^ENGINE_STAMP :=.*$", (REPO / "Makefile").read_text(), re.M)
    assert line == f"ENGINE_STAMP := $(ENGINE_VENV)/{STAMP}"


def test_an_engine_test_without_the_engine_venv_skips_naming_why_but_fails_in_ci():
    assert [in_ci({"CI": v}) for v in ("true", "TRUE", "1", "", "false", "0")] == \
           [True, True, True, False, False, False]
    assert not in_ci({})
    require_engine(None, ci=True)
    with pytest.raises(pytest.skip.Exception, match="no engine venv: X"):
        require_engine("no engine venv: X", ci=False)
    with pytest.raises(pytest.fail.Exception, match=r"must run in CI .*no engine venv: X"):
        require_engine("no engine venv: X", ci=True)


@pytest.mark.e2e
@pytest.mark.parametrize("ci", ["true", ""])
def test_make_test_fails_when_the_engine_venv_cannot_be_built_in_ci_and_skips_with_a_line_else(
        tmp_path, ci):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\necho "pytest ran"\n')
    (fake / "python").chmod(0o755)
    (tmp_path / "stamp").write_text("")  # newer than pyproject.toml: no install
    done = subprocess.run(["make", "-s", "-C", str(REPO), "test", "ENGINE_BUILD=false",
                           f"STAMP={tmp_path / 'stamp'}", f"BIN={fake}"],
                          env={**os.environ, "CI": ci}, capture_output=True, text=True,
                          timeout=60)
    if ci:
        assert done.returncode != 0 and "pytest ran" not in done.stdout
        assert "make test: no engine venv under CI=true, so the run fails" in done.stdout
    else:
        assert done.returncode == 0 and "pytest ran" in done.stdout
        assert "make test: no engine venv, so the engine tests skip" in done.stdout
