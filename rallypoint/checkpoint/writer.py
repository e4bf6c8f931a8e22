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
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp

from rallypoint.checkpoint import storage
from rallypoint.checkpoint.plan import Share, prune

log = logging.getLogger("rallypoint.checkpoint")


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


def cause_of(e: BaseException) -> str:
    """A short name for a failure's cause, so each is logged once (``ENOSPC``, ``EACCES``, ...)."""
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, OSError) and x.errno:
            return errno.errorcode.get(x.errno, str(x.errno))
    return type(e).__name__


class Writer:
    """The thread that writes staged shares, one at a time."""

    def __init__(self, store: storage.Store, keep: int, commit_timeout: float, label: str) -> None:
        self.store = store
        self.keep = keep
        self.commit_timeout = commit_timeout
        self.label = label  # "replica X rank r", for log lines
        self.counters = Counters()
        self._lock = threading.Lock()
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rallypoint-checkpoint", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, job: Job) -> bool:
        """Queue a staged share; False (and counted as skipped) while one is in flight."""
        if self.busy():
            with self._lock:
                self.counters.skipped += 1
            return False
        self._idle.clear()
        self._q.put(job)
        return True

    def wait(self, timeout: float) -> bool:
        """Wait for the write in flight (True when none is left)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        """Let a write in flight finish (at most ``timeout``), then stop the thread."""
        self._idle.wait(timeout)
        self._closing.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.1, timeout))

    def failed(self, what: str, e: BaseException) -> None:
        """Count a failure; log it in full the first time its cause is seen."""
        cause = cause_of(e)
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
            job = self._q.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as e:  # noqa: BLE001
                self.failed(f"step {job.share.step} (share {job.share.index}/{job.share.writers})", e)
            finally:
                self._idle.set()

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
            self.counters.last_write_s = dt
        log.info("[%s] wrote share %d/%d of step %d: %d bytes in %.2fs", self.label, share.index, share.writers,
                 share.step, job.nbytes, dt)
        if share.index == 0:
            self._commit(job, folder)

    def _commit(self, job: Job, folder: str) -> None:
        """Writer 0: wait (bounded) for every share's done-marker, then merge and mark."""
        share = job.share
        names = [storage.share_metadata_name(share.attempt, i) for i in range(share.writers)]
        deadline = time.monotonic() + self.commit_timeout
        missing = names
        while True:
            missing = [n for n in missing if not self.store.exists(self.store.child(folder, n))]
            if not missing or time.monotonic() >= deadline or self._closing.is_set():
                break
            time.sleep(0.05)
        if missing:
            raise TimeoutError(f"step {share.step} stays incomplete: {len(missing)} of {share.writers} shares did not "
                               f"land within {self.commit_timeout:.0f}s (first missing: {missing[0]}); the next "
                               "interval tries again")
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
        complete, incomplete = [], []
        for s in self.store.steps():
            if s > newest:
                continue
            ok, _ = storage.check_complete(self.store, self.store.step_dir(s)) if s != newest else ({}, "")
            (complete if ok is not None else incomplete).append(s)
        for s in prune(complete, incomplete, self.keep):
            try:
                self.store.remove_tree(self.store.step_dir(s))
                log.info("[%s] pruned checkpoint step %d (keep=%d)", self.label, s, self.keep)
            except Exception as e:  # noqa: BLE001
                self.failed(f"pruning step {s}", e)


def _pickle(obj: Any) -> bytes:
    import pickle

    return pickle.dumps(obj)


__all__ = ["Counters", "Job", "Writer", "cause_of"]
