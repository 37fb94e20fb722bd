"""Malformed rollout steps for the rollout fuzzer (tests/test_rollout_fuzz.py): a valid step, then
each `Mutation` a copy of it changed in one way, with the outcome the trainer must give.

A base step (`base_step`) is what a producer writes (docs/rl-loop.md): step_N/rollouts.jsonl with
tokens-format records (input_ids, labels, images or videos, and the per-token arrays advantages,
temperatures and inference_logprobs, null off the targets), their media files under images/ and
videos/, meta.json {"policy_step": ...} and STABLE. `mutations(base, seed)` derives the malformed
steps from it, seeded:

* a record's value of the wrong type, shape or size: every key replaced whole (null, a bool, a
  string, an object, lists empty, nested and 60 deep, an integer of 400 digits, NaN), one entry
  replaced (the same, and Infinity, 1e400, a 5,000-digit integer, "NaN" and "Infinity" strings,
  negative and huge ids, bad image paths), arrays one short and one long, a required key removed,
  a record that is not an object, a video's ``<t seconds>`` text other than vlmcp's frame plan;
* the data file's bytes: bytes that are not UTF-8 (inside and outside strings), a byte-order mark
  or a NUL inside, nesting deeper than the parser goes, a line cut short, the file cut off at
  some line, two records on one line, the file emptied;
* the step: STABLE present with the data file missing (or misnamed, or a directory), a meta.json
  that is not an object, is malformed, not UTF-8 or a directory, a bad policy_step, the step
  directory a file;
* a second data file: empty, a JSON array with one bad element, a JSON array cut short, one
  pretty-printed JSON object;
* media: an image or video missing, garbage, empty, a directory, of a shape the processor
  rejects.

Each `Mutation` says where the problem is (`Expect`): one record of a data file (an error naming
step_N/file:line, or under `on_bad_sample: "skip"` that record dropped and counted), a data file
as a whole (an error naming the file, or under skip the file dropped and counted), or the step
itself (an error naming it under either setting), and how many samples a skip keeps.
"""

from __future__ import annotations

import copy
import io
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlmcp.data.formats import parse_record
from vlmcp.data.processor import VLProcessor
from vlmcp.data.rollouts import META, STABLE

DATA_FILE = "rollouts.jsonl"
#: Where a mutation's problem lies: one record, a whole data file, or the step.
RECORD, FILE, STEP = "record", "file", "step"


@dataclass(frozen=True)
class Expect:
    """The outcome a mutated step must give.

    where: RECORD (one record of a data file is bad), FILE (a data file cannot be read as
           records), STEP (the step cannot be read: an error under either on_bad_sample).
    names: what the error must name after "step_N/": "rollouts.jsonl:3", "b.json[1] (line 3)",
           "meta.json", "" (the step directory).
    kept:  the samples that train under on_bad_sample "skip" (RECORD and FILE), 0 when none
           does (the step is skipped).
    sure:  False where the mutation may also leave a valid step (then any outcome above, or a
           clean step, is fine).
    """

    where: str
    names: str
    kept: int = 0
    sure: bool = True


@dataclass(frozen=True)
class Mutation:
    """One malformed step: `write(path)` creates it at `path` (which does not exist yet)."""

    name: str
    expect: Expect
    write: Callable[[Path], None]


@dataclass(frozen=True)
class Raw:
    """A JSON value written as this text, verbatim (what `json.dumps` cannot produce)."""

    text: str


@dataclass
class BaseStep:
    """A valid rollout step: its records (one line each), media files (relative path -> bytes)
    and meta.json."""

    lines: list[dict[str, Any]]
    media: dict[str, bytes]
    meta: dict[str, Any] = field(default_factory=lambda: {"policy_step": 0})

    def write(self, path: Path, lines: list[Any] | None = None, data: bytes | None = None,
              meta: bytes | None = None, media: dict[str, bytes | None] | None = None,
              extra: dict[str, bytes] | None = None) -> None:
        """The step at `path`: rollouts.jsonl (`data` as is, else `lines` or the base's, one JSON
        line each), meta.json, the media (`media` replaces or, with None, removes files), the
        `extra` files, then STABLE."""
        path.mkdir(parents=True)
        files = {**self.media, **(media or {})}
        for name, content in files.items():
            if content is not None:
                (path / name).parent.mkdir(parents=True, exist_ok=True)
                (path / name).write_bytes(content)
        if data is None:
            data = b"".join(dumps(line).encode() + b"\n"
                            for line in (self.lines if lines is None else lines))
        (path / DATA_FILE).write_bytes(data)
        (path / META).write_bytes(json.dumps(self.meta).encode() if meta is None else meta)
        for name, content in (extra or {}).items():
            (path / name).write_bytes(content)
        (path / STABLE).write_text("")


def dumps(value: Any) -> str:
    """JSON text of `value`, with every `Raw` inside written as its text."""
    raws: list[str] = []

    def mark(node: Any) -> Any:
        if isinstance(node, Raw):
            raws.append(node.text)
            return f"\0raw{len(raws) - 1}\0"
        if isinstance(node, list):
            return [mark(item) for item in node]
        if isinstance(node, dict):
            return {key: mark(item) for key, item in node.items()}
        return node

    text = json.dumps(mark(value))
    for k, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\0raw{k}\0"), raw)
    return text


def _token_line(sample, generator: torch.Generator) -> dict[str, Any]:
    """The tokens-format record of a parsed sample, with per-token arrays on its targets."""
    targets = {t for t in range(1, len(sample.labels)) if sample.labels[t] != -100}

    def on_targets(values: torch.Tensor) -> list[float | None]:
        return [float(values[t]) if t in targets else None for t in range(len(sample.labels))]

    n = len(sample.labels)
    line = {"input_ids": sample.input_ids, "labels": sample.labels,
            "advantages": on_targets(torch.randn(n, generator=generator)),
            "temperatures": on_targets(0.6 + 0.8 * torch.rand(n, generator=generator)),
            "inference_logprobs": on_targets(-torch.rand(n, generator=generator) * 3)}
    return line


def base_step(processor: VLProcessor, images: list[Path], video: Path | None,
              seed: int = 0) -> BaseStep:
    """A valid step of one record per image (a digit question) and, with `video`, one video
    record last; media are copied in under images/ and videos/."""
    generator = torch.Generator().manual_seed(seed)
    root = images[0].parent
    lines, media = [], {}
    for i, image in enumerate(images):
        name = f"images/{i}.png"
        media[name] = image.read_bytes()
        record = {"messages": [{"role": "user", "content": "<image>What digit is this?"},
                               {"role": "assistant", "content": str(i % 10)}],
                  "images": [str(image)]}
        sample = parse_record(record, f"base:{i + 1}", root, processor, max_seq_len=10**6)
        lines.append({**_token_line(sample, generator), "images": [name]})
    if video is not None:
        name = "videos/clip.mp4"
        media[name] = video.read_bytes()
        record = {"messages": [{"role": "user", "content": "<video>What happens?"},
                               {"role": "assistant", "content": "It moves."}],
                  "videos": [str(video)]}
        sample = parse_record(record, "base:video", video.parent, processor, max_seq_len=10**6)
        lines.append({**_token_line(sample, generator), "videos": [name]})
    return BaseStep(lines, media)


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


#: Replacements of a whole value: every one is wrong for every key of a tokens record.
WHOLE = [("null", None), ("true", True), ("a string", "1"), ("an integer", 7),
         ("a float", 1.5), ("an object", {}), ("an empty list", []), ("a nested list", [[1]]),
         ("a 60-deep list", _nested(60)), ("an integer of 400 digits", 10**399), ("-1", -1),
         ("NaN", float("nan"))]
#: Replacements of one entry that are wrong for any token id or label (on a target).
BAD_INT = [("null", None), ("true", True), ("a string", "1"), ("a float", 1.5),
           ("a list", [1]), ("an object", {}), ("an integer of 400 digits", 10**399),
           ("-1", -1), ("-10**30", -(10**30)), ("NaN", float("nan")),
           ("Infinity", float("inf")), ("a 5000-digit integer", Raw("9" * 5000)),
           ("1e400", Raw("1e400"))]
#: Replacements of one entry that are wrong for any per-token value on a target.
BAD_NUMBER = [("null", None), ("true", True), ("a string", "1"), ("a list", [1]),
              ("an object", {}), ("an integer of 400 digits", 10**399), ("NaN", float("nan")),
              ("Infinity", float("inf")), ("-Infinity", float("-inf")), ("1e400", Raw("1e400")),
              ("-1e400", Raw("-1e400")), ("a 5000-digit integer", Raw("1" * 5000)),
              ("the string NaN", "NaN"), ("the string Infinity", "Infinity"),
              ("a 500-deep list", Raw("[" * 500 + "0.5" + "]" * 500))]
#: ... and for a temperature on a target.
BAD_TEMPERATURE = BAD_NUMBER + [("0", 0), ("-1", -1.0)]
#: Entries that are wrong for a per-token value off the targets (where null and any number go).
BAD_OFF_TARGET = [("true", True), ("a string", "1"), ("a list", [1]), ("an object", {})]
#: Entries that are wrong for an image path.
BAD_PATH = [("null", None), ("an integer", 7), ("an empty string", ""),
            ("a list", ["images/0.png"]), ("a missing file", "images/missing.png"),
            ("an unknown user's home", "~no-such-user-here/0.png"),
            ("a name longer than the filesystem takes", "a" * 300 + ".png"),
            ("a directory", "images"), ("a device", "/dev/null")]
#: Bytes that are not UTF-8: a lone 0xff, an overlong "/", an encoded surrogate, a sequence
#: cut short, a lone continuation byte.
NOT_UTF8 = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\x80"]
#: Per-token arrays of the base records.
ARRAYS = ("advantages", "temperatures", "inference_logprobs")


def mutations(base: BaseStep, tokenizer: Any, seed: int = 0) -> list[Mutation]:
    """The malformed steps of `base` (see the module docstring), in a seeded order of choice
    of the lines and entries they change. `tokenizer` spells a video's timestamps."""
    rng = random.Random(seed)
    n = len(base.lines)
    video_line = next((i for i, line in enumerate(base.lines) if "videos" in line), None)
    found: list[Mutation] = []

    def record(name: str, line: int, change: Callable[[dict[str, Any]], Any],
               replace: bool = False, kept: int = n - 1, sure: bool = True) -> None:
        """A mutation of record `line` (0-based): change(record) edits it in place, or, with
        `replace`, returns what the line becomes instead."""
        def write(path: Path) -> None:
            lines = copy.deepcopy(base.lines)
            replaced = change(lines[line])
            if replace:
                lines[line] = replaced
            base.write(path, lines=lines)
        found.append(Mutation(f"line {line + 1}: {name}",
                              Expect(RECORD, f"{DATA_FILE}:{line + 1}", kept, sure), write))

    def targets(line: int) -> list[int]:
        labels = base.lines[line]["labels"]
        return [t for t in range(1, len(labels)) if labels[t] != -100]

    def keys(line: int) -> list[str]:
        return [key for key in base.lines[line]]

    # A value replaced whole.
    for label, value in WHOLE:
        for key in ("input_ids", "labels", "images", *ARRAYS):
            line = rng.choice([i for i in range(n) if key in base.lines[i]])
            record(f'"{key}" is {label}', line,
                   lambda r, key=key, value=value: r.__setitem__(key, copy.deepcopy(value)))
        if video_line is not None:
            record(f'"videos" is {label}', video_line,
                   lambda r, value=value: r.__setitem__("videos", copy.deepcopy(value)))
    # One entry replaced.
    for key, table in (("input_ids", BAD_INT), ("labels", BAD_INT),
                       ("advantages", BAD_NUMBER), ("inference_logprobs", BAD_NUMBER),
                       ("temperatures", BAD_TEMPERATURE)):
        for label, value in table:
            line = rng.randrange(n)
            t = rng.choice(targets(line))
            record(f'"{key}"[{t}] (a target) is {label}', line,
                   lambda r, key=key, t=t, value=value: r[key].__setitem__(t, copy.deepcopy(value)))
    for key in ARRAYS:
        for label, value in BAD_OFF_TARGET:
            line = rng.randrange(n)
            t = rng.choice([t for t in range(len(base.lines[line]["labels"]))
                            if t not in targets(line)])
            record(f'"{key}"[{t}] (off the targets) is {label}', line,
                   lambda r, key=key, t=t, value=value: r[key].__setitem__(t, copy.deepcopy(value)))
    image_lines = [i for i in range(n) if "images" in base.lines[i]]
    for label, value in BAD_PATH:
        line = rng.choice(image_lines)
        record(f'"images"[0] is {label}', line,
               lambda r, value=value: r["images"].__setitem__(0, copy.deepcopy(value)))
    if video_line is not None:
        for label, value in BAD_PATH:
            record(f'"videos"[0] is {label}', video_line,
                   lambda r, value=value: r["videos"].__setitem__(0, copy.deepcopy(value)))
    # Arrays one short and one long.
    for line in range(n):
        for key in keys(line):
            record(f'"{key}" one entry short', line, lambda r, key=key: r[key].pop())
            record(f'"{key}" one entry long', line,
                   lambda r, key=key: r[key].append(copy.deepcopy(r[key][-1])))
    # Required keys removed (advantages: policy_gradient needs them).
    for key in ("input_ids", "labels", "images", "advantages", "videos"):
        lines = [i for i in range(n) if key in base.lines[i]]
        if lines:
            record(f'no "{key}"', rng.choice(lines), lambda r, key=key: r.pop(key))
    # Not an object (from line 2 on: a first line "[" makes the file a JSON array).
    for label, value in (("a list", [1, 2]), ("a string", "text"), ("a number", 3),
                         ("null", None), ("true", True)):
        line = rng.randrange(1, n)
        record(f"the record is {label}", line, lambda r, value=value: Raw(json.dumps(value)),
               replace=True)
    # A video whose timestamps are not vlmcp's frame plan.
    if video_line is not None:
        video = base.lines[video_line]
        stamp = next(t for t in range(len(video["input_ids"]))
                     if tokenizer.decode(video["input_ids"][:t + 1]).endswith("seconds>"))
        start = next(s for s in range(stamp, -1, -1)
                     if tokenizer.decode(video["input_ids"][s:stamp + 1]).startswith("<"))

        def timestamp(spelled: str) -> Callable[[dict[str, Any]], None]:
            ids = tokenizer(spelled, add_special_tokens=False)["input_ids"] if spelled else []

            def change(r: dict[str, Any]) -> None:
                for key in ("input_ids", "labels", *ARRAYS):
                    fill = ids if key == "input_ids" else \
                        [-100 if key == "labels" else None] * len(ids)
                    r[key][start:stamp + 1] = fill
            return change

        record("the first temporal group's timestamp is <9.9 seconds>", video_line,
               timestamp("<9.9 seconds>"))
        record("the first temporal group has no timestamp", video_line, timestamp(""))

    data = b"".join(dumps(line).encode() + b"\n" for line in base.lines)
    rows = data.splitlines(keepends=True)

    def raw(name: str, new: bytes, expect: Expect) -> None:
        found.append(Mutation(name, expect, lambda path: base.write(path, data=new)))

    def at_line(line: int, edit: Callable[[bytes], bytes]) -> bytes:
        return b"".join(edit(row) if i == line else row for i, row in enumerate(rows))

    # Bytes that are not UTF-8, inside a string and between tokens.
    for bad in NOT_UTF8:
        line = rng.randrange(n)
        raw(f"line {line + 1}: {bad!r} inside a string",
            at_line(line, lambda row, bad=bad: row.replace(b'"input_ids"', b'"input' + bad +
                                                           b'_ids"', 1)),
            Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
        line = rng.randrange(n)
        raw(f"line {line + 1}: {bad!r} between tokens",
            at_line(line, lambda row, bad=bad: row.replace(b", ", b"," + bad + b" ", 1)),
            Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
    line = rng.randrange(1, n)
    raw(f"line {line + 1}: a byte-order mark", at_line(line, lambda row: b"\xef\xbb\xbf" + row),
        Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
    line = rng.randrange(n)
    raw(f"line {line + 1}: a NUL byte in a string",
        at_line(line, lambda row: row.replace(b'"labels"', b'"lab\x00els"', 1)),
        Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
    line = rng.randrange(n)
    raw(f"line {line + 1}: nested 100,000 deep",
        at_line(line, lambda row: row.replace(b'"advantages": ', b'"advantages": ' + b"[" * 10**5
                                              + b"]" * 10**5 + b", \"was\": ", 1)),
        Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
    line = rng.randrange(n)
    raw(f"line {line + 1}: a 5000-digit integer beside the arrays",
        at_line(line, lambda row: row.replace(b"{", b'{"x": ' + b"7" * 5000 + b", ", 1)),
        Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
    for line in range(n):
        raw(f"line {line + 1}: cut in the middle",
            at_line(line, lambda row: row[:len(row) // 2] + b"\n"),
            Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1))
    for line in range(1, n):
        raw(f"the file cut off in line {line + 1}",
            b"".join(rows[:line]) + rows[line][:len(rows[line]) // 2],
            Expect(RECORD, f"{DATA_FILE}:{line + 1}", line))
    raw("the file cut off in line 1", rows[0][:len(rows[0]) // 2], Expect(FILE, DATA_FILE))
    line = rng.randrange(n - 1)
    raw(f"lines {line + 1} and {line + 2} on one line",
        b"".join(rows[:line]) + rows[line].rstrip(b"\n") + b"".join(rows[line + 1:]),
        Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 2))
    raw("the file emptied", b"", Expect(FILE, DATA_FILE))
    raw("the file only blank lines", b"\n  \n\t\n", Expect(FILE, DATA_FILE))

    def step(name: str, expect: Expect, write: Callable[[Path], None]) -> None:
        found.append(Mutation(name, expect, write))

    def without(*names: str) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            base.write(path)
            for name in names:
                (path / name).unlink()
        return write

    def replaced_by_dir(name: str) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            base.write(path)
            (path / name).unlink()
            (path / name).mkdir()
        return write

    def renamed(old: str, new: str) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            base.write(path)
            (path / old).rename(path / new)
        return write

    def step_file(content: bytes) -> Callable[[Path], None]:
        return lambda path: path.write_bytes(content)

    # The step itself.
    step("STABLE with the data file missing", Expect(STEP, ""), without(DATA_FILE))
    step("the data file named rollouts.txt", Expect(STEP, ""), renamed(DATA_FILE, "rollouts.txt"))
    step("the data file a directory", Expect(STEP, DATA_FILE), replaced_by_dir(DATA_FILE))
    step("the step directory an empty file", Expect(STEP, ""), step_file(b""))
    step("the step directory a file of data", Expect(STEP, ""), step_file(data))
    for label, value in (("a list", b"[]"), ("a string", b'"0"'), ("a number", b"0"),
                         ("null", b"null"), ("true", b"true"),
                         ("a list of the object", b'[{"policy_step": 0}]'),
                         ("malformed", b"{policy_step: 0}"), ("empty", b""),
                         ("not UTF-8", b'{"policy_step": 0, "note": "\xff"}'),
                         ("nested 100,000 deep", b"[" * 10**5 + b"]" * 10**5),
                         ("a 5000-digit policy_step", b'{"policy_step": ' + b"1" * 5000 + b"}"),
                         ('policy_step "0"', b'{"policy_step": "0"}'),
                         ("policy_step -1", b'{"policy_step": -1}'),
                         ("policy_step true", b'{"policy_step": true}'),
                         ("policy_step 1.5", b'{"policy_step": 1.5}'),
                         ("policy_step [0]", b'{"policy_step": [0]}')):
        step(f"meta.json is {label}", Expect(STEP, META),
             lambda path, value=value: base.write(path, meta=value))
    step("meta.json with a policy_step of 400 digits", Expect(STEP, META, n, sure=False),
         lambda path: base.write(path, meta=b'{"policy_step": ' + b"9" * 400 + b"}"))
    step("meta.json a directory", Expect(STEP, META), replaced_by_dir(META))

    # A second data file.
    good = [dumps(line) for line in base.lines[:3]]
    array = lambda items: ("[\n" + ",\n".join(items) + "\n]\n").encode()  # noqa: E731
    second = [("empty", "b.jsonl", b"", Expect(FILE, "b.jsonl", n)),
              ("a JSON array with a non-UTF-8 byte in element 1", "b.json",
               array(good).replace(good[1].encode(),
                                   good[1].encode().replace(b'"labels"', b'"lab\xffels"', 1)),
               Expect(RECORD, "b.json[1] (line 3)", n + 2)),
              ("a JSON array with a 5000-digit integer in element 2", "b.json",
               array(good[:2] + ['{"x": ' + "3" * 5000 + "}"]),
               Expect(RECORD, "b.json[2] (line 4)", n + 2)),
              ("a JSON array with an element that is not an object", "b.json",
               array(good[:1] + ["[1, 2]"] + good[1:2]), Expect(RECORD, "b.json[1] (line 3)",
                                                              n + 2)),
              ("a JSON array cut short", "b.json", array(good)[:len(array(good)) // 2],
               Expect(FILE, "b.json", n)),
              ("one pretty-printed JSON object", "b.jsonl",
               json.dumps(base.lines[0], indent=1).encode(), Expect(FILE, "b.jsonl", n))]
    for label, name, content, expect in second:
        step(f"a second data file: {label}", expect,
             lambda path, name=name, content=content: base.write(path, extra={name: content}))

    # Media.
    png = next(content for name, content in base.media.items() if name.endswith(".png"))
    thin = io.BytesIO()
    Image.new("RGB", (300, 1)).save(thin, format="PNG")
    for name in base.media:
        line = next(i for i, r in enumerate(base.lines)
                    if name in r.get("images", []) + r.get("videos", []))
        expect = Expect(RECORD, f"{DATA_FILE}:{line + 1}", n - 1)
        kinds = [("missing", None), ("garbage", b"\x00garbage" * 10), ("empty", b"")]
        if name.endswith(".mp4"):
            kinds.append(("a still image", png))
        else:
            kinds.append(("300x1 pixels", thin.getvalue()))
        for label, content in kinds:
            found.append(Mutation(f"{name} {label}", expect,
                                  lambda path, name=name, content=content:
                                  base.write(path, media={name: content})))
        found.append(Mutation(f"{name} a directory", expect, replaced_by_dir(name)))
    return found
