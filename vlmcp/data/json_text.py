"""JSON text from users' files (data, jobs, DeepSpeed configs, checkpoint configs), parsed so that
every failure is a `json.JSONDecodeError`.

`json.loads` raises `RecursionError`, not `JSONDecodeError`, on deeply nested input (a few thousand
``[``), which escapes every handler that turns a parse failure into one line naming the file.
`loads` reports it as a `JSONDecodeError` at the bracket where the nesting is deepest, so those
handlers print ``file:line:col: ...`` for it as for any other malformed JSON.
"""

from __future__ import annotations

import json
from typing import Any


_DECODER = json.JSONDecoder()


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`; input nested too deeply for Python's parser raises JSONDecodeError."""
    try:
        return json.loads(text)
    except RecursionError:
        if isinstance(text, bytes):
            text = text.decode("utf-8-sig", errors="replace")
        raise _too_deep(text, 0) from None


def decode_at(text: str, start: int) -> tuple[Any, int]:
    """(the JSON value that starts at index `start` of `text`, the index after it), as
    `json.JSONDecoder().raw_decode`; input nested too deeply raises JSONDecodeError."""
    try:
        return _DECODER.raw_decode(text, start)
    except RecursionError:
        raise _too_deep(text, start) from None


def _too_deep(text: str, start: int) -> json.JSONDecodeError:
    depth, position = deepest_nesting(text, start)
    return json.JSONDecodeError(f"nested {depth} levels deep, deeper than the JSON parser can read",
                                text, position)


def deepest_nesting(text: str, start: int = 0) -> tuple[int, int]:
    """(deepest nesting of arrays and objects in `text[start:]`, index in `text` of the bracket
    that reaches it). Brackets inside strings do not count."""
    depth = deepest = 0
    position = start
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest, position = depth, index
        elif char in "]}":
            depth -= 1
    return deepest, position
