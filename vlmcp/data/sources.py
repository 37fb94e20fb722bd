"""Dataset files -> raw records, and the `data.train` / `data.eval` file lists of a job.

A data file is read by content, whatever its extension:

* a file whose first non-whitespace character is ``[`` is a JSON array of records (the LLaVA and
  LLaMA-Factory layout). It is read whole. A record's source label is ``file[index] (line N)``,
  N being the line where the record starts. A syntax error anywhere breaks the array's structure
  (no record after it can be found): it is one `DataError` ``file:line:col: malformed JSON array:
  ...`` for the whole file, and the file yields no record. An element that is well-formed but
  cannot be read (bytes that are not UTF-8 inside its strings, nesting deeper than Python's
  parser goes, an integer longer than Python reads) is the error of that element only.
* anything else is JSON Lines: one record per non-blank line, read line by line (memory does not
  grow with the file). A record's source label is ``file:line``; a malformed line, or one that
  is not UTF-8 text, is an error of that line only (naming its column and its byte offset in
  the file). A first line that breaks off in the middle of a JSON value, followed by a line that
  is not a record of its own, means the file is one JSON document spread over lines: one error
  naming the file and the position.

A UTF-8 byte-order mark is skipped. Nothing is decoded before its record is read. Every record
must be a JSON object.

`data_files` turns the job's `data.train` / `data.eval` value (a path, or a list of paths and
``{"path": ..., "weight": ...}`` objects) into `DataFile`s. This module imports no torch, so the
config layer can use it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data import json_text
from vlmcp.errors import DataError, DataSpecError

_ENCODING = "utf-8-sig"
_BOM = b"\xef\xbb\xbf"
_WHITESPACE = " \t\r\n"
_WHITESPACE_BYTES = _WHITESPACE.encode()
#: What a byte that is not UTF-8 becomes in text decoded with errors="surrogateescape".
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class DataFile:
    """One data file of a job.

    path:   the path as the job gives it (resolve it with `JobConfig.resolve_input`).
    weight: per-epoch multiplier of the file's samples (`vlmcp.data.mixture`); 1.0 by default.
    key:    the config key that names it, for messages: "data.train" or "data.train[1]".
    """

    path: str
    weight: float = 1.0
    key: str = "data.train"


# --------------------------------------------------------------------------- the file list


def required_string_problem(entry: dict[str, Any], name: str, key: str) -> str | None:
    """The problem of `entry[name]`, config key `key.name`, which must be a non-empty string:
    missing, or not one; None when it is one."""
    value = entry.get(name)
    if value is None:
        return f"missing required config key '{key}.{name}'"
    if not isinstance(value, str) or not value:
        return f"config key '{key}.{name}': expected a non-empty string, got {json.dumps(value)}"
    return None


def _weight_problem(value: Any, key: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"config key '{key}': expected a number, got {json.dumps(value)}"
    if not math.isfinite(value) or value <= 0:
        return f"config key '{key}': must be a finite number > 0, got {json.dumps(value)}"
    return None


def _entry(item: Any, key: str, weighted: bool, problems: list[str]) -> DataFile | None:
    if isinstance(item, str):
        if not item:
            problems.append(f"config key '{key}': must not be empty")
            return None
        return DataFile(item, 1.0, key)
    if not isinstance(item, dict):
        problems.append(f"config key '{key}': expected a path string or an object "
                        f'{{"path": ..., "weight": ...}}, got {json.dumps(item)}')
        return None
    allowed = {"path", "weight"} if weighted else {"path"}
    before = len(problems)
    for name in item:
        if name not in allowed:
            hint = " (eval files are not weighted: every held-out sample counts once)" \
                if name == "weight" else ""
            problems.append(f"unknown config key '{key}.{name}'{hint}")
    path = item.get("path")
    problem = required_string_problem(item, "path", key)
    if problem:
        problems.append(problem)
    weight = item.get("weight", 1.0)
    if weighted and "weight" in item:
        problem = _weight_problem(weight, f"{key}.weight")
        if problem:
            problems.append(problem)
    if len(problems) > before:
        return None
    return DataFile(path, float(weight), key)


def data_files(spec: Any, key: str = "data.train", weighted: bool = True) -> list[DataFile]:
    """The files a `data.train` / `data.eval` value names, in order.

    spec: a path string, or a non-empty list whose items are path strings or objects
          ``{"path": str, "weight": number > 0}`` ("weight" only where `weighted`).
    Raises `DataSpecError` listing every problem, each naming its key (``data.train[1].weight``).
    """
    if isinstance(spec, str):
        if not spec:
            raise DataSpecError([f"config key '{key}': must not be empty"])
        return [DataFile(spec, 1.0, key)]
    if not isinstance(spec, list):
        raise DataSpecError([f"config key '{key}': expected a path string or a list of paths "
                             f'and {{"path": ..., "weight": ...}} objects, got {json.dumps(spec)}'])
    if not spec:
        raise DataSpecError([f"config key '{key}': the list names no file"])
    problems: list[str] = []
    files = [_entry(item, f"{key}[{i}]", weighted, problems) for i, item in enumerate(spec)]
    if problems:
        raise DataSpecError(problems)
    return [f for f in files if f is not None]


# --------------------------------------------------------------------------- reading records


def _first_byte(path: Path) -> bytes:
    """The first non-whitespace byte of the file after a byte-order mark (b"" when there is
    none); the bytes are not decoded, so a bad byte further on is the error of its own record."""
    with path.open("rb") as handle:
        head = handle.read(len(_BOM))
        chunk = b"" if head == _BOM else head
        while True:
            stripped = chunk.lstrip(_WHITESPACE_BYTES)
            if stripped:
                return stripped[:1]
            chunk = handle.read(65536)
            if not chunk:
                return b""


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


#: Where a record lies in its file: (1-based line it starts on, byte offset, byte length).
Position = tuple[int, int, int]


def _bad_byte(raw: bytes, at: int, encoding: str) -> str:
    """Where the byte at index `at` of `raw` (one line, or a whole file) that is not UTF-8 stands,
    as "byte 0xNN at column C" (C counts characters, 1-based, of its line)."""
    line_start = raw.rfind(b"\n", 0, at) + 1
    column = len(raw[line_start:at].decode(encoding, errors="replace")) + 1
    return f"byte 0x{raw[at]:02x} at column {column}"


def _array_records(path: Path) -> list[tuple[str, Any | DataError, Position]]:
    """(label, value or its DataError, position) of every element of a JSON array file; raises one
    `DataError` at the first syntax error, naming file:line:col (so a file whose structure breaks
    yields no record at all). An element that is well-formed but unreadable (bytes that are not
    UTF-8 in it, nested too deeply, an integer too long for Python) is that element's error."""
    raw = path.read_bytes()
    bom = len(_BOM) if raw.startswith(_BOM) else 0
    # Bytes that are not UTF-8 become lone surrogates, which the JSON parser takes inside
    # strings, and which encode back to the same bytes: byte offsets stay exact.
    text = raw[bom:].decode("utf-8", errors="surrogateescape")

    def nbytes(start: int, end: int) -> int:
        return len(text[start:end].encode("utf-8", errors="surrogateescape"))

    def bad_byte(pos: int) -> str:
        return _bad_byte(raw, bom + nbytes(0, pos), _ENCODING)

    def malformed(pos: int, message: str) -> DataError:
        line, col = _line_col(text, pos)
        if pos < len(text) and _ESCAPED_BYTE.match(text, pos):
            message = f"not UTF-8 text ({bad_byte(pos)})"
        return DataError(f"{path}:{line}:{col}: malformed JSON array: {message}")

    records: list[tuple[str, Any | DataError, Position]] = []
    pos = _skip_space(text, _skip_space(text, 0) + 1)  # past "["
    line, counted, byte_at = 1, 0, bom
    if pos < len(text) and text[pos] == "]":
        pos += 1
    else:
        while True:
            try:
                value, end = json_text.decode_at(text, pos)
            except json_text.Unreadable as e:
                end = json_text.value_end(text, pos)
                if end is None:
                    raise malformed(e.pos, e.msg) from e
                value = e
            except json.JSONDecodeError as e:
                raise malformed(e.pos, e.msg) from e
            line += text.count("\n", counted, pos)
            byte_at += nbytes(counted, pos)
            counted = pos
            label = f"{path}[{len(records)}] (line {line})"
            escaped = _ESCAPED_BYTE.search(text, pos, end)
            if escaped is not None:
                value = DataError(f"{label}: not UTF-8 text (line "
                                  f"{_line_col(text, escaped.start())[0]}, "
                                  f"{bad_byte(escaped.start())})")
            elif isinstance(value, json.JSONDecodeError):
                at_line, at_col = _line_col(text, value.pos)
                value = DataError(f"{label}: unreadable JSON: {value.msg} (line {at_line} "
                                  f"column {at_col})")
            records.append((label, value, (line, byte_at, nbytes(pos, end))))
            pos = _skip_space(text, end)
            if pos < len(text) and text[pos] == ",":
                pos = _skip_space(text, pos + 1)
                continue
            if pos < len(text) and text[pos] == "]":
                pos += 1
                break
            raise malformed(pos, "expecting ',' or ']' after a record"
                            if pos < len(text) else "the array is not closed (no ']')")
    pos = _skip_space(text, pos)
    if pos < len(text):
        raise malformed(pos, "extra data after the closing ']'")
    return records


def _breaks_off(line: str, error: json.JSONDecodeError) -> bool:
    """Whether a line's JSON error is the value running past the end of the line."""
    return error.pos >= len(line.rstrip(_WHITESPACE))


def _multiline_document(path: Path) -> DataError | None:
    """The one error of a JSON document spread over lines (neither JSONL nor an array), or None
    when the second record line parses alone (JSONL whose first line is cut short)."""
    text = path.read_bytes().decode(_ENCODING, errors="replace")
    lines = [line for line in text.splitlines() if line.strip(_WHITESPACE)]
    if len(lines) > 1:
        try:
            if isinstance(json_text.loads(lines[1]), dict):
                return None
        except json.JSONDecodeError:
            pass
    try:
        value = json_text.loads(text)
    except json.JSONDecodeError as e:
        return DataError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg} (the file is "
                         "neither JSON Lines, one record per line, nor a JSON array)")
    return DataError(f"{path}: {json_text.kind(value)} spread over several lines; a data "
                     "file is JSON Lines (one record per line) or a JSON array of records")


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any | DataError, Position]]:
    """(label, value or its DataError, position) of every non-blank line, read line by line;
    file-level problems raise. A line that is not UTF-8 text is an error of that line only."""
    first = True
    offset = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            position = (number, offset, len(raw))
            offset += len(raw)
            label = f"{path}:{number}"
            encoding = _ENCODING if number == 1 else "utf-8"
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as e:
                where = _bad_byte(raw, e.start, encoding)
                yield label, DataError(f"{label}: not UTF-8 text ({where}, byte "
                                       f"{position[1] + e.start} of the file)"), position
                first = False
                continue
            if not line.strip(_WHITESPACE):
                continue
            try:
                value = json_text.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                document_error = _multiline_document(path) if first and _breaks_off(line, e) \
                    else None
                if document_error is not None:
                    raise document_error from e
                what = "unreadable" if isinstance(e, json_text.Unreadable) else "malformed"
                yield label, DataError(f"{label}: {what} JSON: {e.msg.removesuffix(' at')} at "
                                       f"column {e.colno}"), position
            else:
                yield label, value, position
            first = False


def is_json_array(path: Path) -> bool:
    """Whether the data file is read as a JSON array (its first non-whitespace character, after
    a byte-order mark, is "["); False for a file that cannot be read."""
    try:
        return _first_byte(path) == b"["
    except OSError:
        return False


def iter_located_records(path: str | Path
                         ) -> Iterator[tuple[str, dict[str, Any] | DataError, Position | None]]:
    """`iter_records`, with each record's position (line, byte offset, byte length) in the file,
    from the same single read; the position is None for a file-level problem."""
    path = Path(path)
    found = False
    try:
        kind = _first_byte(path)
        values = _array_records(path) if kind == b"[" else _jsonl_records(path)
        for label, value, position in values:
            found = True
            if isinstance(value, DataError) or isinstance(value, dict):
                yield label, value, position
            else:
                yield label, DataError(f"{label}: a record must be a JSON object, got "
                                       f"{json_text.kind(value)}"), position
    except OSError as e:
        yield str(path), DataError(f"{path}: cannot open ({e.strerror})"), None
        return
    except DataError as e:
        yield str(path), e, None
        return
    if not found:
        yield str(path), DataError(f"{path}: no samples"), None


def iter_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any] | DataError]]:
    """(source label, record or its `DataError`) of every record of a data file, in file order.

    JSON Lines is read line by line; a JSON array is read whole (see the module docstring).
    A file-level problem (cannot open, a malformed array, no records) is yielded as
    one (str(path), DataError) and ends the iteration.
    """
    for label, record, _ in iter_located_records(path):
        yield label, record
