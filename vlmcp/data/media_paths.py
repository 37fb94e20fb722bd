"""The paths a record gives its images and videos: resolved against the directory they are
relative to, and looked up, with every problem a `DataError` naming the sample.

A record's path is the producer's text: it may name a user whose home directory does not exist
(``~nobody/a.png``, where `Path.expanduser` raises RuntimeError), or be longer than the
filesystem allows (where `Path.is_file` raises OSError). Those are bad samples like a missing
file, not failures of the reader.
"""

from __future__ import annotations

from pathlib import Path

from vlmcp.errors import DataError


def media_path(base_dir: Path, text: str, source: str, key: str) -> Path:
    """`base_dir / text` with a leading ``~`` expanded (an absolute `text` stays as it is);
    DataError naming `source` and the record's `key` when it cannot be resolved."""
    try:
        return base_dir / Path(text).expanduser()
    except RuntimeError as e:
        raise DataError(f"{source}: {key} path {text[:80]!r}: cannot expand '~' ({e})") from e


def is_file(path: Path) -> bool:
    """Whether `path` is a regular file; False also where the filesystem refuses the name (too
    long, not encodable)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False
