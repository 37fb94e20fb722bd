"""`vlmcp validate`: every problem of a dataset file, one line each."""

from __future__ import annotations

from pathlib import Path

from vlmcp.data.dataset import iter_samples
from vlmcp.data.formats import DataError
from vlmcp.data.processor import VLProcessor


def validate_data(
    data_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False,
    image_root: str | Path | None = None,
) -> list[str]:
    """One "source: problem" string per bad record (all of them); empty when the file is clean.

    Uses the same parsing as training, which raises the first of these as a `DataError`.
    """
    return [str(item) for item in iter_samples(data_path, processor, max_seq_len, truncate,
                                               image_root)
            if isinstance(item, DataError)]
