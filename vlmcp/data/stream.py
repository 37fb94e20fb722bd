"""Packs -> `PackedBatch`es, loaded when needed: records read back, images decoded, in workers.

A rank's micro-batches of one epoch are the packs `PackedDataset.rank_packs` gives it; only
those packs are loaded (every rank of a sequence-parallel group loads the same pack). Loading a
pack reads each sample's record back from its byte span, tokenizes it again (the same
deterministic tokenization as the index pass), decodes and patchifies its images, and checks that
its token count still equals the length index's. A `torch.utils.data.DataLoader` runs that in
`num_workers` worker processes (0: in this process), each keeping up to `prefetch_factor` packs
ready, in pack order; the batches are the same whatever the number of workers.

A sample that fails to load (an image that is gone, unreadable, or of another size than when the
index was built) does not kill a worker: the worker hands back a `LoadFailure` and the rank raises
one `DataError` naming the sample, which training turns into an agreed stop of every rank. Any
other exception while a pack loads (a library's, on input no check foresaw) is handed back the same
way, as one line naming the pack's samples and the exception. Workers run in their own process
group, so a stop signal sent to a rank's group reaches the rank alone, and they ignore the stop
signals (SIGTERM, SIGINT, SIGUSR1): the `deepspeed` launcher sends SIGTERM to each rank's whole
process tree, and a worker that died of it would end its rank with the DataLoader's "worker
killed" error instead of the rank's checkpoint and clean stop. A worker still ends with its
loader, or within seconds of its rank (torch's workers watch their parent), or on SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlmcp.data.batch import REF_LOGP, PackedBatch
from vlmcp.data.formats import Sample
from vlmcp.data.index import LengthIndex
from vlmcp.data.pack import build_batch
from vlmcp.data.pairs import record_samples
from vlmcp.data.processor import VLProcessor
from vlmcp.data.records import read_record
from vlmcp.errors import DataError


@dataclass
class LoadFailure:
    """A pack that could not be loaded: the one-line reason (it names file:line)."""

    message: str


@dataclass
class SampleReader:
    """Reads row i of a length index back as full `Sample`s (pixels included): one, or a
    preference pair's chosen and rejected halves.

    reference_logps: [N, 2] float64, the reference policy's logprob sums of each pair's (chosen,
    rejected) half (`loss.reference_logps`), set on the halves as `Sample.values[REF_LOGP]`
    (NaN rows and single samples get none); None: the records' own.
    """

    index: LengthIndex
    processor: VLProcessor
    max_seq_len: int
    truncate: bool
    cache_path: str = ""
    reference_logps: np.ndarray | None = None

    def samples(self, i: int) -> list[Sample]:
        path, span = self.index.location(i)
        source = self.index.source(i)
        record = read_record(path, span, source)
        samples = record_samples(record, source, self.index.base_dir(i), self.processor,
                                 self.max_seq_len, self.truncate, self.index.token_array_names)
        expected = int(self.index.tokens[i])
        if sum(len(s) for s in samples) != expected:
            raise DataError(f"{source}: {sum(len(s) for s in samples)} tokens now, {expected} in "
                            f"the length index {self.cache_path or '(in memory)'}: the sample or "
                            "one of its images changed since the index was built; delete that "
                            "file or run `vlmcp validate` to rebuild it")
        if self.reference_logps is not None and len(samples) == 2 \
                and not np.isnan(self.reference_logps[i]).any():
            for sample, value in zip(samples, self.reference_logps[i].tolist()):
                sample.values[REF_LOGP] = value
        return samples

    def sample(self, i: int) -> Sample:
        """The first sample of row i (a pair's chosen half)."""
        return self.samples(i)[0]

    def pack(self, pack: Sequence[int]) -> PackedBatch:
        """The `PackedBatch` of the rows `pack` (a pair's halves side by side)."""
        return build_batch([s for i in pack for s in self.samples(i)])


class _PackList(torch.utils.data.Dataset):
    """Item k: the `PackedBatch` of packs[k], or a `LoadFailure`."""

    def __init__(self, reader: SampleReader, packs: Sequence[Sequence[int]]) -> None:
        self.reader = reader
        self.packs = packs

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, k: int) -> PackedBatch | LoadFailure:
        try:
            return self.reader.pack(self.packs[k])
        except DataError as e:
            return LoadFailure(str(e))
        except Exception as e:  # noqa: BLE001 - a worker must hand back every failure
            sources = [self.reader.index.source(int(i)) for i in self.packs[k]]
            return LoadFailure(f"the pack of samples {sources}: an unexpected "
                               f"{type(e).__name__} while loading it: {e}")


#: How loader workers start: forked where the OS can (they inherit the index and the processor
#: instead of unpickling them into a fresh interpreter; a rank that was itself started by
#: multiprocessing "spawn" would otherwise start its workers that way, some seconds each).
_WORKER_START = "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def _as_is(item: PackedBatch | LoadFailure) -> PackedBatch | LoadFailure:
    return item


#: The signals a rank stops on after a checkpoint (training/signals.py), which its workers ignore.
_RANK_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _own_process_group(worker_id: int) -> None:
    """Move a loader worker out of its rank's process group, and have it ignore the rank's stop
    signals: a launcher's SIGTERM to the rank's group (torchrun's `killpg`) or to its process
    tree (`deepspeed`'s), or a terminal's Ctrl-C, then stops only the rank, in step with its
    peers; the worker still ends with its loader or its rank."""
    os.setpgrp()
    for sig in _RANK_STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def load_packs(reader: SampleReader, packs: Sequence[Sequence[int]], num_workers: int,
               prefetch_factor: int) -> Iterator[PackedBatch]:
    """The batches of `packs`, in order, loaded by `num_workers` DataLoader workers (0: here)
    with `prefetch_factor` packs ready per worker. Raises DataError at a pack that fails."""
    loader = torch.utils.data.DataLoader(
        _PackList(reader, packs), batch_size=None, shuffle=False, num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers else None, collate_fn=_as_is,
        worker_init_fn=_own_process_group,
        multiprocessing_context=_WORKER_START if num_workers else None,
        # The iterator draws its workers' base seed from this generator, not from the process's
        # RNG: the draws of training (LoRA dropout) are then the same whether a run started here
        # or resumed (a checkpoint restores the process's RNG states before the first pack).
        generator=torch.Generator().manual_seed(0))
    for item in loader:
        if isinstance(item, LoadFailure):
            raise DataError(item.message)
        yield item
