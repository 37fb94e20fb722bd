"""JSON text from users' files (data, jobs, DeepSpeed configs, checkpoint configs), parsed so that
every failure is a `json.JSONDecodeError`; and the few checks every parsed value goes through.

`json.loads` raises `RecursionError`, not `JSONDecodeError`, on deeply nested input (a few thousand
``[``), and a plain `ValueError` on an integer longer than Python's integer-string limit (4,300
digits by default, `sys.get_int_max_str_digits`). Both escape every handler that turns a parse
failure into one line naming the file. `loads` and `decode_at` report them as a `JSONDecodeError`
at the bracket where the nesting is deepest, or at the integer, so those handlers print
``file:line:col: ...`` for them as for any other malformed JSON.

Python's parser also reads the non-standard literals ``NaN``, ``Infinity`` and ``-Infinity`` (what
Python's own `json.dumps` writes for them), and a float literal beyond the float range (``1e400``)
as infinity; they parse, and each reader decides where a non-finite number may stand (`finite`).

A parsed JSON integer can exceed the float range (``10**400``), where `math.isfinite` and float()
raise `OverflowError`; `finite` gives None for it instead. `brief` renders a user's value for an
error message in bounded length and depth, so one message never carries a whole array.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import sys
from collections.abc import Iterator
from typing import Any


_DECODER = json.JSONDecoder()
#: A JSON string or a JSON integer's digits (the match of a string is skipped).
_STRING_OR_DIGITS = re.compile(r'"(?:[^"\\]|\\.)*"|(\d+)', re.DOTALL)


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`; input nested too deeply for Python's parser, or holding an integer
    longer than Python reads, raises JSONDecodeError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise _too_deep(_as_text(text), 0) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError:
        raise _too_long(_as_text(text), 0) from None


def decode_at(text: str, start: int) -> tuple[Any, int]:
    """(the JSON value that starts at index `start` of `text`, the index after it), as
    `json.JSONDecoder().raw_decode`; input nested too deeply, or an integer longer than Python
    reads, raises JSONDecodeError."""
    try:
        return _DECODER.raw_decode(text, start)
    except RecursionError:
        raise _too_deep(text, start) from None
    except json.JSONDecodeError:
        raise
    except ValueError:
        raise _too_long(text, start) from None


def _as_text(text: str | bytes) -> str:
    return text.decode("utf-8-sig", errors="replace") if isinstance(text, bytes) else text


class Unreadable(json.JSONDecodeError):
    """Well-formed JSON that Python's parser cannot read: nested too deeply, or an integer longer
    than Python's integer-string limit. `value_end` still finds where the value ends."""


def _too_deep(text: str, start: int) -> Unreadable:
    depth, position = deepest_nesting(text, start)
    return Unreadable(f"nested {depth} levels deep, deeper than the JSON parser can read", text,
                      position)


def _too_long(text: str, start: int) -> Unreadable:
    """The error of the first integer in `text[start:]` (outside strings) longer than Python's
    integer-string limit."""
    limit = sys.get_int_max_str_digits()
    for match in _STRING_OR_DIGITS.finditer(text, start):
        digits = match.group(1)
        if digits is not None and len(digits) > limit:
            return Unreadable(f"an integer of {len(digits)} digits, more than the {limit} Python "
                              "reads", text, match.start(1))
    return Unreadable("a number Python cannot read", text, start)


_SCALAR = re.compile(r'"(?:[^"\\]|\\.)*"|[^\s,\]}]+', re.DOTALL)


def value_end(text: str, start: int) -> int | None:
    """The index after the JSON value that starts at `text[start]`, found by its brackets (strings
    skipped) without parsing it; None when an array or object there is never closed. For a value
    `decode_at` raised `Unreadable` on, whose extent the parser could not give."""
    if text[start] not in "[{":
        match = _SCALAR.match(text, start)
        return None if match is None else match.end()
    return next((index + 1 for index, depth in _brackets(text, start) if depth == 0), None)


def deepest_nesting(text: str, start: int = 0) -> tuple[int, int]:
    """(deepest nesting of arrays and objects in `text[start:]`, index in `text` of the bracket
    that reaches it). Brackets inside strings do not count."""
    deepest, position = 0, start
    for index, depth in _brackets(text, start):
        if depth > deepest:
            deepest, position = depth, index
    return deepest, position


def _brackets(text: str, start: int) -> Iterator[tuple[int, int]]:
    """(index, nesting depth after it) of every bracket of `text[start:]` outside strings."""
    depth = 0
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
            yield index, depth
        elif char in "]}":
            depth -= 1
            yield index, depth


def kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: "an object", "an array", "a string",
    "a number", "a boolean" or "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value),
                                                                     type(value).__name__)


def is_number(value: Any) -> bool:
    """Whether a parsed JSON value is a number (an int or a float; true and false are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
    """The float of a parsed JSON number when it is finite, else None (not a number, NaN, an
    infinity, or an integer beyond the float range)."""
    if not is_number(value):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxstring, _BRIEF.maxother = 3, 4, 4, 60, 60
#: Integers with more digits than this are described by their length.
_BRIEF_DIGITS = 20


def brief(value: Any) -> str:
    """A parsed JSON value for an error message: JSON's spelling of a scalar (null, true, NaN,
    "text"), an integer of many digits by its length, a container shortened (at most a few
    entries, three levels deep)."""
    if isinstance(value, int) and not isinstance(value, bool) \
            and abs(value) >= 10**_BRIEF_DIGITS:
        try:
            return f"an integer of {len(str(abs(value)))} digits"
        except ValueError:
            return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    if isinstance(value, str) and len(value) <= _BRIEF.maxstring:
        return json.dumps(value)
    return _BRIEF.repr(value)
