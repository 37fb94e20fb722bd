"""Dataset files -> raw records, and the `data.train` / `data.eval` file lists of a job.

A data file is read by content, whatever its extension:

* a file whose first non-whitespace character is ``[`` is a JSON array of records (the LLaVA and
  LLaMA-Factory layout). It is read whole. A record's source label is ``file[index] (line N)``,
  N being the line where the record starts. A syntax error anywhere is one `DataError`
  ``file:line:col: malformed JSON array: ...``.
* anything else is JSON Lines: one record per non-blank line, read line by line (memory does not
  grow with the file). A record's source label is ``file:line``; a malformed line is an error of
  that line only. A first line that breaks off in the middle of a JSON value, followed by a line
  that is not a record of its own, means the file is one JSON document spread over lines: one
  error naming the file and the position.

A UTF-8 byte-order mark is skipped. Every record must be a JSON object.

`data_files` turns the job's `data.train` / `data.eval` value (a path, or a list of paths and
``{"path": ..., "weight": ...}`` objects) into `DataFile`s. This module imports no torch, so the
config layer can use it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data import json_text
from vlmcp.errors import DataError, DataSpecError

_ENCODING = "utf-8-sig"
_BOM = b"\xef\xbb\xbf"
_WHITESPACE = " \t\r\n"


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
    if path is None:
        problems.append(f"missing required config key '{key}.path'")
    elif not isinstance(path, str) or not path:
        problems.append(f"config key '{key}.path': expected a non-empty string, "
                        f"got {json.dumps(path)}")
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


def _first_char(path: Path) -> str:
    """The first non-whitespace character of the file ("" when there is none)."""
    with path.open(encoding=_ENCODING) as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip(_WHITESPACE)
            if stripped:
                return stripped[0]
    return ""


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


#: Where a record lies in its file: (1-based line it starts on, byte offset, byte length).
Position = tuple[int, int, int]


def _array_records(path: Path) -> list[tuple[str, Any, Position]]:
    """(label, value, position) of every element of a JSON array file; raises one `DataError` at
    the first syntax error, naming file:line:col (so a malformed file yields no record at all)."""
    raw = path.read_bytes()
    bom = len(_BOM) if raw.startswith(_BOM) else 0
    text = raw[bom:].decode("utf-8")

    def malformed(pos: int, message: str) -> DataError:
        line, col = _line_col(text, pos)
        return DataError(f"{path}:{line}:{col}: malformed JSON array: {message}")

    records: list[tuple[str, Any, Position]] = []
    pos = _skip_space(text, _skip_space(text, 0) + 1)  # past "["
    line, counted, byte_at = 1, 0, bom
    if pos < len(text) and text[pos] == "]":
        pos += 1
    else:
        while True:
            try:
                value, end = json_text.decode_at(text, pos)
            except json.JSONDecodeError as e:
                raise malformed(e.pos, e.msg) from e
            line += text.count("\n", counted, pos)
            byte_at += len(text[counted:pos].encode("utf-8"))
            counted = pos
            records.append((f"{path}[{len(records)}] (line {line})", value,
                            (line, byte_at, len(text[pos:end].encode("utf-8")))))
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
    text = path.read_text(encoding=_ENCODING)
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
    return DataError(f"{path}: one JSON {type(value).__name__} spread over several lines; a data "
                     "file is JSON Lines (one record per line) or a JSON array of records")


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any | DataError, Position]]:
    """(label, value or its DataError, position) of every non-blank line, read line by line;
    file-level problems raise."""
    first = True
    offset = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            position = (number, offset, len(raw))
            line = raw.decode(_ENCODING if number == 1 else "utf-8")
            offset += len(raw)
            if not line.strip(_WHITESPACE):
                continue
            label = f"{path}:{number}"
            try:
                value = json_text.loads(line)
            except json.JSONDecodeError as e:
                document_error = _multiline_document(path) if first and _breaks_off(line, e) \
                    else None
                if document_error is not None:
                    raise document_error from e
                yield label, DataError(f"{label}: malformed JSON: {e.msg} at column {e.colno}"), \
                    position
            else:
                yield label, value, position
            first = False


def is_json_array(path: Path) -> bool:
    """Whether the data file is read as a JSON array (its first non-whitespace character, after
    a byte-order mark, is "["); False for a file that cannot be read."""
    try:
        return _first_char(path) == "["
    except (OSError, UnicodeDecodeError):
        return False


def iter_located_records(path: str | Path
                         ) -> Iterator[tuple[str, dict[str, Any] | DataError, Position | None]]:
    """`iter_records`, with each record's position (line, byte offset, byte length) in the file,
    from the same single read; the position is None for a file-level problem."""
    path = Path(path)
    found = False
    try:
        kind = _first_char(path)
        values = _array_records(path) if kind == "[" else _jsonl_records(path)
        for label, value, position in values:
            found = True
            if isinstance(value, DataError) or isinstance(value, dict):
                yield label, value, position
            else:
                yield label, DataError(f"{label}: a record must be a JSON object, got "
                                       f"{type(value).__name__}"), position
    except OSError as e:
        yield str(path), DataError(f"{path}: cannot open ({e.strerror})"), None
        return
    except UnicodeDecodeError as e:
        yield str(path), DataError(f"{path}: not UTF-8 text ({e})"), None
        return
    except DataError as e:
        yield str(path), e, None
        return
    if not found:
        yield str(path), DataError(f"{path}: no samples"), None


def iter_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any] | DataError]]:
    """(source label, record or its `DataError`) of every record of a data file, in file order.

    JSON Lines is read line by line; a JSON array is read whole (see the module docstring).
    A file-level problem (cannot open, not UTF-8, a malformed array, no records) is yielded as
    one (str(path), DataError) and ends the iteration.
    """
    for label, record, _ in iter_located_records(path):
        yield label, record
