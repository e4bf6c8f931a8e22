"""The hostile-scale suite's id-takeover kinds (issue 37, item 7): 3,000 calls by a token
holder under the live legal replicas' ids leave the lighthouse's RSS and descriptors flat
and every legal quorum, address and stream intact.

The lighthouse and the legal replicas are :mod:`test_hostile_scale`'s: ``rallypoint
lighthouse`` as a child process with the token in its environment, two replica groups
asking for quorums in lock-step from threads of this process, each also holding its
liveness stream (with its manager address). The attacker holds the token and sends, under
the legal ids, Quorums (with its own address and step 10^9), Heartbeats and Attach hellos:
with no session at all (raw gRPC, as torchft's clients) or with a session of its own.
Every one must end PERMISSION_DENIED and be counted as ``replica_id_taken``; no legal
replica may hear a PeerDown, lose its stream or see its address change.

Set ``RALLYPOINT_HOSTILE_SEED`` to replay a run's order of calls.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import secrets
import signal
import time
from typing import Any, Callable

import httpx
import pytest

from conftest import CliLighthouse
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LivenessStream
from rallypoint.lighthouse.owners import SESSION_HEADER
from test_hostile_scale import (ATTACH, CALL_TIMEOUT, HEARTBEAT, LEGAL, NEVER, QUORUM, Attacker, Kind,  # noqa: F401
                                LegalReplicas, measure, table, token_lighthouse)

TOTAL_CALLS = 3_000
WARMUP_CALLS = 300
RSS_BUDGET_KIB = 10 * 1024
DENIED = frozenset({"PERMISSION_DENIED"})
ADDRESSES = {rid: f"http://127.0.0.1:{40100 + i}" for i, rid in enumerate(LEGAL)}


def takeover_kinds(a: Attacker) -> list[Kind]:
    """The 3,000 id-takeover calls, by kind."""
    def md(rng: random.Random, session: bool) -> list[tuple[str, str]]:
        return a.good() + ([(SESSION_HEADER, secrets.token_hex(16))] if session else [])

    def quorum(rng: random.Random) -> bytes:
        return pb.LighthouseQuorumRequest(requester=pb.QuorumMember(
            replica_id=rng.choice(LEGAL), address="http://evil.example:1", step=10**9, world_size=64,
            commit_failures=3)).SerializeToString()

    def beat(rng: random.Random) -> bytes:
        return pb.LighthouseHeartbeatRequest(replica_id=rng.choice(LEGAL)).SerializeToString()

    def hello(rng: random.Random) -> Any:
        msg = rpb.AttachRequest(hello=rpb.AttachHello(replica_id=rng.choice(LEGAL), address="http://evil.example:1"))
        return iter([msg.SerializeToString()])

    def sender(method: str, build: Callable[[random.Random], bytes], session: bool) -> Callable[[random.Random], Any]:
        return lambda rng: a.unary("token", method, build(rng), md(rng, session))

    def attacher(session: bool) -> Callable[[random.Random], Any]:
        return lambda rng: a.stream("token", hello(rng), md(rng, session))

    kinds = []
    for session in (False, True):
        label = "own session" if session else "no session"
        kinds += [Kind(f"takeover Quorum, {label}", 600, DENIED, sender(QUORUM, quorum, session)),
                  Kind(f"takeover Heartbeat, {label}", 400, DENIED, sender(HEARTBEAT, beat, session)),
                  Kind(f"takeover Attach, {label}", 500, DENIED, attacher(session))]
    return kinds


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_3000_id_takeovers_leave_rss_fds_and_legal_quorums_intact(
        token_lighthouse: tuple[CliLighthouse, str]) -> None:
    lh, token = token_lighthouse
    seed = int(os.environ.get("RALLYPOINT_HOSTILE_SEED", secrets.randbits(32)))
    rng = random.Random(seed)
    bearer = {"authorization": f"Bearer {token}"}
    downs: list[tuple[str, str, str]] = []

    def heard(me: str) -> Callable[[str, str], None]:
        return lambda peer, why: downs.append((me, peer, why))

    streams = {rid: LivenessStream(lh.address, rid, ADDRESSES[rid], token=token, on_peer_down=heard(rid))
               for rid in LEGAL}
    attacker = Attacker(lh, token)
    kinds = takeover_kinds(attacker)
    assert sum(k.count for k in kinds) == TOTAL_CALLS
    calls = [k for k in kinds for _ in range(k.count)]
    rng.shuffle(calls)
    legal: LegalReplicas | None = None
    try:
        for s in streams.values():
            assert s.start(CALL_TIMEOUT), "a legal replica's liveness stream was not welcomed"
        legal = LegalReplicas(lh.address, token)
        assert legal.first_quorum.wait(CALL_TIMEOUT), f"the legal replicas formed no quorum: {legal.errors}"
        attack_start = time.monotonic()
        for i in range(0, TOTAL_CALLS, WARMUP_CALLS):
            for kind in calls[i:i + WARMUP_CALLS]:
                attacker.launch(kind, rng)
            attacker.wait_idle(60.0)
            if i == 0:
                warm = measure(lh.proc)
        attacker.wait_finished(TOTAL_CALLS, 60.0)
        attack_end = time.monotonic()
        end = measure(lh.proc)
        served_after = legal.wait_for_quorums(LEGAL[0], legal.quorums(LEGAL[0]) + 1, CALL_TIMEOUT)
        legal.stop()
        status = legal.clients[LEGAL[0]].status()
        connected = {rid: s.connected for rid, s in streams.items()}
        heard_during = list(downs)  # before our own goodbyes below
        events = httpx.get(f"{lh.http}/events", params={"limit": 1000}, headers=bearer, timeout=10).json()
        metrics = httpx.get(f"{lh.http}/metrics", headers=bearer, timeout=10).text
        for s in streams.values():
            s.close()
        lh.proc.kill(signal.SIGTERM)
        rc = lh.proc.wait(15.0)
    finally:
        if legal is not None:
            legal.stop()
            legal.close()
        for s in streams.values():
            s.close()
        attacker.close()

    counts = attacker.counts
    during = {rid: legal.quorums(rid, attack_start, attack_end) for rid in LEGAL}
    quorum_ids = collections.Counter(qid for _, _, qid, _ in legal.records)
    memberships = collections.Counter(members for _, _, _, members in legal.records)
    m = re.search(r'rallypoint_lighthouse_rejected_requests_total\{reason="replica_id_taken"\} (\S+)', metrics)
    summary = {"seed": seed, "calls": sum(counts.values()), "attack_s": round(attack_end - attack_start, 1),
               "rss_warm_kib": warm["rss_kib"], "rss_end_kib": end["rss_kib"], "fds_warm": warm["fds"],
               "fds_end": end["fds"], "threads_warm": warm["threads"], "threads_end": end["threads"],
               "quorums_during_attack": during, "quorum_ids": dict(quorum_ids),
               "metric_replica_id_taken": float(m.group(1)) if m else None}
    print("\n" + table(counts, kinds))
    print(json.dumps(summary))

    assert rc == 0, f"the lighthouse did not stop cleanly (rc={rc})"
    unexpected = {key: (n, attacker.details[key]) for key, n in counts.items() if key[1] not in DENIED}
    assert not unexpected, f"id takeovers that were not refused: {unexpected}"
    assert not any(NEVER.match(st) for _, st in counts), counts
    assert summary["metric_replica_id_taken"] == TOTAL_CALLS, summary
    assert end["rss_kib"] - warm["rss_kib"] <= RSS_BUDGET_KIB, summary
    assert end["fds"] <= warm["fds"] + 4 and end["threads"] <= warm["threads"] + 2, summary

    assert not legal.errors, f"legal quorum requests failed during the attack: {legal.errors[:10]}"
    assert served_after, "the legal replicas formed no quorum after the attack"
    assert all(n > 5 for n in during.values()), summary
    assert set(memberships) == {tuple(sorted(LEGAL))}, dict(memberships)
    assert len(quorum_ids) == 1, f"quorum_id changed although the legal membership did not: {dict(quorum_ids)}"
    assert not heard_during, f"legal replicas heard PeerDowns: {heard_during[:5]}"
    assert all(connected.values()), connected
    rows = {r["replica_id"]: r for r in status["replicas"]}
    assert sorted(rows) == sorted(LEGAL), rows
    assert {rid: rows[rid]["address"] for rid in LEGAL} == ADDRESSES, rows
    assert not [e for e in events if e["kind"] in ("crash", "leave", "kill")], events
    log_text = lh.proc.stderr_text()
    logged = log_text.count("the id is bound to another caller")
    assert 1 <= logged <= (attack_end - attack_start) + 5, f"refusals logged {logged} times (rate-limited: ~1/s)"
    assert token not in log_text
    assert "Traceback (most recent call last)" not in log_text
