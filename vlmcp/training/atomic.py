"""Writing output directories so that a crash never leaves a half-written one in place.

A directory is written under a temporary name beside its final one and renamed into place when
complete (a rename within one filesystem is atomic); a small file is written to a temporary file
and `os.replace`d. `fsync_tree` flushes a finished directory's files and the directory itself to
the disk before its marker and its rename, and `fsync_path` the parent after the rename, so that
after a host crash a directory with its marker never holds a truncated file. Write failures are described for people: a full disk says "no space left on
<mount point>" with the free and (when known) needed bytes, instead of the `basic_ios::clear:
iostream error` that torch.save raises there.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

#: Below this many free bytes a failed write is taken to be a full disk, whatever its error.
_NEARLY_FULL_BYTES = 1 << 20


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: written to a temporary file, flushed, then `os.replace`d."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_path(path: Path) -> None:
    """Flush `path` (a file, or a directory's entries) to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then each directory of it, the top last."""
    paths = sorted(directory.rglob("*"))
    for path in paths:
        if path.is_file():
            fsync_path(path)
    for path in sorted((p for p in paths if p.is_dir()), reverse=True):
        fsync_path(path)
    fsync_path(directory)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished directory `tmp` to `final`; an existing `final` is removed after."""
    old = final.with_name(f".old-{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def remove_quietly(path: Path) -> None:
    """Remove a temporary directory or file if it exists (cleanup after a failed write)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)


def file_sizes(directory: Path) -> dict[str, int]:
    """{path relative to `directory`: bytes} of every file under it: what a manifest lists."""
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file()}


def manifest_problem(directory: Path, manifest: str) -> str | None:
    """Why `directory`, written with `manifest` (JSON whose "files" are `file_sizes`) last, is not
    whole: no manifest (its write did not finish), an unreadable one, a file missing or of
    another size; None when it is whole."""
    path = directory / manifest
    if not path.is_file():
        return f"{directory} has no {manifest} (its write did not finish)"
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{path} is unreadable ({exc})"
    for name, size in files.items():
        file = directory / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, the manifest says {size}"
    return None


def dir_size(path: Path) -> int:
    """Bytes of every file under `path` (a file linked under two names counted once)."""
    stats = {(s.st_dev, s.st_ino): s.st_size for s in (p.stat() for p in path.rglob("*")
                                                       if p.is_file())}
    return sum(stats.values())


def _mount_point(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def write_error(exc: BaseException, path: Path, needed_bytes: int | None = None) -> str:
    """One line saying why writing `path` failed; a full disk is named as such.

    torch.save reports a full disk as a RuntimeError (`basic_ios::clear: iostream error`,
    `file write failed`), so the free space is checked whatever the exception says.
    """
    mount = _mount_point(path)
    free = shutil.disk_usage(mount).free
    out_of_space = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or \
        free < max(needed_bytes or 0, _NEARLY_FULL_BYTES)
    if out_of_space:
        needed = f", about {needed_bytes} bytes needed" if needed_bytes else ""
        return f"no space left on {mount} while writing {path} ({free} bytes free{needed})"
    return f"cannot write {path}: {exc}"
