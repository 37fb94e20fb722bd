"""Records of a data file, each with the byte span it occupies, so one can be read back alone.

`scan_records` walks a file once (the length index pass, and validation); `read_record` reads one
record back from its span (a data loader worker, when the record's pack is needed), so nothing of
the file stays in memory between the two.

JSONL: one JSON value per non-blank line; a record's label is "file:line".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data.formats import DataError


@dataclass(frozen=True)
class Span:
    """Where a record lies in its file: 1-based line, byte offset and byte length."""

    line: int
    offset: int
    nbytes: int


def _decode(raw: bytes, source: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{source}: not UTF-8 text ({e})") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{source}: malformed JSON: {e.msg} at column {e.colno}") from e


def scan_records(path: Path) -> Iterator[tuple[Span, Any | DataError]]:
    """(span, decoded record or its DataError) of every record of `path`, in file order.

    A file-level problem (missing, unreadable, no records) is yielded as one DataError with a
    span of line 0.
    """
    try:
        handle = path.open("rb")
    except OSError as e:
        yield Span(0, 0, 0), DataError(f"{path}: cannot open ({e.strerror})")
        return
    found = False
    with handle:
        offset = 0
        for number, raw in enumerate(handle, start=1):
            span = Span(number, offset, len(raw))
            offset += len(raw)
            if not raw.strip():
                continue
            found = True
            try:
                yield span, _decode(raw, f"{path}:{number}")
            except DataError as e:
                yield span, e
    if not found:
        yield Span(0, 0, 0), DataError(f"{path}: no samples")


def read_record(path: Path, span: Span) -> Any:
    """The decoded record at `span` of `path` (DataError when it cannot be read or parsed)."""
    source = f"{path}:{span.line}"
    try:
        with path.open("rb") as handle:
            handle.seek(span.offset)
            raw = handle.read(span.nbytes)
    except OSError as e:
        raise DataError(f"{source}: cannot read ({e.strerror})") from e
    return _decode(raw, source)
