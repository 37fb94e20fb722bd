"""Writing one Hugging Face model directory from every rank at once (the rank-parallel publish and
final export), with the index and the marker last.

    PARENT/.tmp-NAME/                        rank 0 empties and creates it; all ranks agree
        config.json, generation_config.json  rank 0, on the calling thread (`extra`)
        tokenizer and processor files
        model-0000K-of-0000N.safetensors     a writing rank's share (training/weights/shards.py),
        .rank-R.written                      flushed to the disk, then its mark, flushed as
                                             .rank-R.written.tmp and renamed, the rank's last
                                             act in the directory (a rank without a share
                                             writes neither)
    then rank 0, once the mark of every writing rank is there, or once the ranks agreed that all
    wrote theirs (a network filesystem may show another node's mark late):
        the marks removed, model.safetensors.index.json (more than one shard), every file and
        the directory flushed, `seal` (publish's STABLE), the directory flushed, renamed to
        PARENT/NAME (an earlier directory there is replaced), the parent flushed, then `after`
        (publish.keep's pruning)

A rank writes its share on the calling thread, or (`background`) on a thread of its own; on rank 0
that thread also finishes the directory once every mark is there. With `push` (a weight push into
running engines, training/weights/engine_push.py) each rank first hands its share to the push,
then writes it; `out_dir` None writes no directory at all: the push alone, complete once rank 0's
push returned (the engines confirm every rank's part before that). With `start_staged` the thread
first makes the share itself (training/weights/shards.py: the copy off the live model, `staged` once
it ended, which `wait_staged` waits for; then under ZeRO-3 the gather over the publisher's own
group, the only collectives the thread takes part in, which the ranks' threads leave together). The
ranks agree on the outcome on the main thread (`settle`), at a point every rank reaches. A
failure on any rank (a copy, a write, rank 0's finish) raises CheckpointError on every rank there
and removes the temporary directory. `abandon` leaves an unfinished write behind as the `.tmp-`
directory, which no reader takes for a model directory (the next write of the same name, or the
next run's publisher, removes it), once this rank's thread has left its collectives.
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
from vlmcp.training.weights.hf_format import INDEX_NAME, index_text, write_shard
from vlmcp.training.weights.shards import SharePlan

logger = logging.getLogger(__name__)

#: Seconds between two looks of rank 0's thread for the other ranks' marks.
_MARK_POLL_S = 0.02


def _mark(directory: Path, rank: int) -> Path:
    return directory / f".rank-{rank}.written"


class PushFailed(Exception):
    """A weight push that failed, with its whole problem line (raised by a `push`)."""


class ShardedWrite:
    """One directory in the making (see the module docstring). Create it with `begin`."""

    def __init__(self, out_dir: Path | None, plan: SharePlan, what: str,
                 seal: Callable[[Path], None] | None, after: Callable[[Path], None] | None,
                 push: Callable[[dict[str, torch.Tensor]], None] | None = None):
        self.out_dir, self.plan, self.what = out_dir, plan, what
        self.tmp = out_dir.with_name(f".tmp-{out_dir.name}") if out_dir is not None else None
        self._seal, self._after, self._push = seal, after, push
        self.rank = comm.rank()
        #: This rank no longer reads the live model, and its thread no longer takes part in a
        #: collective (both at once without `start_staged`).
        self._staged = threading.Event()
        self._collected = threading.Event()
        self._written = threading.Event()
        self._all_written = threading.Event()
        self._abandoned = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: dict[str, torch.Tensor] | None = None
        self._problem: str | None = None
        #: This rank's thread stopped with the others before writing, with no problem of its own.
        self._incomplete = False
        self._final_problem: str | None = None
        self._finished = False
        #: perf_counter() when rank 0 renamed the finished directory into place.
        self.finished_at: float | None = None

    @classmethod
    def begin(cls, out_dir: str | Path | None, plan: SharePlan, *, what: str,
              replaceable: Callable[[Path], bool], seal: Callable[[Path], None] | None = None,
              after: Callable[[Path], None] | None = None,
              push: Callable[[dict[str, torch.Tensor]], None] | None = None) -> ShardedWrite:
        """Start writing `out_dir` (call on every rank). Rank 0 refuses a non-empty `out_dir`
        that is not `replaceable` (an earlier directory of the same kind) and creates an empty
        `.tmp-` directory beside it; every rank raises CheckpointError when it could not.
        `push(share)`: called on every rank with its share before it writes it (it raises
        PushFailed); with `out_dir` None nothing is written."""
        write = cls(Path(out_dir).absolute() if out_dir is not None else None, plan, what, seal,
                    after, push)
        problems = []
        if write.rank == 0 and write.out_dir is not None:
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
        self._extra(extra)
        self._staged.set()
        self._collected.set()
        if not background:
            self._write_own(share)
            return
        self._pending = share
        self._launch(self._run)

    def start_staged(self, stage: Callable[[], None],
                     collect: Callable[[Callable[[], bool]], dict[str, torch.Tensor] | None], *,
                     extra: Callable[[Path], None] | None = None) -> None:
        """As `start` in the background, the thread making the share first: `stage()` copies
        what this rank needs of the live model (`staged` is set when it ended, also when it
        failed), then `collect(stop)` returns the share, or None when the ranks stopped together
        (`stop()`: this rank's copy failed or the write was abandoned)."""
        self._extra(extra)

        def run() -> None:
            self._pending = self._stage_and_collect(stage, collect)
            if self._pending is None:
                self._incomplete = self._problem is None
                self._written.set()
                return
            self._run()

        self._launch(run)

    def _extra(self, extra: Callable[[Path], None] | None) -> None:
        if extra is not None and self.rank == 0 and self.tmp is not None:
            try:
                extra(self.tmp)
            except Exception as exc:  # any failure is agreed, never one rank's alone
                self._problem = self._describe(exc, self.tmp)

    def _launch(self, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=self._guarded, args=(target,), daemon=True,
                                        name=f"vlmcp-write-{self._name()}")
        self._thread.start()

    def _guarded(self, target: Callable[[], None]) -> None:
        """The thread's body: whatever `target` raises is recorded before the thread ends (as
        this rank's problem while its part is unwritten, else as rank 0's problem in finishing
        the directory), so a thread that dies never counts as a write that completed."""
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - a dying thread must leave its reason
            problem = self._describe(exc, self.tmp)
            if self._written.is_set():
                self._final_problem = self._final_problem or problem
            else:
                self._problem = self._problem or problem
        finally:
            self._staged.set()
            self._collected.set()
            self._written.set()

    def _stage_and_collect(self, stage: Callable[[], None],
                           collect: Callable[[Callable[[], bool]], dict[str, torch.Tensor] | None]
                           ) -> dict[str, torch.Tensor] | None:
        """Background: `stage`, then `collect`; None when there is nothing to write."""
        try:
            try:
                stage()
            except Exception as exc:  # any failure is agreed, never one rank's alone
                self._problem = self._problem or self._staging_problem("copying", exc)
            finally:
                self._staged.set()
            try:
                return collect(lambda: self._problem is not None or self._abandoned.is_set())
            except Exception as exc:  # the connection: agreed at the next check
                self._problem = self._problem or self._staging_problem("gathering", exc)
                return None
        finally:
            self._collected.set()

    def _staging_problem(self, doing: str, exc: BaseException) -> str:
        return (f"{self._doing()}: {doing} rank {self.rank}'s share in host memory: "
                f"{type(exc).__name__}: {exc}")

    def _name(self) -> str:
        return self.out_dir.name if self.out_dir is not None else "push"

    def _doing(self) -> str:
        return (f"writing the {self.what} to {self.out_dir}" if self.out_dir is not None
                else f"pushing the {self.what}")

    def wait_staged(self) -> bool:
        """Wait until this rank no longer reads the live model (its copy ended, or failed: that
        is agreed at the next `settle`); whether it had to wait. Needs no other rank."""
        if self._staged.is_set():
            return False
        self._staged.wait()
        return True

    def _describe(self, exc: BaseException, path: Path | None) -> str:
        """The problem line of `exc`, raised writing `path`; never raises itself (a filesystem
        that failed the write may fail the look at its free space too)."""
        if isinstance(exc, PushFailed) or path is None:
            return str(exc) if isinstance(exc, PushFailed) else \
                f"{self._doing()}: {type(exc).__name__}: {exc}"
        needed = self.plan.bytes_of(self.rank) or None
        try:
            why = write_error(exc, path, needed)
        except Exception:  # noqa: BLE001 - the line must exist whatever the disk does
            why = f"cannot write {path}: {type(exc).__name__}: {exc}"
        return f"writing the {self.what} to {self.out_dir}: {why}"

    def _write_own(self, share: dict[str, torch.Tensor]) -> None:
        """This rank's shard and then its mark. A rank that writes no shard writes no mark and
        touches nothing: rank 0 waits only for the writers' marks, so the directory may already
        be finished and renamed. The mark is written and flushed under another name and shows by
        a rename, this rank's last act in the directory: once rank 0 can see it, rank 0 may
        remove it and rename the directory, so nothing of this rank's part may follow it (a
        flush of the mark after it showed failed there, on a directory already published)."""
        path = self.tmp
        try:
            if self._push is not None and self._problem is None:
                self._push(share)
            shard = self.plan.shard_of(self.rank)
            if shard is None or self._problem is not None or self.tmp is None:
                return
            path = self.tmp / self.plan.files[shard]
            write_shard(share, path)
            mark = _mark(self.tmp, self.rank)
            path = mark.with_name(f"{mark.name}.tmp")
            path.write_text("")
            fsync_path(path)
            path.rename(mark)
        except Exception as exc:  # any failure is agreed, never one rank's alone
            self._problem = self._describe(exc, path)
        finally:
            # after the problem, if any: `_agree` reads a problem wherever it reads this
            self._written.set()

    def _run(self) -> None:
        """Background: this rank's shard (`_pending`); rank 0 then finishes the directory once
        every writing rank's mark is there (or the ranks agreed that all wrote theirs)."""
        share, self._pending = self._pending, None
        self._write_own(share or {})
        del share
        if self.rank != 0 or self._problem is not None:
            return
        if self.tmp is None:
            self._finish()
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
            if self.tmp is None:
                self.finished_at = time.perf_counter()
                return
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
        """(any rank failed or stopped short, every rank wrote its part): one small
        all-reduce."""
        # One read: a thread that fails after it would otherwise read as "not failed, written".
        # The thread records its problem before it sets `_written`.
        written = self._written.is_set()
        failed = written and (self._problem is not None or self._incomplete)
        flags = torch.tensor([float(failed), float(not written)], dtype=torch.float64)
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
        if not self.complete:
            self._final_problem = self._final_problem or (
                f"{self._doing()}: rank 0's writer ended without finishing")
            self._remove_tmp()
        return self._final_problem

    def _fail(self, problems: list[str]) -> None:
        try:
            fail_together(problems, CheckpointError)
            # no rank had a problem of its own: a rank's thread stopped short, on an abandon
            raise CheckpointError([f"{self._doing()}: abandoned on "
                                   "another rank"] if self.rank == 0 else [])
        finally:
            if self.rank == 0:
                self._remove_tmp()

    def settle_within(self, wait_s: float) -> bool:
        """Finish the directory if every rank writes its part within `wait_s` seconds, else
        abandon it (call on every rank at the same point: a stop), waiting at most `wait_s` more
        for this rank's thread to leave its collectives. Returns whether the directory is in
        place, the same on every rank (one more small all-reduce). A rank's problem is logged
        there; nothing is raised, as the run is stopping."""
        self._written.wait(wait_s)
        failed, written = self._agree()
        if failed or not written:
            self.abandon(wait_s)
            problem = self._problem
        else:
            problem = self._finish_on_rank0()
        if problem:
            logger.error("rank %d: %s", self.rank, problem)
        return comm.rank_flags(self.complete)[0]

    def abandon(self, leave_s: float | None = 0.0) -> None:
        """Leave the write unfinished (no collective on this thread): rank 0 never writes the
        marker or renames; the `.tmp-` directory stays behind. Waits for this rank's copy off
        the live model to end, then at most `leave_s` seconds (None: until then) for its thread
        to leave its collectives (the ranks' threads stop together at their next agreement:
        logged when it takes longer). Afterwards `complete` no longer changes."""
        self._abandoned.set()
        # A finish already past its look at `abandoned` (rank 0's thread) renames the directory
        # into place: wait for it, so that `complete` is final once this returns and the row of
        # a directory that appears is never lost.
        with self._lock:
            pass
        self._staged.wait()
        if not self._collected.wait(leave_s):
            logger.warning("rank %d: the publish thread of %s is still in a gather after %g s; "
                           "it stops at the ranks' next agreement", self.rank, self._name(),
                           leave_s)

    def _remove_tmp(self) -> None:
        if self.tmp is not None:
            remove_quietly(self.tmp)

    @property
    def complete(self) -> bool:
        """Rank 0: whether the directory is in place."""
        return self.finished_at is not None
