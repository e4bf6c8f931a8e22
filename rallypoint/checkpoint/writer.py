"""The background writer: one thread per rank that writes this rank's staged share with
``dcp.save`` and, on the committer (writer 0), waits for every other share's
done-marker, merges the metadata, writes the commit marker last and prunes.

A failure (unwritable path, full disk, a path that vanished, a share that never came)
is counted and logged once per cause; training never sees it. The last complete
checkpoint is never touched by a failed write: pruning happens only after a newer one
is complete.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp

from rallypoint.checkpoint import storage
from rallypoint.checkpoint.plan import Share, prune
from rallypoint.checkpoint.storage import ERRORS

log = logging.getLogger("rallypoint.checkpoint")
# Every share is one process's own dcp.save (no_dist), on purpose: not worth a warning each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


@dataclass
class Job:
    """One staged share, ready to write."""

    share: Share
    data: dict[str, Any]
    paths: dict[str, tuple[Any, ...]]
    nbytes: int
    replica_ids: tuple[str, ...] = ()
    int_keyed: list[str] = field(default_factory=list)  # dicts whose keys were integers (stage.flatten)


@dataclass
class Counters:
    """What ``/metrics`` and ``/status`` show of this rank's checkpointing."""

    writes: int = 0  # shares written
    commits: int = 0  # checkpoints this rank marked complete (the committer)
    bytes: int = 0  # bytes of shares written
    last_bytes: int = 0  # of the last share written
    failures: int = 0
    skipped: int = 0  # intervals skipped because the previous write was still in flight
    stall_s: float = 0.0  # training-thread time spent staging, in total
    last_stall_s: float = 0.0
    last_write_s: float = 0.0  # wall time of the last share's dcp.save
    last_complete_step: int | None = None
    last_complete_time: float | None = None  # time.time() of its commit marker
    causes: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "causes"}
        d["last_complete_age_s"] = (None if self.last_complete_time is None
                                    else max(0.0, time.time() - self.last_complete_time))
        return d


def unwrap(e: BaseException) -> BaseException:
    """The first underlying error of a DCP ``CheckpointException`` (it wraps each rank's)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for v in failures.values():
            inner = v[0] if isinstance(v, tuple) and v else v
            if isinstance(inner, BaseException):
                return inner
    return e


def cause_of(e: BaseException) -> str:
    """A short name for a failure's cause, so each is logged once (``ENOSPC``, ``EACCES``, ...)."""
    e = unwrap(e)
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, OSError) and x.errno:
            return errno.errorcode.get(x.errno, str(x.errno))
    return type(e).__name__


@dataclass
class _Pending:
    """A checkpoint writer 0 wrote its share of, waiting for the others' done-markers."""

    job: Job
    folder: str
    deadline: float
    missing: list[str]


class Writer:
    """The thread that writes staged shares, one at a time, and (writer 0) commits them.

    A commit waits for the other shares without holding up the next share: the thread
    checks pending commits between writes."""

    def __init__(self, store: storage.Store, keep: int, commit_timeout: float, label: str) -> None:
        self.store = store
        self.keep = keep
        self.commit_timeout = commit_timeout
        self.label = label  # "replica X rank r", for log lines
        self.counters = Counters()
        self._lock = threading.Lock()
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=1)
        self._idle = threading.Event()  # no share being written
        self._idle.set()
        self._done = threading.Event()  # no share being written and no commit pending
        self._done.set()
        self._pending: list[_Pending] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rallypoint-checkpoint", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """A share is being written (a new one would be skipped)."""
        return not self._idle.is_set()

    def submit(self, job: Job) -> bool:
        """Queue a staged share; False (and counted as skipped) while one is in flight."""
        with self._lock:
            if self.busy():
                self.counters.skipped += 1
                return False
            self._idle.clear()
            self._done.clear()
            self._q.put_nowait(job)
        return True

    def wait(self, timeout: float) -> bool:
        """Wait for the share in flight and this rank's pending commits (True: none left)."""
        return self._done.wait(timeout)

    def close(self, timeout: float) -> None:
        """Let the writes and commits in flight finish (at most ``timeout``), then stop the thread."""
        self._done.wait(timeout)
        self._closing.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.1, timeout))

    def failed(self, what: str, e: BaseException) -> None:
        """Count a failure; log it in full the first time its cause is seen."""
        cause = cause_of(e)
        e = unwrap(e)
        with self._lock:
            self.counters.failures += 1
            first = cause not in self.counters.causes
            self.counters.causes.add(cause)
        if first:
            log.error("[%s] durable checkpoint %s failed (%s): %s: %s; training goes on, the last complete "
                      "checkpoint is kept; later failures of this cause are only counted", self.label, what,
                      cause, type(e).__name__, e)
        else:
            log.debug("[%s] durable checkpoint %s failed again (%s)", self.label, what, cause)

    def _run(self) -> None:
        while True:
            job: Any
            try:
                job = self._q.get(timeout=0.05) if self._pending else self._q.get()
            except queue.Empty:
                job = None if self._closing.is_set() else _NOTHING
            if job is None and not self._pending:
                return
            if isinstance(job, Job):
                try:
                    self._write(job)
                except ERRORS as e:  # noqa: BLE001
                    self.failed(f"step {job.share.step} (share {job.share.index}/{job.share.writers})", e)
                finally:
                    self._idle.set()
            self._poll_commits()
            with self._lock:  # not between a submit's clear and its put
                if self._idle.is_set() and not self._pending and self._q.empty():
                    self._done.set()
            if job is None:
                return

    def _write(self, job: Job) -> None:
        share = job.share
        folder = self.store.step_dir(share.step)
        t0 = time.monotonic()
        self.store.makedirs(folder)
        dcp.save(job.data, storage_writer=self.store.writer(folder, share.step, share.attempt, share.index, job.paths),
                 no_dist=True)
        dt = time.monotonic() - t0
        with self._lock:
            self.counters.writes += 1
            self.counters.bytes += job.nbytes
            self.counters.last_bytes = job.nbytes
            self.counters.last_write_s = dt
        log.info("[%s] wrote share %d/%d of step %d: %d bytes in %.2fs", self.label, share.index, share.writers,
                 share.step, job.nbytes, dt)
        if share.index == 0:
            names = [storage.share_metadata_name(share.attempt, i) for i in range(share.writers)]
            self._pending.append(_Pending(job, folder, time.monotonic() + self.commit_timeout, names))

    def _poll_commits(self) -> None:
        """Commit every pending checkpoint whose shares all landed; give up on those past
        their deadline (the step stays incomplete; the next interval tries again)."""
        for p in list(self._pending):
            share = p.job.share
            try:
                p.missing = [n for n in p.missing if not self.store.exists(self.store.child(p.folder, n))]
                if not p.missing:
                    self._pending.remove(p)
                    self._commit(p.job, p.folder)
                elif time.monotonic() >= p.deadline or self._closing.is_set():
                    self._pending.remove(p)
                    raise TimeoutError(
                        f"step {share.step} stays incomplete: {len(p.missing)} of {share.writers} shares did not land "
                        f"within {self.commit_timeout:.0f}s (first missing: {p.missing[0]}); the next interval "
                        "tries again")
            except ERRORS as e:  # noqa: BLE001
                if p in self._pending:
                    self._pending.remove(p)
                self.failed(f"committing step {share.step}", e)

    def _commit(self, job: Job, folder: str) -> None:
        """Merge the shares' metadata into ``.metadata``, then write the commit marker."""
        share = job.share
        names = [storage.share_metadata_name(share.attempt, i) for i in range(share.writers)]
        parts = [storage.read_metadata(self.store, self.store.child(folder, n)) for n in names]
        self.store.write_atomic(self.store.child(folder, storage.METADATA),
                                _pickle(storage.merge_metadata(parts)))
        now = time.time()
        storage.write_marker(self.store, folder, {
            "step": share.step, "writers": share.writers, "attempt": share.attempt, "time": now,
            "replica_ids": list(job.replica_ids), "format": "torch.distributed.checkpoint",
            "int_keyed": job.int_keyed,
        })
        with self._lock:
            self.counters.commits += 1
            self.counters.last_complete_step, self.counters.last_complete_time = share.step, now
        log.info("[%s] checkpoint step %d complete (%d shares) at %s", self.label, share.step, share.writers, folder)
        self._prune(share.step)

    def _prune(self, newest: int) -> None:
        complete: list[int] = []
        incomplete: list[int] = []
        for s in self.store.steps():
            if s > newest:
                continue
            ok, _ = storage.check_complete(self.store, self.store.step_dir(s)) if s != newest else ({}, "")
            (complete if ok is not None else incomplete).append(s)
        for s in prune(complete, incomplete, self.keep):
            try:
                self.store.remove_tree(self.store.step_dir(s))
                log.info("[%s] pruned checkpoint step %d (keep=%d)", self.label, s, self.keep)
            except ERRORS as e:  # noqa: BLE001
                self.failed(f"pruning step {s}", e)


_NOTHING = object()  # a wake-up to check pending commits


def _pickle(obj: Any) -> bytes:
    import pickle

    return pickle.dumps(obj)


__all__ = ["Counters", "Job", "Writer", "cause_of"]
