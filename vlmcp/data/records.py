"""Records of a data file with the byte span each occupies, so that one can be read back alone.

`vlmcp.data.sources.iter_records` is the one reader of data files (JSON Lines or a JSON array,
by content; labels and errors). `locate_records` walks it once (the length index pass) and adds
each record's byte span; `read_record` reads one record back from its span (a data loader worker,
when the record's pack is needed), so nothing of the file stays in memory in between.

Spans: a JSON Lines record is its line; a JSON array record is the text of its element.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data.sources import DataError, iter_records

_BOM = b"\xef\xbb\xbf"
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class Span:
    """Where a record lies in its file: its ordinal among the file's records (0-based), the
    1-based line it starts on, its byte offset and its byte length."""

    record: int
    line: int
    offset: int
    nbytes: int


def is_json_array(path: Path) -> bool:
    """Whether the file's first non-whitespace character (after a byte-order mark) is "["."""
    with path.open("rb") as handle:
        head = handle.read(3)
        if head != _BOM:
            handle.seek(0)
        while chunk := handle.read(4096):
            stripped = chunk.lstrip(_WHITESPACE.encode())
            if stripped:
                return stripped[:1] == b"["
    return False


def _line_spans(path: Path) -> Iterator[tuple[int, int, int]]:
    """(line, byte offset, byte length) of every line, blank ones included."""
    offset = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, offset, len(raw)
            offset += len(raw)


def _array_spans(path: Path) -> Iterator[tuple[int, int, int]]:
    """(line, byte offset, byte length) of every element of a well-formed JSON array file."""
    raw = path.read_bytes()
    start = len(_BOM) if raw.startswith(_BOM) else 0
    text = raw[start:].decode("utf-8")
    decoder = json.JSONDecoder()

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in _WHITESPACE:
            pos += 1
        return pos

    pos = skip(skip(0) + 1)
    char_at, byte_at, line = 0, start, 1
    while pos < len(text) and text[pos] != "]":
        _, end = decoder.raw_decode(text, pos)
        byte_at += len(text[char_at:pos].encode("utf-8"))
        line += text.count("\n", char_at, pos)
        nbytes = len(text[pos:end].encode("utf-8"))
        yield line, byte_at, nbytes
        char_at = pos
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)


def locate_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | DataError, Span | None]]:
    """`iter_records(path)` (source label, record or its DataError) with each record's span; the
    span is None for a file-level problem."""
    array = path.is_file() and is_json_array(path)
    spans = _array_spans(path) if array else _line_spans(path)
    ordinal = 0
    for label, record in iter_records(path):
        if label == str(path):
            yield label, record, None
            continue
        if array:
            line, offset, nbytes = next(spans)
        else:
            wanted = int(label.rsplit(":", 1)[1])
            line, offset, nbytes = next(s for s in spans if s[0] == wanted)
        yield label, record, Span(ordinal, line, offset, nbytes)
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
        record = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{label}: the data file changed since the length index was built "
                        f"({e})") from e
    if not isinstance(record, dict):
        raise DataError(f"{label}: the data file changed since the length index was built")
    return record
