"""A JSONL file -> samples. Training stops at the first bad line; validation collects them all.

Images are decoded and patchified up front, when the file is read (fine for the small datasets
this project trains on; a digits sample holds 4 patches, 24 KiB).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vlmcp.data.formats import DataError, Sample, parse_line
from vlmcp.data.processor import VLProcessor


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from e
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e})") from e


def iter_samples(
    jsonl_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False
) -> Iterator[Sample | DataError]:
    """Each line's `Sample`, or the `DataError` it raised, in file order.

    A file-level problem (missing, unreadable, no samples) is yielded as one `DataError`.
    """
    path = Path(jsonl_path)
    found = False
    try:
        for number, line in _lines(path):
            found = True
            try:
                yield parse_line(line, f"{path}:{number}", path.parent, processor, max_seq_len,
                                 truncate)
            except DataError as e:
                yield e
    except DataError as e:
        yield e
        return
    if not found:
        yield DataError(f"{path}: no samples")


def nth_sample(
    jsonl_path: str | Path, index: int, processor: VLProcessor, max_seq_len: int,
    truncate: bool = False,
) -> Sample:
    """The sample at 0-based `index` (counting non-blank lines) of a JSONL file; only that line is
    parsed and only its images are decoded. Raises `DataError` (the line's, or one naming the
    file and how many samples it holds)."""
    path = Path(jsonl_path)
    count = 0
    for number, line in _lines(path):
        if count == index:
            return parse_line(line, f"{path}:{number}", path.parent, processor, max_seq_len,
                              truncate)
        count += 1
    raise DataError(f"{path}: no sample {index} (the file holds {count})")


def load_samples(
    jsonl_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False
) -> list[Sample]:
    """Every sample of a JSONL file; raises the first `DataError`."""
    samples = []
    for item in iter_samples(jsonl_path, processor, max_seq_len, truncate):
        if isinstance(item, DataError):
            raise item
        samples.append(item)
    return samples
