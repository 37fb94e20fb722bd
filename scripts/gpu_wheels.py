"""The wheels the lent GPU machine lacks (`make gpu-wheels`), their checks, and a rehearsal of the
GPU check's install (`make gpu-rehearsal`), all runnable on a machine without a GPU.

The lent machine (one H200) runs Python 3.12 on manylinux x86_64 with torch 2.11.0+cu130, triton
3.6.0, transformers 5.17.0, accelerate 1.15.0 and peft, has no deepspeed and no
flash-linear-attention, reaches no package registry, and takes at most 64 MiB of files with the
working tree. `LENT_MACHINE` holds what its image has.

  download  into --dir (default .whl/, git-ignored): the published Python 3.12 / manylinux x86_64
            wheels of `DOWNLOAD` at constraints.txt's versions (the versions the suite passed
            with); a deepspeed wheel built here with `pip wheel --no-deps` (it publishes only an
            sdist; its ops compile on first use); vlmcp's own wheel from this checkout. Then `check`.
  check     the set and the checkout's tracked files together within `LIMIT_BYTES` (both travel
            to the machine), one version per package, no torch or triton, and every
            requirement (markers evaluated for Python 3.12 on Linux x86_64) met by a wheel of the
            set or by the lent machine (where its version is known, the version too). Exit 1,
            naming each problem, otherwise.
  rehearse  `check`, then the set installs into a fresh `--target` with this machine's pip (for
            Python 3.12 / manylinux tags, `--no-index --no-deps`), `import vlmcp` works from that
            directory (with this machine's Python) and resolves there, and without a GPU the GPU
            check exits 2 within `NO_GPU_SECONDS`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20
NO_GPU_SECONDS = 60.0
PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
#: The target's marker environment: CPython 3.12 on Linux x86_64.
TARGET_MARKERS = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "os_name": "posix", "extra": ""}
#: Published wheels carried at constraints.txt's versions: what the machine lacks
#: (flash-linear-attention, fla-core, PyAV with its FFmpeg, deepspeed's hjson and pydantic), and
#: what it has at a version vlmcp was not tested with (transformers 5.17, peft of an unrecorded
#: version; typing_extensions, which pydantic needs at >= 4.16). PyAV's abi3 wheel is the largest
#: (35.8 MB of 18.1.0's).
DOWNLOAD = ["flash-linear-attention", "fla-core", "av", "hjson", "pydantic", "pydantic-core",
            "annotated-types", "typing-inspection", "typing-extensions", "transformers", "peft"]
#: Built here with `pip wheel --no-deps` (no binary wheel is published).
BUILD = ["deepspeed"]
NEVER_CARRIED = {"torch", "triton"}
#: Requirements the lent machine misses on purpose: vlmcp's torch floor (2.13: varlen_attn, fla's
#: correct GDN backward). The GPU check runs vlmcp below it (sdpa per sample, DeltaNet kernel torch).
BELOW_FLOOR_ON_PURPOSE = {("vlmcp", "torch")}
#: The lent machine's Python packages (its image, as last read on 2026-11-17): name -> version
#: where a session recorded it, else None.
LENT_MACHINE: dict[str, str | None] = {
    **dict.fromkeys([
        "absl-py", "aiohttp", "attrs", "certifi", "charset-normalizer", "click", "cloudpickle",
        "contourpy", "cycler", "einops", "filelock", "fonttools", "fsspec", "hf-xet", "httpcore",
        "httpx", "idna", "jinja2", "joblib", "kiwisolver", "markupsafe", "matplotlib", "mpmath",
        "msgpack", "networkx", "ninja", "packaging", "pandas", "peft", "pillow", "pip", "pluggy",
        "protobuf", "psutil", "py-cpuinfo", "pygments", "pyparsing", "pytest", "python-dateutil",
        "pyyaml", "regex", "requests", "rich", "scikit-learn", "scipy", "setuptools", "six",
        "sympy", "threadpoolctl", "tqdm", "typer", "typing-extensions", "urllib3", "wheel",
        "nvidia-nccl-cu13", "nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-cuda-runtime",
    ]),
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
}


def pinned_versions(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """constraints.txt's `name==version` lines, by canonical name."""
    pins = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return canonicalize_name(metadata["Name"]), metadata["Version"], metadata.get_all("Requires-Dist") or []


def set_problems(wheels: dict[str, tuple[str, list[str]]], total_bytes: int,
                 machine: dict[str, str | None] = LENT_MACHINE) -> list[str]:
    """Why the wheel set {name: (version, Requires-Dist)} is not ready for the lent machine (empty:
    it is): over the size limit, a torch/triton wheel, or a requirement neither the set nor the
    machine meets (a machine version that is not recorded counts as meeting it), except
    `BELOW_FLOOR_ON_PURPOSE`."""
    problems = []
    if total_bytes > LIMIT_BYTES:
        problems.append(f"the wheels and the tracked files take {total_bytes / 2**20:.1f} MiB, over the "
                        f"{LIMIT_BYTES // 2**20} MiB that travel to the machine")
    problems += [f"{name} must not be carried (the machine's own build is used)"
                 for name in sorted(NEVER_CARRIED & wheels.keys())]
    for name, (_, requires) in sorted(wheels.items()):
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET_MARKERS):
                continue
            needed = canonicalize_name(requirement.name)
            if needed in wheels:
                have, where = wheels[needed][0], "the wheel set"
            elif needed in machine:
                have, where = machine[needed], "the lent machine"
            else:
                problems.append(f"{name} needs {requirement}, which neither the wheel set nor the lent "
                                "machine has")
                continue
            if (have is not None and not requirement.specifier.contains(Version(have), prereleases=True)
                    and (name, needed) not in BELOW_FLOOR_ON_PURPOSE):
                problems.append(f"{name} needs {requirement}, but {where} has {needed} {have}")
    return problems


def tracked_bytes(root: Path = ROOT) -> int:
    """Bytes of the files git tracks in `root` (what travels with the wheels); 0 outside git."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=False)
    if listed.returncode:
        return 0
    paths = (root / name for name in listed.stdout.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def check(directory: Path) -> list[str]:
    """`set_problems` of the wheels in `directory` (their size counted with the checkout's
    tracked files), plus two versions of one package."""
    files = sorted(directory.glob("*.whl"))
    if not files:
        return [f"no wheels in {directory}: run make gpu-wheels"]
    wheels: dict[str, tuple[str, list[str]]] = {}
    problems = []
    for path in files:
        name, version, requires = wheel_metadata(path)
        if name in wheels:
            problems.append(f"two versions of {name} in {directory}: {wheels[name][0]} and {version}")
        wheels[name] = (version, requires)
    return problems + set_problems(wheels, sum(f.stat().st_size for f in files) + tracked_bytes())


def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", *args], check=True, cwd=ROOT)


def download(directory: Path, python: str) -> list[str]:
    """Fill `directory` (emptied of wheels first) with the set; returns `check`'s problems."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.whl"):
        old.unlink()
    pins = pinned_versions()
    missing = [name for name in DOWNLOAD + BUILD if canonicalize_name(name) not in pins]
    if missing:
        return [f"constraints.txt pins no version of {missing}"]
    tags = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    _pip(python, "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
         "--implementation", "cp", *tags, "-d", str(directory),
         *(f"{name}=={pins[canonicalize_name(name)]}" for name in DOWNLOAD))
    built = [f"{name}=={pins[canonicalize_name(name)]}" for name in BUILD]
    _pip(python, "wheel", "--no-deps", "--no-cache-dir", "-w", str(directory), *built)
    _pip(python, "wheel", "--no-deps", "--no-cache-dir", "-w", str(directory), str(ROOT))
    return check(directory)


def rehearse(directory: Path) -> list[str]:
    """`check`, then install into a fresh --target, import vlmcp from there, and the GPU check
    without a GPU; returns the problems (empty: the rehearsal passed)."""
    problems = check(directory)
    if problems:
        return problems
    tags = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    with tempfile.TemporaryDirectory(prefix="vlmcp-rehearsal-") as tmp:
        site = Path(tmp, "site")
        install = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp", *tags,
             "--target", str(site), *map(str, sorted(directory.glob("*.whl")))],
            capture_output=True, text=True)
        if install.returncode:
            return [f"pip install --target failed: {install.stderr.strip()[-2000:]}"]
        env = {**os.environ, "PYTHONPATH": str(site)}
        imported = subprocess.run([sys.executable, "-c", "import vlmcp; print(vlmcp.__file__)"], env=env,
                                  cwd=tmp, capture_output=True, text=True)
        if imported.returncode or not imported.stdout.strip().startswith(str(site)):
            problems.append(f"import vlmcp from {site} failed or resolved elsewhere: "
                            f"{imported.stdout.strip()} {imported.stderr.strip()[-2000:]}")
        started = time.monotonic()
        no_gpu = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out",
                                 str(Path(tmp, "gpu-check.json")), "--wheels", str(directory)],
                                env={**env, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if no_gpu.returncode != 2 or seconds > NO_GPU_SECONDS:
            problems.append(f"without a GPU the check exited {no_gpu.returncode} after {seconds:.0f} s "
                            f"(expected 2 within {NO_GPU_SECONDS:.0f} s): {no_gpu.stderr.strip()[-2000:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_wheels.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["download", "check", "rehearse"])
    parser.add_argument("--dir", default=str(ROOT / ".whl"), help="the wheel directory (default .whl/)")
    parser.add_argument("--python", default=sys.executable, help="the Python whose pip downloads and builds")
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    if args.command == "download":
        problems = download(directory, args.python)
    elif args.command == "check":
        problems = check(directory)
    else:
        problems = rehearse(directory)
    for problem in problems:
        print(f"gpu-wheels: {problem}", file=sys.stderr)
    if not problems:
        files = sorted(directory.glob("*.whl"))
        size = sum(f.stat().st_size for f in files) / 2**20
        tree = tracked_bytes() / 2**20
        print(f"gpu-wheels {args.command}: ok ({len(files)} wheels, {size:.1f} MiB in {directory}; "
              f"with the {tree:.1f} MiB of tracked files {size + tree:.1f} of {LIMIT_BYTES // 2**20} MiB)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
