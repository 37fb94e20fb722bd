"""A data file -> samples in memory: one sample for `vlmcp inspect`, whole files for tests.

Records are read by `vlmcp.data.sources` (JSON Lines or a JSON array, by content). Images are
decoded and patchified up front, when the file is read. Training and held-out data do not come
through here: they are indexed (`vlmcp.data.index`) and their packs are loaded when needed
(`vlmcp.data.stream`); `vlmcp validate` checks every record through that same index pass
(`vlmcp.training.preflight`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from vlmcp.data.batch import TOKEN_ARRAYS
from vlmcp.data.formats import Sample
from vlmcp.data.pairs import record_samples
from vlmcp.data.processor import VLProcessor
from vlmcp.data.sources import iter_records
from vlmcp.errors import DataError


def iter_samples(
    data_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False,
    image_root: str | Path | None = None,
) -> Iterator[Sample | DataError]:
    """Each record's `Sample`s (a preference pair's chosen, then its rejected half), or the
    `DataError` it raised, in file order.

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
            samples = record_samples(record, source, base_dir, processor, max_seq_len, truncate)
        except DataError as e:
            yield e
            continue
        yield from samples


def nth_samples(
    data_paths: Sequence[str | Path], index: int, processor: VLProcessor, max_seq_len: int,
    truncate: bool = False, image_root: str | Path | None = None,
    array_names: tuple[str, ...] = TOKEN_ARRAYS,
) -> list[Sample]:
    """The samples of the record at 0-based `index` of the files taken in order (records counted
    across them, as read, before any mixture weight): one, or a pair's two halves; only that
    record is parsed and only its images are decoded. Raises `DataError` (the record's, or one
    naming the files and how many samples they hold)."""
    count = 0
    for data_path in data_paths:
        path = Path(data_path)
        for source, record in iter_records(path):
            if isinstance(record, DataError):
                raise record
            if count == index:
                base_dir = Path(image_root) if image_root is not None else path.parent
                return record_samples(record, source, base_dir, processor, max_seq_len,
                                      truncate, array_names)
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


def validate_data(
    data_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False,
    image_root: str | Path | None = None,
) -> list[str]:
    """One "source: problem" string per bad record of a data file (all of them); empty when the
    file is clean. The same parsing as training, which raises the first of these as a `DataError`."""
    return [str(item) for item in iter_samples(data_path, processor, max_seq_len, truncate,
                                               image_root)
            if isinstance(item, DataError)]
