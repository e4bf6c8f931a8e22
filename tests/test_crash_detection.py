"""Crash detection through the liveness stream (rallypoint's Attach RPC).

Replicas run as real child processes holding a ``LivenessStream``; SIGKILLing one must
let the survivors form a quorum without it long before ``heartbeat_timeout`` (30 s
here), and tell the survivors which peer went down.
"""

from __future__ import annotations

import json
import signal
import time

from rallypoint.lighthouse.client import LivenessStream
from rallypoint.lighthouse.server import LighthouseServer

from conftest import Proc, replica_row, wait_until, watched_leaver

# A replica: attach the liveness stream, then ask for a quorum in a loop, one JSON line
# per event on stdout. The short pause between rounds stands for a training step.
REPLICA = r"""
import json, sys, time
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream

addr, rid = sys.argv[1], sys.argv[2]

def say(**kw):
    print(json.dumps(kw), flush=True)

stream = LivenessStream(addr, rid, on_peer_down=lambda peer, reason: say(peer_down=peer, reason=reason))
if not stream.start(10.0):
    say(error="liveness stream not welcomed")
    sys.exit(3)
say(attached=rid)
client = LighthouseClient(addr, connect_timeout=10.0)
while True:
    try:
        q = client.quorum(rid, timeout=30.0)
    except Exception as e:
        say(error=str(e))
        time.sleep(0.05)
        continue
    say(quorum_id=q.quorum_id, members=list(q.replica_ids))
    time.sleep(0.05)
"""

# Attach, say so, then idle until killed.
ATTACH_ONLY = r"""
import json, sys, threading
from rallypoint.lighthouse.client import LivenessStream
stream = LivenessStream(sys.argv[1], sys.argv[2])
ok = stream.start(10.0)
print(json.dumps({"attached": ok}), flush=True)
threading.Event().wait(120)
"""


def _event(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def gone(lh: LighthouseServer, rid: str) -> bool:
    """``rid`` is not alive for the lighthouse: not listed, or listed dead with no heartbeat."""
    row = replica_row(lh.status(), rid)
    return row is None or (row["dead"] and not row["attached"] and row["heartbeat_age_s"] is None)


def test_sigkilled_replica_is_dropped_long_before_heartbeat_timeout(lighthouse, spawn_python):
    lh: LighthouseServer = lighthouse(min_replicas=2, heartbeat_timeout_ms=30_000, join_timeout_ms=60_000)
    addr = lh.local_address()
    ids = ["r0", "r1", "r2"]
    children: dict[str, Proc] = {rid: spawn_python(REPLICA, addr, rid, name=rid) for rid in ids}

    for rid, p in children.items():
        assert p.json_line(20.0) == {"attached": rid}
    # Everyone saw one quorum with all three (the first rounds may form with fewer).
    for rid, p in children.items():
        p.wait_line(lambda line: _event(line).get("members") == ids, 20.0)

    victim, survivors = "r2", ["r0", "r1"]
    t_kill = time.monotonic()
    children[victim].kill(signal.SIGKILL)

    elapsed = {}
    for rid in survivors:
        line = children[rid].wait_line(lambda line: _event(line).get("members") == survivors, 10.0)
        elapsed[rid] = time.monotonic() - t_kill
        assert victim not in _event(line)["members"]
    worst = max(elapsed.values())
    print(f"\nsurvivors' quorum without the SIGKILLed replica after {worst * 1000:.0f} ms (heartbeat_timeout 30 s)")
    assert worst < 5.0, f"survivors waited {worst:.2f}s for a quorum without {victim}"

    # Each survivor's stream was told which peer went down.
    for rid in survivors:
        p = children[rid]
        if not any(_event(line).get("peer_down") == victim for line in p.seen):
            p.wait_line(lambda line: _event(line).get("peer_down") == victim, 5.0)

    assert gone(lh, victim), replica_row(lh.status(), victim)
    crashes = [e for e in lh.core.store.events(limit=1000, replica_id=victim) if e.kind == "crash"]
    assert crashes, "no crash event recorded for the killed replica"


def test_clean_close_removes_replica_at_once(lighthouse, client):
    lh = lighthouse(min_replicas=1, heartbeat_timeout_ms=30_000)
    c = client(lh)
    stream = LivenessStream(lh.local_address(), "leaver", address="http://127.0.0.1:1")
    try:
        assert stream.start(5.0)
        c.quorum("leaver", 5.0)  # a member of the last quorum, so status keeps listing it
        row = replica_row(lh.status(), "leaver")
        assert row["attached"] and row["heartbeat_age_s"] is not None
    finally:
        stream.close("finished training")
    # No waiting: close() returns after the lighthouse processed the goodbye.
    row = replica_row(lh.status(), "leaver")
    assert row is not None and row["dead"] and not row["attached"] and row["heartbeat_age_s"] is None, row
    leaves = [e for e in lh.core.store.events(limit=100, replica_id="leaver") if e.kind == "leave"]
    assert leaves and leaves[-1].detail["reason"] == "finished training"


def test_peer_down_callback_on_clean_leave(lighthouse):
    lh = lighthouse(min_replicas=1)
    with watched_leaver(lh.local_address()) as (leaver, seen):
        leaver.close("bye")
        wait_until(lambda: seen, 5.0, what="PeerDown for leaver")
        assert seen[0][0] == "leaver" and "bye" in seen[0][1]


def test_stray_heartbeat_does_not_resurrect_crashed_replica(lighthouse, client, spawn_python):
    lh = lighthouse(min_replicas=1, heartbeat_timeout_ms=30_000)
    c = client(lh)
    child = spawn_python(ATTACH_ONLY, lh.local_address(), "ghost", name="ghost")
    assert child.json_line(20.0) == {"attached": True}
    row = replica_row(lh.status(), "ghost")
    assert row is not None and row["attached"]

    child.kill(signal.SIGKILL)
    child.wait(10.0)
    wait_until(lambda: gone(lh, "ghost"), 5.0, what="ghost declared dead")

    c.heartbeat("ghost")  # e.g. one that was in flight when the process died
    assert gone(lh, "ghost"), replica_row(lh.status(), "ghost")

    # Asking for a quorum brings it back (it is evidently alive again).
    q = c.quorum("ghost", 5.0)
    assert list(q.replica_ids) == ["ghost"]
    row = replica_row(lh.status(), "ghost")
    assert not row["dead"] and row["heartbeat_age_s"] is not None, row


def test_reattach_revives_crashed_replica(lighthouse, client, spawn_python):
    lh = lighthouse(min_replicas=1, heartbeat_timeout_ms=30_000)
    child = spawn_python(ATTACH_ONLY, lh.local_address(), "phoenix", name="phoenix")
    assert child.json_line(20.0) == {"attached": True}
    child.kill(signal.SIGKILL)
    child.wait(10.0)
    wait_until(lambda: gone(lh, "phoenix"), 5.0, what="phoenix declared dead")
    stream = LivenessStream(lh.local_address(), "phoenix")
    try:
        assert stream.start(5.0)
        row = replica_row(lh.status(), "phoenix")
        assert row["attached"] and not row["dead"] and row["heartbeat_age_s"] is not None, row
    finally:
        stream.close()
