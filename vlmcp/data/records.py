"""Records of a data file with the byte span each occupies, so that one can be read back alone.

`vlmcp.data.sources` is the one reader of data files (JSON Lines or a JSON array, by content;
labels and errors). `locate_records` walks a file once (the length index pass), with the byte span
the reader found for each record in that same pass; `read_record` reads one record back from its
span (a data loader worker, when the record's pack is needed), so nothing of the file stays in
memory in between.

Spans: a JSON Lines record is its line; a JSON array record is the text of its element.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data import json_text
from vlmcp.data.sources import iter_located_records
from vlmcp.errors import DataError


@dataclass(frozen=True)
class Span:
    """Where a record lies in its file: its ordinal among the file's records (0-based), the
    1-based line it starts on, its byte offset and its byte length."""

    record: int
    line: int
    offset: int
    nbytes: int


def locate_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | DataError, Span | None]]:
    """`iter_records(path)` (source label, record or its DataError) with each record's span, from
    the same single read of the file; the span is None for a file-level problem."""
    ordinal = 0
    for label, record, position in iter_located_records(path):
        if position is None:
            yield label, record, None
            continue
        yield label, record, Span(ordinal, *position)
        ordinal += 1


def record_label(path: Path | str, span: Span, array: bool) -> str:
    """The source label `iter_records` gives the record at `span`."""
    return f"{path}[{span.record}] (line {span.line})" if array else f"{path}:{span.line}"


def read_record(path: Path, span: Span, label: str) -> dict[str, Any]:
    """The record at `span` of `path`; DataError naming `label` when it cannot be read back."""
    try:
        with path.open("rb") as handle:
            handle.seek(span.offset)
            raw = handle.read(span.nbytes)
    except OSError as e:
        raise DataError(f"{label}: cannot read ({e.strerror})") from e
    try:
        record = json_text.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{label}: the data file changed since the length index was built "
                        f"({e})") from e
    if not isinstance(record, dict):
        raise DataError(f"{label}: the data file changed since the length index was built")
    return record
