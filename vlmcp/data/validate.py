"""`vlmcp validate`: every problem of a dataset file, one line each."""

from __future__ import annotations

from pathlib import Path

from vlmcp.data.dataset import iter_samples
from vlmcp.data.formats import DataError
from vlmcp.data.processor import VLProcessor


def validate_data(
    jsonl_path: str | Path, processor: VLProcessor, max_seq_len: int, truncate: bool = False
) -> list[str]:
    """One "file:line: problem" string per bad line (all of them); empty when the file is clean.

    Uses the same parsing as training, which raises the first of these as a `DataError`.
    """
    return [str(item) for item in iter_samples(jsonl_path, processor, max_seq_len, truncate)
            if isinstance(item, DataError)]
