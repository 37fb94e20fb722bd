"""Writing one Hugging Face model directory from every rank at once (the rank-parallel publish and
final export), with the index and the marker last.

    PARENT/.tmp-NAME/                        rank 0 empties and creates it; all ranks agree
        config.json, generation_config.json  rank 0, on the calling thread (`extra`)
        tokenizer and processor files
        model-0000K-of-0000N.safetensors     each rank its own share (training/shards.py),
        .rank-R.written                      flushed to the disk, then its mark, flushed
    then rank 0, once the mark of every writing rank is there, or once the ranks agreed that all
    wrote theirs (a network filesystem may show another node's mark late):
        the marks removed, model.safetensors.index.json (more than one shard), every file and
        the directory flushed, `seal` (publish's STABLE), the directory flushed, renamed to
        PARENT/NAME (an earlier directory there is replaced), the parent flushed, then `after`
        (publish.keep's pruning)

A rank writes its share on the calling thread, or (`background`) on a thread of its own; on rank 0
that thread also finishes the directory once every mark is there. The thread only writes files and
never takes part in a collective: the ranks agree on the outcome on the main thread (`settle`), at
a point every rank reaches. A failure on any rank raises CheckpointError on every rank there and
removes the temporary directory. `abandon` leaves an unfinished write behind as the `.tmp-`
directory, which no reader takes for a model directory (the next write of the same name, or the
next run's publisher, removes it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vlmcp.errors import CheckpointError
from vlmcp.parallel import comm
from vlmcp.parallel.agree import fail_together
from vlmcp.training.atomic import (fsync_path, fsync_tree, remove_quietly, replace_dir,
                                   write_error)
from vlmcp.training.hf_format import INDEX_NAME, index_text, write_shard
from vlmcp.training.shards import SharePlan

logger = logging.getLogger(__name__)

#: Seconds between two looks of rank 0's thread for the other ranks' marks.
_MARK_POLL_S = 0.02


def _mark(directory: Path, rank: int) -> Path:
    return directory / f".rank-{rank}.written"


class ShardedWrite:
    """One directory in the making (see the module docstring). Create it with `begin`."""

    def __init__(self, out_dir: Path, plan: SharePlan, what: str,
                 seal: Callable[[Path], None] | None, after: Callable[[Path], None] | None):
        self.out_dir, self.plan, self.what = out_dir, plan, what
        self.tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        self._seal, self._after = seal, after
        self.rank = comm.rank()
        self._written = threading.Event()
        self._all_written = threading.Event()
        self._abandoned = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: dict[str, torch.Tensor] | None = None
        self._problem: str | None = None
        self._final_problem: str | None = None
        self._finished = False
        #: perf_counter() when rank 0 renamed the finished directory into place.
        self.finished_at: float | None = None

    @classmethod
    def begin(cls, out_dir: str | Path, plan: SharePlan, *, what: str,
              replaceable: Callable[[Path], bool], seal: Callable[[Path], None] | None = None,
              after: Callable[[Path], None] | None = None) -> ShardedWrite:
        """Start writing `out_dir` (call on every rank). Rank 0 refuses a non-empty `out_dir`
        that is not `replaceable` (an earlier directory of the same kind) and creates an empty
        `.tmp-` directory beside it; every rank raises CheckpointError when it could not."""
        write = cls(Path(out_dir).absolute(), plan, what, seal, after)
        problems = []
        if write.rank == 0:
            out = write.out_dir
            if out.is_dir() and any(out.iterdir()) and not replaceable(out):
                problems.append(f"writing the {what}: {out} exists and is not a directory of "
                                f"{what}; it would be replaced, so choose a new or empty one")
            else:
                try:
                    remove_quietly(write.tmp)
                    write.tmp.mkdir(parents=True)
                except OSError as exc:
                    problems.append(f"writing the {what}: {write_error(exc, write.tmp)}")
        fail_together(problems, CheckpointError)
        return write

    def start(self, share: dict[str, torch.Tensor], *, background: bool,
              extra: Callable[[Path], None] | None = None) -> None:
        """Write this rank's part: `extra(tmp)` first on rank 0, on this thread (the config and
        processor files: they read the live model's config), then its shard of `share`, here or
        on a background thread (`share` must then be a copy nothing changes)."""
        if extra is not None and self.rank == 0:
            try:
                extra(self.tmp)
            except Exception as exc:  # any failure is agreed, never one rank's alone
                self._problem = self._describe(exc, self.tmp)
        if not background:
            self._write_own(share)
            return
        self._pending = share
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"vlmcp-write-{self.out_dir.name}")
        self._thread.start()

    def _describe(self, exc: BaseException, path: Path) -> str:
        needed = self.plan.bytes_of(self.rank) or None
        return f"writing the {self.what} to {self.out_dir}: {write_error(exc, path, needed)}"

    def _write_own(self, share: dict[str, torch.Tensor]) -> None:
        try:
            shard = self.plan.shard_of(self.rank)
            if self._problem is None and shard is not None:
                path = self.tmp / self.plan.files[shard]
                try:
                    write_shard(share, path)
                except Exception as exc:  # any failure is agreed, never one rank's alone
                    self._problem = self._describe(exc, path)
            if self._problem is None:
                mark = _mark(self.tmp, self.rank)
                try:
                    mark.write_text("")
                    fsync_path(mark)
                except OSError as exc:
                    self._problem = self._describe(exc, mark)
        finally:
            self._written.set()

    def _run(self) -> None:
        """Background: this rank's shard; rank 0 then finishes the directory once every writing
        rank's mark is there (or the ranks agreed that all wrote theirs)."""
        share, self._pending = self._pending, None
        self._write_own(share or {})
        del share
        if self.rank != 0 or self._problem is not None:
            return
        others = [_mark(self.tmp, r) for r in self.plan.writer_of if r != 0]
        while not self._abandoned.is_set():
            if self._all_written.is_set() or all(m.exists() for m in others):
                self._finish()
                return
            self._abandoned.wait(_MARK_POLL_S)

    def _finish(self) -> None:
        """Rank 0: index, marker, rename, once (see the module docstring)."""
        with self._lock:
            if self._finished or self._abandoned.is_set():
                return
            self._finished = True
            try:
                for mark in self.tmp.glob(".rank-*.written"):
                    mark.unlink()
                if len(self.plan.files) > 1:
                    (self.tmp / INDEX_NAME).write_text(index_text(
                        self.plan.weight_map(), self.plan.total_size,
                        self.plan.total_parameters))
                fsync_tree(self.tmp)
                if self._seal is not None:
                    self._seal(self.tmp)
                    fsync_path(self.tmp)
                replace_dir(self.tmp, self.out_dir)
                fsync_path(self.out_dir.parent)
            except Exception as exc:  # any failure is agreed, never one rank's alone
                self._final_problem = self._describe(exc, self.tmp)
                remove_quietly(self.tmp)
                return
            self.finished_at = time.perf_counter()
        if self._after is not None:
            try:
                self._after(self.out_dir)
            except Exception as exc:  # the directory is in place; tidying after it is optional
                logger.warning("after writing %s: %s", self.out_dir, exc)

    def _agree(self) -> tuple[bool, bool]:
        """(any rank failed, every rank wrote its part): one small all-reduce."""
        failed = self._written.is_set() and self._problem is not None
        flags = torch.tensor([float(failed), float(not self._written.is_set())],
                             dtype=torch.float64)
        comm.all_reduce_max(flags)
        return bool(flags[0]), not bool(flags[1])

    def settle(self, wait: bool) -> bool:
        """Whether the directory is complete (call on every rank at the same point): after every
        rank wrote its part, rank 0 finishes it. `wait`: wait for this rank's part first; else a
        part still being written anywhere gives False. CheckpointError on every rank when any
        rank's write (or rank 0's finish) failed; the temporary directory is then removed."""
        if wait:
            self._written.wait()
        failed, written = self._agree()
        if failed:
            self._abandoned.set()
            self._written.wait()
            self._fail([self._problem] if self._problem else [])
        if not written:
            return False
        problem = self._finish_on_rank0()
        fail_together([problem] if problem else [], CheckpointError)
        return True

    def _finish_on_rank0(self) -> str | None:
        """Once every rank wrote its part: rank 0 finishes the directory (or waits for its thread
        to); returns rank 0's problem in finishing it, if any."""
        if self.rank != 0:
            return None
        self._all_written.set()
        if self._thread is not None:
            self._thread.join()
        else:
            self._finish()
        return self._final_problem

    def _fail(self, problems: list[str]) -> None:
        try:
            fail_together(problems, CheckpointError)
        finally:
            if self.rank == 0:
                remove_quietly(self.tmp)

    def settle_within(self, wait_s: float) -> str | None:
        """Finish the directory if every rank writes its part within `wait_s` seconds, else
        abandon it (call on every rank at the same point: a stop). Returns this rank's problem,
        if any (logged; nothing is raised, as the run is stopping)."""
        self._written.wait(wait_s)
        failed, written = self._agree()
        if failed or not written:
            self.abandon()
            return self._problem
        return self._finish_on_rank0()

    def abandon(self) -> None:
        """Leave the write unfinished (no collective): rank 0 never writes the marker or renames;
        the `.tmp-` directory stays behind."""
        self._abandoned.set()

    @property
    def complete(self) -> bool:
        """Rank 0: whether the directory is in place."""
        return self.finished_at is not None
