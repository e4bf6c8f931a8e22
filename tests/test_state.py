"""Tests for the lighthouse state file (rallypoint/lighthouse/state.py).

Why these: a restarted lighthouse must continue its quorum_id (never reuse one), two
lighthouses must never share a file, a SIGKILLed one must not block its restart, and a
damaged file must fail loudly instead of silently restarting at quorum_id 0.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.lighthouse.state import (
    Event,
    Restored,
    StateCorruptError,
    StateLockedError,
    StateStore,
)

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 10.0


def _quorum(quorum_id: int = 7, *ids: str, created: float = 1700000000.25) -> Quorum:
    members = tuple(
        Member(
            replica_id=rid,
            address=f"http://{rid}:1234",
            store_address=f"{rid}:29500",
            step=100 + i,
            world_size=8,
            shrink_only=i % 2 == 1,
            commit_failures=i,
            data='{"loss": 0.5, "tokens_per_s": 1234.5}',
        )
        for i, rid in enumerate(ids or ("replica_a", "replica_b"))
    )
    return Quorum(quorum_id=quorum_id, members=members, created=created)


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "lighthouse.db")


@pytest.fixture
def store(db: str):
    s = StateStore(db)
    yield s
    s.close()


def test_fresh_file_restores_nothing_and_creates_parent_dirs(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.db"
    with StateStore(str(path)) as s:
        assert s.path == str(path)
        assert s.restore() == Restored(quorum_id=0, last_quorum=None, events=0)
        assert s.events() == []
    assert path.exists()


def test_round_trip_quorum_and_events(db: str) -> None:
    quorum = _quorum(7, "replica_a", "replica_b", "replica_c")
    with StateStore(db) as s:
        s.save_quorum(quorum)
        started = s.record_event("start", pid=1234)
        joined = s.record_event("join", "replica_a", step=5, nested={"a": [1, 2]})
        s.record_event("quorum", quorum_id=7, members=list(quorum.replica_ids))
        assert s.flush(WAIT_S)
    with StateStore(db) as s:
        restored = s.restore()
        assert restored.quorum_id == 7
        assert restored.last_quorum == quorum  # every member field and `created`
        assert restored.events == 3
        events = s.events()
        assert [e.kind for e in events] == ["start", "join", "quorum"]
        assert events[0] == started
        assert events[1] == joined
        assert events[1].detail == {"step": 5, "nested": {"a": [1, 2]}}
        assert events[2].detail["members"] == ["replica_a", "replica_b", "replica_c"]
        # Ids continue after a restart, so since_id polling keeps working.
        assert s.record_event("start").id == 4


def test_same_quorum_is_written_once(store: StateStore, db: str) -> None:
    quorum = _quorum(3)
    store.save_quorum(quorum)
    assert store.flush(WAIT_S)
    store.save_quorum(quorum)
    # A fresh `created` stamp with the same id and members is not a change either.
    store.save_quorum(Quorum(quorum.quorum_id, quorum.members, created=quorum.created + 60))
    assert store.flush(WAIT_S)
    assert store.writes == 1
    store.save_quorum(_quorum(4))
    assert store.flush(WAIT_S)
    assert store.writes == 2


def test_restored_quorum_is_not_rewritten(db: str) -> None:
    with StateStore(db) as s:
        s.save_quorum(_quorum(5))
        assert s.flush(WAIT_S)
    with StateStore(db) as s:
        s.save_quorum(_quorum(5))
        assert s.flush(WAIT_S)
        assert s.writes == 0


def test_second_store_on_same_path_is_refused_until_close(db: str) -> None:
    first = StateStore(db)
    try:
        with pytest.raises(StateLockedError) as info:
            StateStore(db)
        message = str(info.value)
        assert db in message
        assert "another lighthouse" in message
        assert f"pid {os.getpid()}" in message
        assert "--state" in message
    finally:
        first.close()
    with StateStore(db) as second:
        assert second.restore().quorum_id == 0


CHILD = """
import sys, time
from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.lighthouse.state import StateStore
store = StateStore(sys.argv[1])
store.save_quorum(Quorum(41, (Member("child_a", step=9, data='{"x": 1}'), Member("child_b")), created=12.5))
store.record_event("start", pid=1)
store.record_event("join", "child_a")
assert store.flush(10.0)
print("ready", flush=True)
time.sleep(120)
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line from ``proc``, or fail after ``timeout`` seconds."""
    assert proc.stdout is not None
    buf = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"child printed nothing within {timeout}s (got {buf!r})")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"child exited (rc={proc.poll()}) before ready; got {buf!r}")
            buf += chunk
    return buf.decode().strip()


def test_sigkilled_holder_does_not_block_restart(db: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, db], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        assert _read_line(proc, WAIT_S) == "ready"
        with pytest.raises(StateLockedError, match=f"pid {proc.pid}"):
            StateStore(db)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    with StateStore(db) as s:
        restored = s.restore()
        assert restored.quorum_id == 41
        assert restored.last_quorum == Quorum(
            41, (Member("child_a", step=9, data='{"x": 1}'), Member("child_b")), created=12.5
        )
        assert [(e.kind, e.replica_id) for e in s.events()] == [("start", None), ("join", "child_a")]


def _assert_lock_released(db: str) -> None:
    """After a failed open, the lock must be free: a clean file at the path opens."""
    for suffix in ("", "-wal", "-shm"):
        Path(db + suffix).unlink(missing_ok=True)
    StateStore(db).close()


def test_random_bytes_are_a_corrupt_file(db: str) -> None:
    Path(db).write_bytes(os.urandom(8192))
    with pytest.raises(StateCorruptError) as info:
        StateStore(db)
    assert db in str(info.value)
    assert "--state" in str(info.value)
    _assert_lock_released(db)


def test_truncated_file_is_corrupt(db: str) -> None:
    with StateStore(db, max_events=5000) as s:
        s.save_quorum(_quorum(2))
        for i in range(1500):
            s.record_event("join", f"replica_{i}", padding="x" * 200)
        assert s.flush(WAIT_S)
    data = Path(db).read_bytes()
    assert len(data) > 100_000, "the test needs a multi-page database"
    Path(db).write_bytes(data[: len(data) // 2])
    with pytest.raises(StateCorruptError, match="lighthouse.db"):
        StateStore(db)
    _assert_lock_released(db)


@pytest.mark.parametrize(
    "setup",
    [
        "CREATE TABLE users (name TEXT)",
        "CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (99);"
        "CREATE TABLE quorum (x); CREATE TABLE events (x)",
    ],
    ids=["foreign-schema", "newer-schema-version"],
)
def test_foreign_sqlite_file_is_refused_untouched(db: str, setup: str) -> None:
    conn = sqlite3.connect(db)
    conn.executescript(setup)
    conn.close()
    before = Path(db).read_bytes()
    with pytest.raises(StateCorruptError, match="not a valid rallypoint"):
        StateStore(db)
    assert Path(db).read_bytes() == before
    assert not Path(db + "-wal").exists()


def test_unreadable_saved_quorum_is_corrupt(store: StateStore, db: str) -> None:
    store.save_quorum(_quorum(2))
    assert store.flush(WAIT_S)
    store.close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE quorum SET members = '[{\"replica_id\": 5}]'")
    conn.commit()
    conn.close()
    with pytest.raises(StateCorruptError, match="saved quorum"):
        StateStore(db)


def test_memory_store_writes_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = StateStore(":memory:", max_events=3)
    assert s.path == ":memory:"
    assert s.restore() == Restored(quorum_id=0, last_quorum=None, events=0)
    s.save_quorum(_quorum(1))
    s.save_quorum(_quorum(1))
    assert s.writes == 1
    for i in range(5):
        s.record_event("join", f"r{i}")
    assert [e.replica_id for e in s.events()] == ["r2", "r3", "r4"]
    assert s.flush(0.0)
    s.close()
    s.close()
    assert list(tmp_path.iterdir()) == []
    # A second in-memory store is independent: no lock, nothing shared.
    with StateStore(":memory:") as other:
        assert other.events() == []


def test_ring_buffer_is_bounded_and_filters(db: str) -> None:
    small = StateStore(db + ".small", max_events=5)
    try:
        recorded = [small.record_event("join", f"r{i % 2}", i=i) for i in range(12)]
        assert [e.id for e in small.events()] == [8, 9, 10, 11, 12]
        assert small.events(limit=2) == recorded[-2:]
        assert small.events(limit=0) == []
        assert [e.id for e in small.events(since_id=10)] == [11, 12]
        assert small.events(since_id=12) == []
        assert [e.detail["i"] for e in small.events(replica_id="r1")] == [7, 9, 11]
        assert [e.id for e in small.events(limit=1, replica_id="r0")] == [11]
        assert small.events(since_id=9, replica_id="r1") == [recorded[9], recorded[11]]
        with pytest.raises(ValueError):
            small.events(limit=-1)
        assert all(isinstance(e, Event) for e in small.events())
    finally:
        small.close()


def test_db_log_is_trimmed_and_seeds_the_ring_after_restart(db: str) -> None:
    with StateStore(db, max_events=10) as s:
        for i in range(55):
            s.record_event("heartbeat_lost", f"r{i}")
        assert s.flush(WAIT_S)
    conn = sqlite3.connect(db)
    (rows,) = conn.execute("SELECT COUNT(*) FROM events").fetchone()
    conn.close()
    assert rows <= 10 + 1  # trimmed now and then: at most one trim interval over
    with StateStore(db, max_events=10) as s:
        assert s.restore().events == 10
        assert [e.id for e in s.events()] == list(range(46, 56))
        assert s.record_event("start").id == 56


def test_concurrent_record_event_gives_unique_increasing_ids(store: StateStore, db: str) -> None:
    barrier = threading.Barrier(4, timeout=WAIT_S)

    def work(n: int) -> None:
        barrier.wait()
        for i in range(200):
            store.record_event("join", f"t{n}", i=i)
            store.save_quorum(_quorum(i, f"t{n}"))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()
    assert store.flush(WAIT_S)
    ids = [e.id for e in store.events(limit=1000)]
    assert ids == list(range(1, 801))
    conn = sqlite3.connect(db)
    (rows,) = conn.execute("SELECT COUNT(*) FROM events").fetchone()
    conn.close()
    assert rows == 800


def test_transient_write_error_is_logged_and_retried(
    store: StateStore, db: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = store._write_batch
    failures = []

    def flaky(quorum, events):
        if not failures:
            failures.append(1)
            raise sqlite3.OperationalError("disk I/O error")
        return real(quorum, events)

    store._write_batch = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="rallypoint.lighthouse.state"):
        store.save_quorum(_quorum(9))
        store.record_event("join", "replica_a")
        assert store.flush(WAIT_S)
    assert failures == [1]
    assert any(db in r.getMessage() and "disk I/O error" in r.getMessage() for r in caplog.records)
    store.close()
    with StateStore(db) as again:
        assert again.restore().quorum_id == 9
        assert [e.kind for e in again.events()] == ["join"]


def test_permanent_write_error_drops_the_batch_but_not_the_writer(
    store: StateStore, db: str, caplog: pytest.LogCaptureFixture
) -> None:
    real = store._write_batch
    calls = []

    def broken_once(quorum, events):
        calls.append(len(events))
        if len(calls) == 1:
            raise ValueError("cannot encode")
        return real(quorum, events)

    store._write_batch = broken_once  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="rallypoint.lighthouse.state"):
        store.save_quorum(_quorum(9))
        store.record_event("lost")
        assert store.flush(WAIT_S) is False
    assert any(db in r.getMessage() and "dropping" in r.getMessage() for r in caplog.records)
    # The writer is alive, and the dropped quorum is written when saved again.
    store.save_quorum(_quorum(9))
    store.record_event("kept")
    assert store.flush(WAIT_S)
    store.close()
    with StateStore(db) as again:
        assert again.restore().quorum_id == 9
        assert [e.kind for e in again.events()] == ["kept"]


def test_flush_times_out_while_the_disk_is_stuck(store: StateStore) -> None:
    real = store._write_batch
    entered, release = threading.Event(), threading.Event()

    def stuck(quorum, events):
        entered.set()
        release.wait(WAIT_S)
        return real(quorum, events)

    store._write_batch = stuck  # type: ignore[method-assign]
    store.record_event("join", "replica_a")
    try:
        assert entered.wait(WAIT_S)
        assert store.flush(timeout=0.05) is False
        # Callers on the event loop are never blocked by the stuck disk.
        assert store.record_event("join", "replica_b").id == 2
    finally:
        release.set()
    assert store.flush(WAIT_S)


def test_close_is_idempotent_and_late_events_do_not_raise(db: str, caplog: pytest.LogCaptureFixture) -> None:
    s = StateStore(db)
    s.record_event("start")
    s.close()
    s.close()
    assert s._thread is not None and not s._thread.is_alive()
    with caplog.at_level(logging.WARNING, logger="rallypoint.lighthouse.state"):
        late = s.record_event("late")
        s.save_quorum(_quorum(3))
    assert late.id == 2
    assert s.events()[-1] == late  # still visible in memory
    assert any("after close" in r.getMessage() for r in caplog.records)
    assert s.flush(0.1)
    with StateStore(db) as again:
        assert [e.kind for e in again.events()] == ["start"]
        assert again.restore().quorum_id == 0


def test_lock_file_names_the_holder(store: StateStore, db: str) -> None:
    text = Path(db + ".lock").read_text()
    assert f'"pid": {os.getpid()}' in text
