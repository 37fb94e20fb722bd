"""The length index: one compact row per sample of the training files, built without pixels.

Packing needs only each sample's token count, so a first pass over the data records, per
sample (a preference pair is one row, both halves together, so that packing keeps them in one
pack): where it lies (file, line, byte offset and length), its tokens, its targets, and its
(kept) images and videos and their vision patches. Each image's placeholder count comes from its
size as read from the file header (`vlmcp.data.image_size`); each video's from its container
metadata (frame count, fps, frame size: `vlmcp.data.video.probe_video`) through the same
sampling and sizing rules the loader applies (`vlmcp.data.video_plan`), without decoding a
frame. The text is tokenized to count it and then dropped. A sample is read back, tokenized
again (deterministically) and its images and sampled video frames decoded only when its pack is
loaded (`vlmcp.data.stream`). The index holds 60 bytes per sample as numpy arrays;
`vlmcp.data.index_cache` keeps it on disk between runs.

With `decode=True` (`vlmcp validate`) every image and every sampled video frame is decoded and
patchified once, to prove it is readable, and the counts are taken from that real processing; no
pixels are kept.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vlmcp.data.batch import IGNORE_INDEX, PAIR_VALUES, TOKEN_ARRAYS
from vlmcp.data.image_size import header_grid
from vlmcp.data.pairs import record_paths, record_samples, record_tokens
from vlmcp.data.policy_versions import record_version_range
from vlmcp.data.processor import VLProcessor
from vlmcp.data.records import Span, locate_records, record_label
from vlmcp.data.sources import is_json_array
from vlmcp.data.video_records import plan_videos
from vlmcp.errors import DataError

#: Columns of the index: (name, numpy dtype).
COLUMNS = (("file_id", np.int32), ("record", np.int32), ("line", np.int32), ("offset", np.int64),
           ("nbytes", np.int64),
           ("tokens", np.int32), ("targets", np.int32), ("images", np.int32),
           ("patches", np.int32), ("videos", np.int32), ("video_patches", np.int32),
           ("token_arrays", np.int32), ("chosen_tokens", np.int32))


@dataclass
class LengthIndex:
    """Per-sample arrays of a list of data files, all of length N (the samples, in file order).

    files:   the data files; file[i] indexes it.
    line, offset, nbytes: where sample i lies in its file (1-based line, bytes).
    tokens:  its length in tokens after truncation (what packing uses).
    targets: its predicted tokens.
    images, patches: its kept images and their vision patches (sum of t*h*w); a pair's prompt
             images once.
    videos, video_patches: its kept videos and their vision patches (sum of groups*h*w).
    token_arrays: a bit mask of the per-token arrays and pair values it carries (bit k:
             `array_names[k]`).
    chosen_tokens: for a preference pair, the tokens of its chosen half (its row counts both
             halves); 0 for a single sample.
    array_names: what the bits of token_arrays stand for: the per-token arrays the index read
             (`TOKEN_ARRAYS` and a job's weight arrays), then `PAIR_VALUES`.
    nonzero_targets: per array named in `build_index(count_nonzero=...)` (a loss term's weights),
             each sample's targets where that array is not 0 (0 for a sample without it); what
             a step's normalisers need beyond the target counts, without loading a pack.
    policy_versions: with `build_index(versions=True)` (rollout steps), [N, 2] int64: the oldest
             and newest policy version of each sample's targets (`vlmcp.data.policy_versions`),
             -1 for a sample without them; else None.
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
    videos: np.ndarray
    video_patches: np.ndarray
    token_arrays: np.ndarray
    chosen_tokens: np.ndarray
    array_names: tuple[str, ...] = TOKEN_ARRAYS + PAIR_VALUES
    nonzero_targets: dict[str, np.ndarray] = field(default_factory=dict)
    policy_versions: np.ndarray | None = None

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
        """Indices of the samples without the per-token array or pair value `name` (one of
        `array_names`)."""
        return np.flatnonzero((self.token_arrays & (1 << self.array_names.index(name))) == 0)

    @property
    def token_array_names(self) -> tuple[str, ...]:
        """The per-token arrays the index read (`array_names` without `PAIR_VALUES`)."""
        return tuple(name for name in self.array_names if name not in PAIR_VALUES)

    def pairs(self) -> np.ndarray:
        """[N] bool: which rows are preference pairs."""
        return self.chosen_tokens > 0

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name, _ in COLUMNS}

    def without(self, dropped: Iterable[int]) -> LengthIndex:
        """The index of every sample but those at the indices `dropped`, in the same order."""
        keep = np.ones(len(self), dtype=bool)
        keep[list(dropped)] = False
        return LengthIndex(files=self.files, json_array=self.json_array,
                           image_root=self.image_root, array_names=self.array_names,
                           nonzero_targets={name: values[keep] for name, values
                                            in self.nonzero_targets.items()},
                           policy_versions=(None if self.policy_versions is None
                                            else self.policy_versions[keep]),
                           **{name: values[keep] for name, values in self.arrays().items()})


def _array_mask(names: Iterable[str], mask_names: tuple[str, ...]) -> int:
    """The `LengthIndex.token_arrays` bit mask of `names` (each one of `mask_names`)."""
    return sum(1 << mask_names.index(name) for name in names)


def _count(grids: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(number of grids, their patches sum(t*h*w))."""
    return len(grids), sum(int(t) * int(h) * int(w) for t, h, w in grids)


def _nonzero_targets(labels: Sequence[int], values: Sequence[float] | None) -> int:
    """Targets (labels[1:] that are not IGNORE_INDEX) where `values` (aligned with labels) is not
    0 in fp32, as a pack holds it; 0 without values."""
    if values is None:
        return 0
    targets = np.asarray(labels[1:]) != IGNORE_INDEX
    return int((targets & (np.asarray(values[1:], dtype=np.float32) != 0)).sum())


def _row(record: object, source: str, base_dir: Path, processor: VLProcessor, max_seq_len: int,
         truncate: bool, decode: bool, array_names: tuple[str, ...],
         count_nonzero: tuple[str, ...] = ()) -> tuple[int, ...]:
    """(tokens, targets, images, patches, videos, video patches, token-array mask, chosen
    tokens, then the nonzero targets of each of `count_nonzero`) of one record; DataError when it
    cannot train."""
    mask_names = array_names + PAIR_VALUES
    if decode:
        samples = record_samples(record, source, base_dir, processor, max_seq_len, truncate,
                                 array_names)
        first = samples[0]
        grids = [] if first.image_grid_thw is None else first.image_grid_thw.tolist()
        video_grids = [] if first.video_grid_thw is None else first.video_grid_thw.tolist()
        carried = set(first.token_arrays) | (set(PAIR_VALUES) if first.values else set())
        return (sum(len(s) for s in samples),
                sum(label != IGNORE_INDEX for s in samples for label in s.labels[1:]),
                *_count(grids), *_count(video_grids), _array_mask(carried, mask_names),
                len(first) if len(samples) == 2 else 0,
                *(sum(_nonzero_targets(s.labels, None if name not in s.token_arrays
                                       else s.token_arrays[name].tolist()) for s in samples)
                  for name in count_nonzero))
    paths = record_paths(record, source, base_dir)
    grids = [header_grid(p, source, processor.image_processor) for p in paths]
    plans = plan_videos(record, base_dir, source, processor)
    tokens = record_tokens(record, source, base_dir, processor, grids, max_seq_len, truncate,
                           array_names, plans)
    first = tokens.halves[0]
    return (sum(len(t.input_ids) for t in tokens.halves),
            sum(t.num_targets for t in tokens.halves), *_count(first.grids),
            *_count([plan.grid for plan in first.videos]), _array_mask(tokens.carried, mask_names),
            len(first.input_ids) if tokens.is_pair else 0,
            *(sum(_nonzero_targets(t.labels, t.arrays.get(name)) for t in tokens.halves)
              for name in count_nonzero))


def build_index(files: Sequence[Path], processor: VLProcessor, max_seq_len: int,
                truncate: bool = False, *, image_root: Path | None = None, decode: bool = False,
                array_names: tuple[str, ...] = TOKEN_ARRAYS, count_nonzero: tuple[str, ...] = (),
                versions: bool = False) -> tuple[LengthIndex, list[str]]:
    """The index of every usable sample of `files` (in file order), and one "source: problem"
    line per bad record or file (all of them). image_root: what relative image and video paths
    are relative to (None: each file's directory). With `decode`, images and the sampled video
    frames are decoded once each (validation); else only image headers and video container
    metadata are read. array_names: the per-token arrays read from
    tokens records (`LengthIndex.array_names`); count_nonzero: those of them whose nonzero targets
    are counted (`LengthIndex.nonzero_targets`); versions: also read each record's per-token
    policy versions (`LengthIndex.policy_versions`; a malformed one is the record's problem).

    A record that fails with another exception than DataError (a library's error on input no
    check foresaw) is a bad record too, its line naming the exception."""
    columns = {name: array("q") for name, _ in COLUMNS}
    nonzero = {name: array("q") for name in count_nonzero}
    version_ranges = array("q")
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
                counts = _row(record, source, base_dir, processor, max_seq_len, truncate, decode,
                              array_names, tuple(count_nonzero))
                # the versions of the tokens data.truncate kept (counts[0]: their number)
                version_range = (record_version_range(record, source, kept=counts[0])
                                 if versions else None)
            except DataError as e:
                problems.append(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - a bad record must not end the whole pass
                problems.append(f"{source}: an unexpected {type(e).__name__}: {e}")
                continue
            values = (file_id, span.record, span.line, span.offset, span.nbytes, *counts)
            for (name, _), value in zip(COLUMNS, values):
                columns[name].append(value)
            for name, value in zip(count_nonzero, values[len(COLUMNS):]):
                nonzero[name].append(value)
            version_ranges.extend(version_range or (-1, -1))
    arrays = {name: np.frombuffer(columns[name], dtype=np.int64).astype(dtype)
              for name, dtype in COLUMNS}
    return LengthIndex(files=[str(f) for f in files], json_array=kinds,
                       image_root=None if image_root is None else str(image_root),
                       **arrays, array_names=tuple(array_names) + PAIR_VALUES,
                       nonzero_targets={name: np.frombuffer(values, dtype=np.int64).astype(np.int32)
                                        for name, values in nonzero.items()},
                       policy_versions=(np.frombuffer(version_ranges, dtype=np.int64).reshape(-1, 2)
                                        if versions else None)), problems
