"""Which engine venv counts: only one that `scripts/engine_venv.py` finished, i.e. holds its stamp.

The engine venv (vLLM for CPU, `make engine`) is a venv of its own beside vlmcp's. Its
`bin/python` appears as soon as the build starts, minutes before vLLM is installed and imports,
so the Python alone does not make a venv usable: the build writes `STAMP` into the venv last,
after `import vllm` worked there, and only a venv holding it counts. The same rule holds for a
venv named by `$VLMCP_ENGINE_PYTHON` (a path to its Python, `VENV/bin/python`): its stamp is looked
for in `VENV`, the folder two levels above that path (not resolved, since a venv's Python is a
link to the base interpreter). Build such a venv with `python scripts/engine_venv.py --venv VENV`,
or vouch for one built by hand with `touch VENV/.vlmcp-engine-installed`.

`STAMP` is the one definition of the stamp's name: the build script imports it, and the Makefile's
`ENGINE_STAMP` spells the same name (`tests/test_engine_venv.py` holds them equal). Standard
library only: the build script runs with a bare `python3`.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The file a finished engine venv holds (its content: the hash of the constraints it was built
#: with and that of the vlmcp engine code installed into it, which `scripts/engine_venv.py`
#: compares to skip a rebuild).
STAMP = ".vlmcp-engine-installed"
#: The engine venv `make engine` builds, beside the checkout's `vlmcp/`.
CHECKOUT_ENGINE_PYTHON = Path(__file__).resolve().parents[2] / ".venv-engine" / "bin" / "python"


def named_engine_python() -> Path:
    """The engine Python asked for: $VLMCP_ENGINE_PYTHON, else the checkout's .venv-engine's
    (whether or not it exists)."""
    named = os.environ.get("VLMCP_ENGINE_PYTHON")
    return Path(named) if named else CHECKOUT_ENGINE_PYTHON


def missing_engine(python: str | Path) -> str | None:
    """Why `python` (VENV/bin/python) is not a finished engine venv's Python, in one line naming
    what to do; None when it is (it exists and VENV holds `STAMP`)."""
    python = Path(python)
    stamp = python.parent.parent / STAMP
    if not python.exists():
        return (f"no engine venv: {python} does not exist (`make engine` builds .venv-engine; "
                "VLMCP_ENGINE_PYTHON names another venv's python)")
    if not stamp.is_file():
        return (f"the engine venv of {python} is not finished: no {stamp} (its build was "
                "interrupted or is still running: `make engine` completes it; a venv built by "
                f"hand counts once `touch {stamp}` vouches for it)")
    return None


def engine_python() -> Path | None:
    """The finished engine venv's Python (`named_engine_python`), or None when there is none."""
    python = named_engine_python()
    return None if missing_engine(python) else python
