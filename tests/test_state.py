"""Tests for the lighthouse state file (rallypoint/lighthouse/state.py).

Why these: a restarted lighthouse must continue its quorum_id (never reuse one), two
lighthouses must never share a file, a SIGKILLed one must not block its restart, and a
damaged file must fail loudly instead of silently restarting at quorum_id 0.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import selectors
import signal
import sqlite3
import subprocess
import sys
import shutil
import threading
import time
from pathlib import Path

import pytest

from rallypoint.lighthouse import _state_errors as errors
from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.lighthouse.state import (
    SCHEMA_VERSION,
    Event,
    Restored,
    StateCorruptError,
    StateDiskFullError,
    StateFileError,
    StateLockedError,
    StateNewerError,
    StateReadOnlyError,
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
    ("setup", "error", "match"),
    [
        ("CREATE TABLE users (name TEXT)", StateCorruptError, "not a valid rallypoint"),
        (
            "CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (99);"
            "CREATE TABLE quorum (x); CREATE TABLE events (x)",
            StateNewerError,
            "written by a newer rallypoint",
        ),
    ],
    ids=["foreign-schema", "newer-schema-version"],
)
def test_foreign_sqlite_file_is_refused_untouched(db: str, setup: str, error: type, match: str) -> None:
    conn = sqlite3.connect(db)
    conn.executescript(setup)
    conn.close()
    before = Path(db).read_bytes()
    with pytest.raises(error, match=match):
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


# ------------------------------------------------------------ start-up failures, as a user sees them
#
# Each runs the real command, ``python -m rallypoint lighthouse --state FILE``, and checks it
# exits non-zero with one line that names the file and the cause, without a traceback, and
# without advice that silently loses quorum_id (a new state file restarts it at 0).

CLI_TIMEOUT_S = 60.0
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_non_root = pytest.mark.skipif(
    AS_ROOT, reason="root ignores file permissions, so chmod cannot make the state file or its directory read-only"
)

# A full disk without root: SQLite's own size limit, PRAGMA max_page_count, set on every
# connection the lighthouse opens (a tiny tmpfs needs root; see the tmpfs test below). The
# limit is clamped to the file's current size, so nothing can grow: SQLite then fails with
# the same SQLITE_FULL "database or disk is full" a full disk gives.
FULL_DISK_PRELUDE = """
import runpy, sqlite3, sys
_connect = sqlite3.connect
def connect(*args, **kwargs):
    conn = _connect(*args, **kwargs)
    conn.execute("PRAGMA max_page_count = 1")
    return conn
sqlite3.connect = connect
sys.argv[0] = "rallypoint"
runpy.run_module("rallypoint", run_name="__main__", alter_sys=True)
"""


def _lighthouse_args(state: str) -> list[str]:
    return ["lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off", "--state", state]


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _run_lighthouse(state: str, prelude: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m rallypoint lighthouse --state STATE`` (or the same behind ``prelude``) to its exit."""
    head = ["-m", "rallypoint"] if prelude is None else ["-c", prelude]
    return subprocess.run(
        [sys.executable, *head, *_lighthouse_args(state)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=_child_env(),
    )  # fmt: skip


def _start_failure(result: subprocess.CompletedProcess[str], path: str, *needles: str) -> str:
    """The lighthouse refused to start cleanly: exit 2, no ready line, no traceback, and
    one ``rallypoint lighthouse:`` line naming ``path`` and each of ``needles``; returned."""
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err)
    assert result.stdout == "", result.stdout  # never printed its ready line
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rallypoint lighthouse: ")]
    assert len(lines) == 1, err
    line = lines[0]
    assert path in line, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def _assert_keeps_quorum_id(line: str) -> None:
    """No advice to delete the file; starting over is only named with what it costs."""
    assert "delete" not in line.lower().replace("do not delete", ""), line
    assert "quorum_id" in line, line


def _saved_state(db: str, quorum_id: int = 41) -> bytes:
    """A real state file holding ``quorum_id``; returns its bytes (the WAL is checkpointed)."""
    with StateStore(db) as s:
        s.save_quorum(_quorum(quorum_id))
        s.record_event("start")
        assert s.flush(WAIT_S)
    assert not Path(db + "-wal").exists()
    return Path(db).read_bytes()


def _set_schema_version(db: str, *versions: int) -> None:
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DELETE FROM schema_version")
        conn.executemany("INSERT INTO schema_version (version) VALUES (?)", [(v,) for v in versions])
    conn.close()


def test_cli_newer_schema_leaves_the_file_and_its_quorum_id(db: str) -> None:
    _saved_state(db, 41)
    _set_schema_version(db, SCHEMA_VERSION + 1)
    before = Path(db).read_bytes()
    line = _start_failure(
        _run_lighthouse(db), db,
        "written by a newer rallypoint", f"schema version {SCHEMA_VERSION + 1}",
        f"reads version {SCHEMA_VERSION}", "upgrade rallypoint", "--state",
    )  # fmt: skip
    _assert_keeps_quorum_id(line)
    assert "delete" not in line.lower()
    assert "not a valid" not in line  # it is not corrupt, only newer
    assert Path(db).read_bytes() == before
    _set_schema_version(db, SCHEMA_VERSION)  # what the newer rallypoint would still read
    with StateStore(db) as s:
        assert s.restore().quorum_id == 41


@pytest.mark.parametrize(("versions", "shown"), [((0,), "version 0,"), ((), "none"), ((1, 1), "[1, 1]")])
def test_cli_unknown_schema_says_starting_over_restarts_quorum_id(db: str, versions: tuple, shown: str) -> None:
    _saved_state(db, 41)
    _set_schema_version(db, *versions)
    before = Path(db).read_bytes()
    line = _start_failure(_run_lighthouse(db), db, shown, "does not know", "restarts quorum_id at 0", "restarted")
    _assert_keeps_quorum_id(line)
    assert Path(db).read_bytes() == before


def test_cli_corrupt_file_says_starting_over_restarts_quorum_id(db: str) -> None:
    Path(db).write_bytes(os.urandom(8192))
    line = _start_failure(_run_lighthouse(db), db, "not a valid rallypoint", "restarts quorum_id at 0", "--state")
    _assert_keeps_quorum_id(line)


@needs_non_root
def test_cli_read_only_state_file(db: str) -> None:
    before = _saved_state(db, 41)
    os.chmod(db, 0o444)
    try:
        line = _start_failure(_run_lighthouse(db), db, "is not writable", "the file is read-only", "chmod", "--state")
    finally:
        os.chmod(db, 0o644)
    _assert_keeps_quorum_id(line)
    assert Path(db).read_bytes() == before


@needs_non_root
def test_cli_read_only_directory_for_a_new_state_file(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir(mode=0o555)
    try:
        for state, cause in (
            (directory / "state.db", f"its directory {directory} is not writable"),
            (directory / "sub" / "state.db", f"its directory {directory / 'sub'} cannot be created in {directory}"),
        ):
            line = _start_failure(_run_lighthouse(str(state)), str(state), "is not writable", cause, "--state")
            assert "delete" not in line.lower()
        assert list(directory.iterdir()) == []
    finally:
        directory.chmod(0o755)


@needs_non_root
def test_cli_read_only_directory_of_an_existing_state_file(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    db = str(directory / "state.db")
    before = _saved_state(db, 41)
    directory.chmod(0o555)  # the file and its lock file stay writable; SQLite's -wal/-shm cannot be made
    try:
        line = _start_failure(_run_lighthouse(db), db, "is not writable", f"its directory {directory} is not writable")
    finally:
        directory.chmod(0o755)
    _assert_keeps_quorum_id(line)
    assert Path(db).read_bytes() == before


def test_cli_disk_full_at_start(db: str) -> None:
    line = _start_failure(_run_lighthouse(db, FULL_DISK_PRELUDE), db, "the disk is full", "database or disk is full")
    assert "delete" not in line.lower()  # a new file: nothing to keep yet
    assert "Free space" in line


def _fill_last_page(db: str) -> None:
    """Pack the event log's last page, so the next event needs a new page (which a full
    disk cannot give). Rows shrink until none fits; each try is rolled back if it grew the file."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        next_id = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM events").fetchone()[0]
        for size in (2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 0):
            while True:
                (pages,) = conn.execute("PRAGMA page_count").fetchone()
                conn.execute("SAVEPOINT fill")
                conn.execute(
                    "INSERT INTO events (id, time, kind, replica_id, detail) VALUES (?, 0, 'fill', NULL, ?)",
                    (next_id, json.dumps({"pad": "x" * size})),
                )
                grew = conn.execute("PRAGMA page_count").fetchone()[0] > pages
                if grew:
                    conn.execute("ROLLBACK TO fill")
                conn.execute("RELEASE fill")
                if grew:
                    break
                next_id += 1
    finally:
        conn.close()


def test_cli_disk_full_while_running_keeps_serving(db: str, procs) -> None:
    from rallypoint.lighthouse.client import LighthouseClient

    _saved_state(db, 41)
    _fill_last_page(db)
    proc = procs(["-c", FULL_DISK_PRELUDE, *_lighthouse_args(db)], name="full-lighthouse", env=_child_env())
    info = proc.json_line(CLI_TIMEOUT_S)
    with LighthouseClient(info["local"], connect_timeout=WAIT_S) as client:
        # A new quorum is answered although it cannot be saved (after the lighthouse's
        # bounded wait for the disk), and the lighthouse keeps serving.
        assert client.quorum("replica_x", timeout=CLI_TIMEOUT_S).quorum_id == 42
        assert client.status(timeout=WAIT_S)["quorum_id"] == 42
    err = proc.stderr_text()
    assert f"state file {db}: cannot save: the disk is full (SQLite: database or disk is full" in err, err
    assert "keeps serving" in err
    assert "Traceback" not in err, err
    proc.kill(signal.SIGTERM)
    assert proc.wait(CLI_TIMEOUT_S) == 0, proc.stderr_text()
    with StateStore(db) as s:  # the failed writes left a valid file with the last saved quorum_id
        assert s.restore().quorum_id == 41


class _LogWaiter(logging.Handler):
    """Sets ``seen[text]`` when a record containing ``text`` is logged."""

    def __init__(self, *texts: str) -> None:
        super().__init__(logging.DEBUG)
        self.seen = {text: threading.Event() for text in texts}

    def emit(self, record: logging.LogRecord) -> None:
        for text, event in self.seen.items():
            if text in record.getMessage():
                event.set()


def test_disk_full_while_running_is_logged_retried_and_recovers(db: str) -> None:
    """The same SQLITE_FULL, in process: logged as a full disk, the batch kept and retried,
    and written once space is back, with a line saying so."""
    waiter = _LogWaiter("cannot save: the disk is full", "saved again after")
    log = logging.getLogger("rallypoint.lighthouse.state")
    old_level = log.level
    log.addHandler(waiter)
    log.setLevel(logging.INFO)
    try:
        with StateStore(db) as s:
            assert s._conn is not None
            s._conn.execute("PRAGMA max_page_count = 1")  # the writer is idle: nothing queued yet
            s.save_quorum(_quorum(9))
            for i in range(8):
                s.record_event("join", f"replica_{i}", padding="x" * 1000)
            assert waiter.seen["cannot save: the disk is full"].wait(WAIT_S)
            s._conn.execute("PRAGMA max_page_count = 1073741823")  # space is back
            assert s.flush(WAIT_S)
            assert waiter.seen["saved again after"].wait(WAIT_S)
    finally:
        log.removeHandler(waiter)
        log.setLevel(old_level)
    with StateStore(db) as again:
        assert again.restore().quorum_id == 9
        assert again.restore().events == 8


TMPFS_SCRIPT = """
set -u
mount -t tmpfs -o size=256k tmpfs "$1" || exit 77
cp "$2" "$1/state.db"
dd if=/dev/zero of="$1/filler" bs=4k 2>/dev/null
"$3" -m rallypoint lighthouse --min-replicas 1 --bind 127.0.0.1:0 --http-bind off --state "$1/state.db"
rc=$?
cp "$1/state.db" "$2.after"
exit $rc
"""


@pytest.mark.skipif(not AS_ROOT or shutil.which("unshare") is None, reason="a tiny tmpfs needs root and unshare")
def test_cli_real_full_tmpfs_at_start(tmp_path: Path) -> None:
    """A really full filesystem (tmpfs, in a private mount namespace): SQLite reports the
    -shm file it cannot grow as a bare "disk I/O error"; the message still says the disk is full."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=CLI_TIMEOUT_S).returncode != 0:
        pytest.skip("unshare -m is not permitted here")
    saved = str(tmp_path / "saved.db")
    _saved_state(saved, 41)
    mount = tmp_path / "full"
    mount.mkdir()
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", TMPFS_SCRIPT, "sh", str(mount), saved, sys.executable],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=_child_env(),
    )  # fmt: skip
    if result.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    state = f"{mount}/state.db"
    line = _start_failure(result, state, "the disk is full", f"0 bytes free in {mount}", "Do not delete")
    _assert_keeps_quorum_id(line)
    with StateStore(saved + ".after") as s:
        assert s.restore().quorum_id == 41


# ------------------------------------------------------------ the error classes and messages (pure)


def test_error_classes_let_callers_catch_one_base() -> None:
    for cls in (StateLockedError, StateCorruptError, StateNewerError, StateReadOnlyError, StateDiskFullError):
        assert issubclass(cls, StateFileError)
    assert issubclass(StateNewerError, StateCorruptError)  # older callers catching "corrupt" still catch it
    e = StateDiskFullError("message", "/x/state.db")
    assert (str(e), e.path) == ("message", "/x/state.db")


GIB = 1 << 30


@pytest.mark.parametrize(
    ("err_no", "code", "free_bytes", "free_inodes", "problem", "kind"),
    [
        (errno.ENOSPC, None, GIB, 10, None, "full"),
        (errno.EDQUOT, None, GIB, 10, None, "full"),
        (None, sqlite3.SQLITE_FULL, GIB, 10, None, "full"),  # e.g. SQLite's temporary directory
        (errno.EACCES, None, GIB, 10, None, "read-only"),
        (errno.EPERM, None, 0, 10, None, "read-only"),
        (errno.EROFS, None, GIB, 10, None, "read-only"),
        (None, sqlite3.SQLITE_READONLY, GIB, 10, None, "read-only"),
        (None, 1544, GIB, 10, None, "read-only"),  # SQLITE_READONLY_DIRECTORY (extended)
        (None, 4874, 0, 10, None, "full"),  # SQLITE_IOERR_SHMSIZE on a full tmpfs
        (None, sqlite3.SQLITE_IOERR, 4096, 10, "the file is read-only", "full"),  # space first
        (None, sqlite3.SQLITE_IOERR, GIB, 0, None, "full"),  # no inode left
        (None, sqlite3.SQLITE_CANTOPEN, GIB, 10, "its directory /d is not writable", "read-only"),
        (None, sqlite3.SQLITE_IOERR, GIB, 10, None, "other"),
        (None, sqlite3.SQLITE_IOERR, None, None, None, "other"),  # statvfs failed
        (errno.EIO, None, GIB, None, None, "other"),
        (errno.EIO, None, 0, None, None, "full"),
        (errno.ENOTDIR, None, 0, 0, "its directory /d is not writable", "other"),  # not guessed at
        (None, sqlite3.SQLITE_BUSY, 0, 0, "its directory /d is not writable", "other"),  # a lock, not the disk
        (None, None, 0, 0, None, "other"),
    ],
)
def test_classify(err_no, code, free_bytes, free_inodes, problem, kind) -> None:
    assert errors.classify(err_no, code, free_bytes, free_inodes, problem) == kind


@pytest.mark.parametrize(
    ("free_bytes", "free_inodes", "text"),
    [
        (0, 10, "0 bytes free"),
        (1023, None, "1023 bytes free"),
        (12 * 1024, 5, "12.0 KiB free"),
        (3 * GIB // 2, 5, "1.5 GiB free"),
        (5000 * GIB, 5, "5000.0 GiB free"),
        (GIB, 0, "no free inodes"),
        (None, None, "free space unknown"),
    ],
)
def test_describe_free(free_bytes, free_inodes, text) -> None:
    assert errors.describe_free(free_bytes, free_inodes) == text


@pytest.mark.parametrize(
    ("found", "newer"),
    [([2], 2), ([99], 99), ([1], None), ([0], None), ([], None), ([2, 2], None), (["2"], None), ([True], None)],
)
def test_newer_version(found, newer) -> None:
    assert errors.newer_version(found, 1) == newer


@pytest.mark.parametrize(
    ("found", "cls", "needles"),
    [
        ([2], StateNewerError, ("written by a newer rallypoint", "schema version 2", "reads version 1", "upgrade")),
        ([0], StateCorruptError, ("schema version 0,", "does not know", "restarts quorum_id at 0")),
        ([], StateCorruptError, ("version none",)),
        (["x"], StateCorruptError, ("version 'x'",)),
    ],
)
def test_schema_error(found, cls, needles) -> None:
    e = errors.schema_error("/x/state.db", found, 1, "9.9.9")
    assert type(e) is cls and e.path == "/x/state.db"
    for needle in ("/x/state.db", "rallypoint 9.9.9", "left untouched", *needles):
        assert needle in str(e), (needle, str(e))


@pytest.mark.parametrize(
    "attempts_logged", [[1, 2, 3, 4, 5, 6, 12, 24, 36]],
)
def test_should_log_retry(attempts_logged) -> None:
    assert [n for n in range(1, 40) if errors.should_log_retry(n)] == attempts_logged


MESSAGES = {
    "locked": errors.locked_message("/x/state.db", "pid 7 on host, started now"),
    "corrupt": errors.corrupt_message("/x/state.db", "file is not a database"),
    "newer": str(errors.schema_error("/x/state.db", [2], 1, "1.0")),
    "unknown-schema": str(errors.schema_error("/x/state.db", [0], 1, "1.0")),
    "read-only-existing": errors.read_only_message("/x/state.db", True, "the file is read-only", "denied"),
    "read-only-new": errors.read_only_message("/x/state.db", False, "its directory /x is not writable", "denied"),
    "full-existing": errors.disk_full_message("/x/state.db", True, "0 bytes free in /x", "No space left on device"),
    "full-new": errors.disk_full_message("/x/state.db", False, "0 bytes free in /x", "No space left on device"),
    "other": errors.other_message("/x/state.db", "SQLite: database is locked"),
}


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_no_message_advises_losing_quorum_id(name: str) -> None:
    """Every message names the file; none says to delete it; any that offers a new file
    (moving it aside, another --state) says quorum_id restarts at 0."""
    message = MESSAGES[name]
    assert re.match(r"(cannot use )?state file /x/state\.db[ :]", message), message
    assert "\n" not in message
    assert "delete" not in message.lower().replace("do not delete", "")
    offers_new_file = any(s in message for s in ("move it aside", "point --state elsewhere", "different --state"))
    if offers_new_file and name != "locked":  # a locked file's job is running: another --state is another job
        assert "restarts quorum_id at 0" in message, message
    if name.endswith("-existing"):
        assert "restarts quorum_id at 0" in message and "copy" in message, message


@pytest.mark.parametrize(
    ("exc", "cls", "needles"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), StateDiskFullError, ("the disk is full", "free in")),
        (PermissionError(errno.EACCES, "Permission denied", "/p"), StateReadOnlyError, ("not writable", "denied: /p")),
        (sqlite3.OperationalError("database is locked"), StateFileError, ("cannot use state file", "SQLite: database")),
    ],
)
def test_startup_error(db: str, exc: BaseException, cls: type, needles: tuple) -> None:
    e = errors.startup_error(db, exc, existed=False)
    assert type(e) is cls and e.path == db
    for needle in (db, *needles):
        assert needle in str(e), (needle, str(e))
