"""The length index: one compact row per sample of the training files, built without pixels.

Packing needs only each sample's token count, so a first pass over the data records, per
sample: where it lies (file, line, byte offset and length), its tokens, its targets, and its
(kept) images and their vision patches. Each image's placeholder count comes from its size as
read from the file header (`vlmcp.data.image_size`); the text is tokenized to count it and then
dropped. A sample is read back, tokenized again (deterministically) and its images decoded only
when its pack is loaded (`vlmcp.data.stream`). The index holds 40 bytes per sample as numpy
arrays; `vlmcp.data.index_cache` keeps it on disk between runs.

With `decode=True` (`vlmcp validate`) every image is decoded and patchified once, to prove it is
readable, and the counts are taken from that real processing; no pixels are kept.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmcp.data.batch import IGNORE_INDEX, TOKEN_ARRAYS
from vlmcp.data.formats import parse_record, record_image_paths, tokenize_record
from vlmcp.data.image_size import header_grid
from vlmcp.data.processor import VLProcessor
from vlmcp.data.records import Span, locate_records, record_label
from vlmcp.data.sources import is_json_array
from vlmcp.errors import DataError

#: Columns of the index: (name, numpy dtype).
COLUMNS = (("file_id", np.int32), ("record", np.int32), ("line", np.int32), ("offset", np.int64),
           ("nbytes", np.int64),
           ("tokens", np.int32), ("targets", np.int32), ("images", np.int32),
           ("patches", np.int32), ("token_arrays", np.int16))


@dataclass
class LengthIndex:
    """Per-sample arrays of a list of data files, all of length N (the samples, in file order).

    files:   the data files; file[i] indexes it.
    line, offset, nbytes: where sample i lies in its file (1-based line, bytes).
    tokens:  its length in tokens after truncation (what packing uses).
    targets: its predicted tokens.
    images, patches: its kept images and their vision patches (sum of t*h*w).
    token_arrays: a bit mask of the per-token arrays it carries (bit k: `TOKEN_ARRAYS[k]`).
    """

    files: list[str]
    json_array: list[bool]
    image_root: str | None
    file_id: np.ndarray
    record: np.ndarray
    line: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    tokens: np.ndarray
    targets: np.ndarray
    images: np.ndarray
    patches: np.ndarray
    token_arrays: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def location(self, i: int) -> tuple[Path, Span]:
        """The file and span of sample i."""
        return (Path(self.files[int(self.file_id[i])]),
                Span(int(self.record[i]), int(self.line[i]), int(self.offset[i]),
                     int(self.nbytes[i])))

    def source(self, i: int) -> str:
        """The source label of sample i ("file:line", or "file[index] (line N)")."""
        path, span = self.location(i)
        return record_label(path, span, self.json_array[int(self.file_id[i])])

    def base_dir(self, i: int) -> Path:
        """What sample i's relative image paths are relative to."""
        return Path(self.image_root) if self.image_root else self.location(i)[0].parent

    def file_sizes(self) -> list[int]:
        """Samples of each file."""
        return np.bincount(self.file_id, minlength=len(self.files)).tolist()

    def lacking(self, name: str) -> np.ndarray:
        """Indices of the samples without the per-token array `name` (one of `TOKEN_ARRAYS`)."""
        return np.flatnonzero((self.token_arrays & (1 << TOKEN_ARRAYS.index(name))) == 0)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name, _ in COLUMNS}

    def without(self, dropped: Iterable[int]) -> LengthIndex:
        """The index of every sample but those at the indices `dropped`, in the same order."""
        keep = np.ones(len(self), dtype=bool)
        keep[list(dropped)] = False
        return LengthIndex(files=self.files, json_array=self.json_array,
                           image_root=self.image_root,
                           **{name: values[keep] for name, values in self.arrays().items()})


def _array_mask(names: Iterable[str]) -> int:
    """The `LengthIndex.token_arrays` bit mask of the per-token arrays `names`."""
    return sum(1 << TOKEN_ARRAYS.index(name) for name in names)


def _row(record: object, source: str, base_dir: Path, processor: VLProcessor, max_seq_len: int,
         truncate: bool, decode: bool) -> tuple[int, int, int, int, int]:
    """(tokens, targets, images, patches, token-array mask) of one record; DataError when it
    cannot train."""
    if decode:
        sample = parse_record(record, source, base_dir, processor, max_seq_len, truncate)
        grid = sample.image_grid_thw
        targets = sum(label != IGNORE_INDEX for label in sample.labels[1:])
        return (len(sample), targets, 0 if grid is None else len(grid),
                0 if grid is None else int(grid.prod(-1).sum()), _array_mask(sample.token_arrays))
    paths = record_image_paths(record, source, base_dir)
    grids = [header_grid(p, source, processor.image_processor) for p in paths]
    tokens = tokenize_record(record, source, base_dir, processor, grids, max_seq_len, truncate)
    return (len(tokens.input_ids), tokens.num_targets, len(tokens.grids),
            sum(t * h * w for t, h, w in tokens.grids), _array_mask(tokens.arrays))


def build_index(files: Sequence[Path], processor: VLProcessor, max_seq_len: int,
                truncate: bool = False, *, image_root: Path | None = None, decode: bool = False
                ) -> tuple[LengthIndex, list[str]]:
    """The index of every usable sample of `files` (in file order), and one "source: problem"
    line per bad record or file (all of them). image_root: what relative image paths are
    relative to (None: each file's directory). With `decode`, images are decoded once each
    (validation); else only their headers are read."""
    columns = {name: array("q") for name, _ in COLUMNS}
    problems: list[str] = []
    kinds: list[bool] = []
    for file_id, path in enumerate(map(Path, files)):
        kinds.append(path.is_file() and is_json_array(path))
        base_dir = image_root if image_root is not None else path.parent
        for source, record, span in locate_records(path):
            if isinstance(record, DataError):
                problems.append(str(record))
                continue
            try:
                counts = _row(record, source, base_dir, processor, max_seq_len, truncate, decode)
            except DataError as e:
                problems.append(str(e))
                continue
            for (name, _), value in zip(COLUMNS, (file_id, span.record, span.line, span.offset,
                                                  span.nbytes, *counts)):
                columns[name].append(value)
    arrays = {name: np.frombuffer(columns[name], dtype=np.int64).astype(dtype)
              for name, dtype in COLUMNS}
    return LengthIndex(files=[str(f) for f in files], json_array=kinds,
                       image_root=None if image_root is None else str(image_root),
                       **arrays), problems
