"""Lighthouse persistence: the last quorum_id, the last quorum and an event log.

Why: ``quorum_id`` must never go backwards for a job (replica groups key store prefixes
and healing on it), so a restarted lighthouse continues from the last one it handed out.
The event log (joins, leaves, quorums, kills) feeds ``/status`` and ``rallypoint status``.

Design choices:

* SQLite in WAL mode: one file, crash-safe, readable with the ``sqlite3`` CLI.
  ``synchronous=NORMAL`` survives a killed process (the case that matters: a
  SIGKILLed lighthouse); a power cut may lose the last few writes, which only costs
  a quorum_id bump that a newly formed quorum makes anyway.
* An OS lock (``flock`` on ``<path>.lock``), not a pid file: two lighthouses on one job
  would split the quorum, and the kernel drops a ``flock`` when its holder dies, so a
  SIGKILLed lighthouse never blocks its own restart.
* Callers never wait on the disk. ``save_quorum`` and ``record_event`` run on the
  server's asyncio loop; they only hand work to a daemon writer thread, which batches
  whatever is queued into one transaction. ``events()`` is served from an in-memory ring
  buffer that is seeded from the file at start-up.
* Bounded memory: queued events are held in a ``deque(maxlen=max_events)``; if the disk
  stalls, the oldest queued events are dropped, which are exactly the ones the log trim
  would delete anyway.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from rallypoint._net.version import __version__
from rallypoint.lighthouse import _state_errors as _errors
from rallypoint.lighthouse._ledger_store import LEDGER_SCHEMA, LEDGER_TABLE
from rallypoint.lighthouse._state_errors import (  # re-exported: import the errors from here
    StateCorruptError as StateCorruptError, StateDiskFullError as StateDiskFullError,
    StateFileError as StateFileError, StateLockedError as StateLockedError,
    StateNewerError as StateNewerError, StateReadOnlyError as StateReadOnlyError,
)
from rallypoint.lighthouse.quorum import Member, Quorum

logger = logging.getLogger("rallypoint.lighthouse.state")

SCHEMA_VERSION = 1
MEMORY = ":memory:"

# The writer wakes at least this often even when idle, so a stop request is never missed.
_IDLE_WAKE_S = 1.0
# Back-off between retries of a batch that failed with a transient error (disk full, I/O).
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 5.0
# How long SQLite waits for a lock held by an outside reader (e.g. the sqlite3 CLI).
_BUSY_TIMEOUT_MS = 5000

_SCHEMA = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    f"INSERT INTO schema_version (version) VALUES ({SCHEMA_VERSION})",
    # One row (slot = 1): only the last quorum matters for a restart.
    "CREATE TABLE quorum ("
    " slot INTEGER PRIMARY KEY CHECK (slot = 1),"
    " quorum_id INTEGER NOT NULL,"
    " created REAL NOT NULL,"
    " members TEXT NOT NULL,"
    " saved REAL NOT NULL)",
    "CREATE TABLE events ("
    " id INTEGER PRIMARY KEY,"
    " time REAL NOT NULL,"
    " kind TEXT NOT NULL,"
    " replica_id TEXT,"
    " detail TEXT NOT NULL)",
)
_CORRUPT_CODES = (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)
_OUR_TABLES = {"schema_version", "quorum", "events"}
_MEMBER_FIELDS = tuple(f.name for f in dataclasses.fields(Member))
# Expected JSON types of the saved member fields, taken from Member's defaults (a tuple is saved as a list).
_MEMBER_TYPES: dict[str, type] = {f.name: list if isinstance(f.default, tuple) else type(f.default)
                                   for f in dataclasses.fields(Member) if f.default is not dataclasses.MISSING}


@dataclass(frozen=True)
class Event:
    """One entry of the lighthouse event log. ``id`` increases across restarts."""

    id: int
    time: float
    kind: str
    replica_id: str | None
    detail: dict


@dataclass(frozen=True)
class Restored:
    """What the state file held when the store was opened (all zero/None when fresh)."""

    quorum_id: int
    last_quorum: Quorum | None
    events: int


def _quorum_key(quorum: Quorum) -> tuple[int, tuple[Member, ...]]:
    """What "changed" means for a quorum: id and members, not the ``created`` stamp."""
    return (quorum.quorum_id, quorum.members)


def _detail_json(detail: dict) -> str:
    """Serialize an event's detail without ever failing: a bad detail must not poison
    the writer's batch, so anything JSON cannot encode is stored as its ``str``."""
    try:
        return json.dumps(detail, default=str, sort_keys=True)
    except (TypeError, ValueError) as e:  # circular references, non-string keys mix
        return json.dumps({"unserializable": repr(detail), "error": str(e)})


class StateStore:
    """The lighthouse's state file. See the module docstring for the design.

    ``path == ":memory:"`` keeps everything in this process (no file, no lock, no
    writer thread) with the same API, for tests and ``--state :memory:``.
    """

    def __init__(self, path: str, *, max_events: int = 10_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._path = os.fspath(path)
        self._max_events = max_events
        self._memory = self._path == MEMORY
        # Trim the on-disk log now and then, not on every write: a DELETE per event would
        # double the write cost for no benefit; the file holds at most max_events + this.
        self._trim_every = max(1, min(1000, max_events // 10))

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ring: collections.deque[Event] = collections.deque(maxlen=max_events)
        self._pending_events: collections.deque[Event] = collections.deque(maxlen=max_events)
        self._pending_quorum: Quorum | None = None
        self._waiters: list[_Waiter] = []
        self._accepted_key: tuple[int, tuple[Member, ...]] | None = None
        self._written_key: tuple[int, tuple[Member, ...]] | None = None
        self._writes = 0
        self._since_trim = 0
        self._next_id = 1
        self._stopping = False
        self._close_started = False
        self._closed = False
        self._warned_closed = False
        self._lock_fd: int | None = None
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None

        if self._memory:
            self._restored = Restored(quorum_id=0, last_quorum=None, events=0)
            logger.info("lighthouse state kept in memory only (%s): nothing survives a restart", MEMORY)
            return

        self._existed = _errors.holds_data(self._path)  # for the advice if opening fails: keep it or not
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
            self._lock_fd = self._acquire_lock()
        except OSError as e:  # read-only directory, full disk: say so instead of an errno
            raise _errors.startup_error(self._path, e, self._existed) from e
        try:
            self._restored = self._open()
        except BaseException:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
            self._release_lock()
            raise
        self._thread = threading.Thread(target=self._run, name="rallypoint-state-writer", daemon=True)
        self._thread.start()
        r = self._restored
        members = list(r.last_quorum.replica_ids) if r.last_quorum else "none"
        logger.info("state file %s: quorum_id=%d, members %s, %d events", self._path, r.quorum_id, members, r.events)

    # ------------------------------------------------------------------ public API

    @property
    def path(self) -> str:
        return self._path

    @property
    def writes(self) -> int:
        """Quorum rows written (in memory mode: quorum changes accepted). Lets tests and
        metrics check that an unchanged quorum is not rewritten every round."""
        return self._writes

    def restore(self) -> Restored:
        """The state as it was when this store opened; read once, at start-up."""
        return self._restored

    def save_quorum(self, quorum: Quorum) -> None:
        """Remember ``quorum`` as the last one. Never waits on the disk.

        Unchanged quorums (same id and members) are skipped here already, so the fast
        path re-forming the same quorum every step costs a comparison, not a wake-up.
        """
        key = _quorum_key(quorum)
        with self._cond:
            if key == self._accepted_key:
                return
            self._accepted_key = key
            if self._memory:
                self._writes += 1
                return
            if self._closed:
                self._warn_closed_locked("save_quorum")
                return
            self._pending_quorum = quorum
            self._cond.notify()

    def record_event(self, kind: str, replica_id: str | None = None, **detail: Any) -> Event:
        """Append an event to the log and return it. Never waits on the disk."""
        with self._cond:
            event = Event(
                id=self._next_id, time=time.time(), kind=kind, replica_id=replica_id, detail=dict(detail)
            )
            self._next_id += 1
            self._ring.append(event)
            if self._memory:
                return event
            if self._closed:
                self._warn_closed_locked("record_event")
                return event
            if len(self._pending_events) == self._max_events:
                logger.debug("state file %s: writer behind, dropping oldest queued event", self._path)
            self._pending_events.append(event)
            self._cond.notify()
        return event

    def events(self, limit: int = 100, since_id: int | None = None, replica_id: str | None = None) -> list[Event]:
        """Up to ``limit`` newest events with ``id > since_id`` (and of ``replica_id``
        when given), oldest first. Served from memory: no disk read on the loop."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        out: list[Event] = []
        if limit == 0:
            return out
        with self._lock:
            for event in reversed(self._ring):
                if since_id is not None and event.id <= since_id:
                    break  # ids increase along the ring: nothing older can match
                if replica_id is not None and event.replica_id != replica_id:
                    continue
                out.append(event)
                if len(out) >= limit:
                    break
        out.reverse()
        return out

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued before this call is on disk.

        Returns False on timeout, and also when the queued writes failed for good (the
        failure is logged); True when they are committed (always True in memory mode).
        """
        if self._memory:
            return True
        waiter = _Waiter()
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                return not self._has_work_locked()
            self._waiters.append(waiter)
            self._cond.notify()
        return waiter.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush, stop the writer, close the database and release the lock. Idempotent.

        After close, ``record_event`` still returns events (kept in memory) so a server
        shutting down never crashes on a late event; nothing more reaches the file.
        """
        with self._cond:
            if self._close_started:
                return
            self._close_started = True
            if self._memory:
                self._closed = True
                return
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            logger.warning("state file %s: queued writes not on disk after %.1fs at close", self._path, timeout)
        with self._cond:
            self._closed = True
            self._stopping = True
            self._cond.notify()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if thread.is_alive():
                # The writer is stuck in the filesystem; it closes the connection itself
                # when it returns. Releasing the lock is still right: we are going away.
                logger.warning("state file %s: writer thread did not stop in time; leaving it", self._path)
        self._release_lock()
        logger.info("lighthouse state file %s closed", self._path)

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ opening

    def _acquire_lock(self) -> int:
        """Take the exclusive flock and write who holds it, for the next one's error."""
        fd = os.open(f"{self._path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _errors.read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise StateLockedError(_errors.locked_message(self._path, holder), self._path) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        data = (json.dumps(info) + "\n").encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError:  # a full disk: the caller reports it; the lock goes with the fd
            os.close(fd)
            raise
        return fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _corrupt(self, what: str) -> StateCorruptError:
        return StateCorruptError(_errors.corrupt_message(self._path, what), self._path)

    def _open(self) -> Restored:
        """Open the file, check it is ours (or empty), create the schema if needed, then
        read the last quorum and the newest events and trim the log to ``max_events``."""
        if os.path.exists(self._path) and not os.access(self._path, os.W_OK):
            # SQLite would open it read-only without a word and fail at the first write.
            denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), self._path)
            raise _errors.startup_error(self._path, denied, self._existed)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one per batch.
        self._conn = conn = sqlite3.connect(
            self._path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_MS / 1000
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            # Check before switching to WAL, which would write to a file that is not ours.
            check = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
            if check != ["ok"]:
                raise self._corrupt("integrity check failed: " + "; ".join(map(str, check[:3])))
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and ("schema_version" not in tables or not _OUR_TABLES <= tables):
                raise self._corrupt(f"it holds other tables ({', '.join(sorted(tables))})")
            if tables:
                versions = [row[0] for row in conn.execute("SELECT version FROM schema_version")]
                if versions != [SCHEMA_VERSION]:  # checked before WAL: the file stays untouched
                    raise _errors.schema_error(self._path, versions, SCHEMA_VERSION, __version__)
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                logger.warning("state file %s: WAL journal not available (got %s)", self._path, mode)
            conn.execute("PRAGMA synchronous = NORMAL")
            if LEDGER_TABLE not in tables:  # a new file, or one from before the goodput ledger (no bump needed)
                with _transaction(conn):
                    for statement in (() if tables else _SCHEMA) + LEDGER_SCHEMA:
                        conn.execute(statement)
            row = conn.execute("SELECT quorum_id, created, members FROM quorum WHERE slot = 1").fetchone()
            quorum = None if row is None else self._parse_quorum(*row)
            with _transaction(conn):
                self._trim(conn)
            count, max_id = conn.execute("SELECT COUNT(*), MAX(id) FROM events").fetchone()
            rows = conn.execute(
                "SELECT id, time, kind, replica_id, detail FROM events ORDER BY id DESC LIMIT ?", (self._max_events,)
            ).fetchall()
            for event_id, ts, kind, rid, text in reversed(rows):
                self._ring.append(Event(int(event_id), float(ts), str(kind), rid, self._parse_detail(event_id, text)))
            self._next_id = int(max_id or 0) + 1
        except (TypeError, ValueError) as e:  # a row edited by hand into the wrong types
            raise self._corrupt(f"an event row cannot be read ({e})") from e
        except sqlite3.DatabaseError as e:
            code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF  # the primary code of an extended one
            if isinstance(e, sqlite3.OperationalError) and code not in _CORRUPT_CODES:
                # I/O, permissions, a full disk, a lock held outside rallypoint: not the file's fault
                raise _errors.startup_error(self._path, e, self._existed) from e
            raise self._corrupt(str(e)) from e
        if quorum is not None:
            self._accepted_key = self._written_key = _quorum_key(quorum)
        return Restored(quorum_id=quorum.quorum_id if quorum else 0, last_quorum=quorum, events=int(count))

    def _parse_quorum(self, quorum_id: Any, created: Any, members_text: Any) -> Quorum:
        """Strict: a wrong last quorum would make the lighthouse hand out a wrong id."""
        try:
            raw = json.loads(members_text)
            if not isinstance(raw, list) or isinstance(quorum_id, bool) or not isinstance(quorum_id, int):
                raise ValueError("unexpected shape")
            members = []
            for item in raw:
                if not isinstance(item, dict) or not isinstance(item.get("replica_id"), str):
                    raise ValueError(f"bad member {item!r:.80}")
                for name, kind in _MEMBER_TYPES.items():
                    if name in item and not isinstance(item[name], kind):
                        raise ValueError(f"member field {name}={item[name]!r:.40} is not {kind.__name__}")
                members.append(Member(**{k: item[k] for k in _MEMBER_FIELDS if k in item}))
            return Quorum(quorum_id=quorum_id, members=tuple(members), created=float(created))
        except (TypeError, ValueError) as e:
            raise self._corrupt(f"the saved quorum cannot be read ({e})") from e

    def _parse_detail(self, event_id: Any, text: Any) -> dict:
        """Lenient: the event log is diagnostics, one bad row must not stop a restart."""
        try:
            value = json.loads(text)
        except (TypeError, ValueError):
            logger.warning("state file %s: event %s has unreadable detail; kept as raw text", self._path, event_id)
            return {"raw": str(text)}
        return value if isinstance(value, dict) else {"value": value}

    # ------------------------------------------------------------------ writer thread

    def _has_work_locked(self) -> bool:
        return self._pending_quorum is not None or bool(self._pending_events) or bool(self._waiters)

    def _warn_closed_locked(self, what: str) -> None:
        if not self._warned_closed:
            self._warned_closed = True
            logger.warning("state file %s: %s after close is kept in memory only", self._path, what)

    def _run(self) -> None:
        """Batch whatever is queued into one transaction; retry transient failures."""
        backoff, failures = 0.0, 0
        try:
            while True:
                with self._cond:
                    if backoff:
                        # New events notify too; only a stop request cuts the back-off short.
                        self._cond.wait_for(lambda: self._stopping, timeout=backoff)
                    else:
                        self._cond.wait_for(lambda: self._stopping or self._has_work_locked(), timeout=_IDLE_WAKE_S)
                    if not self._has_work_locked():
                        if self._stopping:
                            return
                        continue
                    quorum, self._pending_quorum = self._pending_quorum, None
                    events = list(self._pending_events)
                    self._pending_events.clear()
                    waiters, self._waiters = self._waiters, []
                    stopping = self._stopping
                try:
                    self._write_batch(quorum, events)
                except Exception as e:
                    transient = isinstance(e, (sqlite3.OperationalError, OSError))
                    cause = _errors.write_failure(self._path, e) if transient else str(e)  # disk full? read-only?
                    if transient and not stopping:  # disk full, I/O error: keep the batch, retry
                        failures += 1
                        backoff = min(max(_RETRY_MIN_S, backoff * 2), _RETRY_MAX_S)
                        if failures == 1:
                            logger.error(
                                "state file %s: cannot save: %s. The lighthouse keeps serving, but new quorum_ids "
                                "and events are not on disk until this is fixed (a lighthouse restarted meanwhile "
                                "could reuse an older quorum_id); retrying in %.1fs", self._path, cause, backoff,
                            )
                        elif _errors.should_log_retry(failures):
                            logger.error("state file %s: still cannot save after %d attempts: %s; retrying in %.1fs",
                                         self._path, failures, cause, backoff)
                        self._requeue(quorum, events, waiters)
                        continue
                    logger.error(
                        "state file %s: dropping %d event(s)%s, write failed: %s", self._path, len(events),
                        " and the last quorum" if quorum else "", cause, exc_info=not transient,
                    )
                    self._forget_quorum(quorum)
                    _release(waiters, False)
                else:
                    if failures:
                        logger.warning("state file %s: saved again after %d failed attempt(s)", self._path, failures)
                    _release(waiters, True)
                backoff, failures = 0.0, 0
        except BaseException:  # pragma: no cover - a bug here must at least be visible
            logger.exception("state file %s: writer thread died; state is no longer saved", self._path)
            raise
        finally:
            with self._cond:
                pending = self._waiters
                self._waiters = []
            _release(pending, False)
            conn, self._conn = self._conn, None
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error as e:
                    logger.warning("state file %s: error closing database: %s", self._path, e)

    def _requeue(self, quorum: Quorum | None, events: list[Event], waiters: list[_Waiter]) -> None:
        """Put a failed batch back in front of anything queued since, keeping order."""
        with self._cond:
            if quorum is not None and self._pending_quorum is None:
                self._pending_quorum = quorum
            merged: collections.deque[Event] = collections.deque(events, maxlen=self._max_events)
            merged.extend(self._pending_events)
            self._pending_events = merged
            self._waiters = waiters + self._waiters

    def _forget_quorum(self, quorum: Quorum | None) -> None:
        """After a dropped quorum write, let the next identical save_quorum try again."""
        if quorum is None:
            return
        with self._cond:
            if self._accepted_key == _quorum_key(quorum):
                self._accepted_key = self._written_key

    def _write_batch(self, quorum: Quorum | None, events: list[Event]) -> None:
        """One transaction: the quorum if it changed, the events, a trim when due."""
        conn = self._conn
        if conn is None:
            raise sqlite3.OperationalError("database connection is closed")
        key = _quorum_key(quorum) if quorum is not None else None
        write_quorum = quorum is not None and key != self._written_key
        if not write_quorum and not events:
            return
        trim = self._since_trim + len(events) >= self._trim_every
        rows = [(e.id, e.time, e.kind, e.replica_id, _detail_json(e.detail)) for e in events]
        with _transaction(conn):
            if write_quorum:
                assert quorum is not None
                members = json.dumps([dataclasses.asdict(m) for m in quorum.members])
                conn.execute(
                    "INSERT OR REPLACE INTO quorum (slot, quorum_id, created, members, saved) VALUES (1, ?, ?, ?, ?)",
                    (quorum.quorum_id, quorum.created, members, time.time()),
                )
            if rows:
                conn.executemany(
                    "INSERT OR REPLACE INTO events (id, time, kind, replica_id, detail) VALUES (?, ?, ?, ?, ?)", rows
                )
            if trim:
                self._trim(conn)
        self._since_trim = 0 if trim else self._since_trim + len(events)
        if write_quorum:
            with self._lock:
                self._written_key = key
                self._writes += 1

    def _trim(self, conn: sqlite3.Connection) -> None:
        """Keep the newest ``max_events`` rows of the log (inside the caller's transaction)."""
        conn.execute(
            "DELETE FROM events WHERE id < (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (self._max_events - 1,),
        )


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any error (the connection autocommits)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise
    conn.execute("COMMIT")


class _Waiter:
    """A flush request: set by the writer once the batch it rode in is committed."""

    __slots__ = ("_done", "ok")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.ok = False

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout) and self.ok

    def set(self, ok: bool) -> None:
        self.ok = ok
        self._done.set()


def _release(waiters: list[_Waiter], ok: bool) -> None:
    for waiter in waiters:
        waiter.set(ok)
