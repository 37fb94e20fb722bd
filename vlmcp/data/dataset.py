"""A data file -> samples in memory, for held-out evaluation and tests.

Records are read by `vlmcp.data.sources` (JSON Lines or a JSON array, by content). Images and
the sampled frames of videos are decoded and patchified up front, when the file is read. Training data does not come through here:
it is indexed (`vlmcp.data.index`) and its packs are loaded when needed (`vlmcp.data.stream`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from vlmcp.data.formats import DataError, Sample, parse_record
from vlmcp.data.processor import VLProcessor
from vlmcp.data.sources import iter_records


def iter_samples(
    data_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False,
    image_root: str | Path | None = None,
) -> Iterator[Sample | DataError]:
    """Each record's `Sample`, or the `DataError` it raised, in file order.

    image_root: what relative image paths are relative to (default: the data file's directory).
    A file-level problem (missing, unreadable, malformed array, no samples) is one `DataError`.
    """
    path = Path(data_path)
    base_dir = Path(image_root) if image_root is not None else path.parent
    for source, record in iter_records(path):
        if isinstance(record, DataError):
            yield record
            continue
        try:
            yield parse_record(record, source, base_dir, processor, max_seq_len, truncate)
        except DataError as e:
            yield e


def nth_sample(
    data_paths: Sequence[str | Path], index: int, processor: VLProcessor, max_seq_len: int,
    truncate: bool = False, image_root: str | Path | None = None,
) -> Sample:
    """The sample at 0-based `index` of the files taken in order (records counted across them, as
    read, before any mixture weight); only that record is parsed and only its media are decoded.
    Raises `DataError` (the record's, or one naming the files and how many samples they hold)."""
    count = 0
    for data_path in data_paths:
        path = Path(data_path)
        for source, record in iter_records(path):
            if isinstance(record, DataError):
                raise record
            if count == index:
                base_dir = Path(image_root) if image_root is not None else path.parent
                return parse_record(record, source, base_dir, processor, max_seq_len, truncate)
            count += 1
    names = ", ".join(str(p) for p in data_paths)
    raise DataError(f"{names}: no sample {index} (the data holds {count})")


def load_samples(
    data_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False,
    image_root: str | Path | None = None,
) -> list[Sample]:
    """Every sample of a data file; raises the first `DataError`."""
    samples = []
    for item in iter_samples(data_path, processor, max_seq_len, truncate, image_root):
        if isinstance(item, DataError):
            raise item
        samples.append(item)
    return samples
