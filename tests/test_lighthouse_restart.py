"""A SIGKILLed lighthouse restarted on its state file continues where it left off.

The lighthouse runs as ``python -m rallypoint lighthouse --state FILE`` (a child
process, killed and reaped by pid); replicas are threads of the test.
"""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import httpx

from conftest import ask_concurrently, assert_one_quorum


def persisted_quorum_id(path: Path) -> int | None:
    """The quorum_id saved in the state file (read-only; the lighthouse may be running)."""
    if not path.exists():
        return None
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        row = conn.execute("SELECT quorum_id FROM quorum").fetchone()
    except sqlite3.OperationalError:  # schema not created yet
        return None
    finally:
        conn.close()
    return None if row is None else row[0]


def test_sigkilled_lighthouse_restarts_on_its_state(tmp_path, cli_lighthouse, client):
    state = tmp_path / "lighthouse.db"
    args = {"min_replicas": 2, "state": state, "extra": ["--join-timeout-ms", "60000"], "http": True}

    first = cli_lighthouse(name="lighthouse-1", **args)
    c1 = client(first.address)
    q1 = assert_one_quorum(ask_concurrently(c1, ["a", "b"]), ["a", "b"])
    # A commit failure bumps the id, so "continues" is distinguishable from "restarts at 1".
    q2 = assert_one_quorum(
        ask_concurrently(c1, ["a", "b"], kw_for=lambda rid: {"commit_failures": int(rid == "a")}), ["a", "b"]
    )
    assert q2.quorum_id == q1.quorum_id + 1 >= 2
    # A new quorum_id is on disk before it is handed out, so a SIGKILL right now
    # cannot make the restarted lighthouse go back to an older id.
    assert persisted_quorum_id(state) == q2.quorum_id

    first.proc.kill(signal.SIGKILL)
    assert first.proc.wait(10.0) == -signal.SIGKILL

    second = cli_lighthouse(name="lighthouse-2", **args)  # the flock died with the process
    c2 = client(second.address)
    # A third replica is healthy but not asking: only the fast path forms without it
    # before join_timeout (60 s).
    c2.heartbeat("c")
    t0 = time.monotonic()
    q3 = assert_one_quorum(ask_concurrently(c2, ["a", "b"], timeout=10.0), ["a", "b"])
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0, f"returning full membership waited {elapsed:.2f}s (no fast path after restart?)"
    assert q3.quorum_id >= q2.quorum_id
    status = c2.status()
    assert status["last_decision"]["rule"] == "fast_path"
    assert status["quorum_id"] == q3.quorum_id

    # The event log spans the restart.
    r = httpx.get(f"{second.http}/events", params={"limit": 1000}, timeout=5.0)
    assert r.status_code == 200
    events = r.json()
    starts = [e for e in events if e["kind"] == "start"]
    assert len(starts) == 2, [e["kind"] for e in events]
    before_restart = [e for e in events if e["id"] < starts[1]["id"]]
    assert any(e["kind"] == "quorum" and e["detail"]["quorum_id"] == q2.quorum_id for e in before_restart)
    assert starts[1]["detail"]["quorum_id"] == q2.quorum_id


def test_second_lighthouse_on_same_state_refuses(tmp_path, cli_lighthouse, rallypoint_cli, client):
    state = tmp_path / "shared.db"
    first = cli_lighthouse(min_replicas=1, state=state)
    second = rallypoint_cli(
        "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off", "--state", str(state),
        name="lighthouse-second",
    )
    rc = second.wait(20.0)
    err = second.stderr_text()
    assert rc != 0, err
    assert "another lighthouse" in err, err
    assert str(state) in err
    # The first one is unaffected.
    c = client(first.address)
    assert list(c.quorum("a", 5.0).replica_ids) == ["a"]
    assert first.proc.popen.poll() is None

    # SIGTERM stops it cleanly and releases the lock: the next one starts on the file.
    first.proc.kill(signal.SIGTERM)
    assert first.proc.wait(15.0) == 0, first.proc.stderr_text()[-2000:]
    third = cli_lighthouse(min_replicas=1, state=state, name="lighthouse-third")
    assert client(third.address).status()["quorum_id"] >= 1
