"""HA lighthouses on a real etcd (Debian's etcd-server; 1 and 3 members on loopback,
tests/etcd_cluster.py): one leads, the others stand by and take over; quorum_id stays
strictly increasing across failovers; a leader that loses etcd stops answering at once;
etcd unreachable at start is a clear error; replica groups given every lighthouse's
address keep training through a leader's SIGKILL -- in steady training, during a
membership change and during a heal."""

from __future__ import annotations

import signal
import time
from typing import Any

import grpc
import httpx
import pytest

from etcd_cluster import etcd_cluster  # noqa: F401  (fixture)

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.etcd_state import parse_spec
from rallypoint.lighthouse.server import LighthouseServer


def _wait(pred: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("spec, error", [
    ("etcd://127.0.0.1:2379", "names no key prefix"),
    ("etcd:///job", "names no etcd endpoint"),
    ("etcd://host/job", "is not host:port"),
    ("sqlite.db", "not an etcd state address"),
])
def test_bad_etcd_specs_say_what_is_wrong(spec: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_spec(spec)


def test_spec_round_trip() -> None:
    s = parse_spec("etcd://a:1, b:2/rallypoint/job/")
    assert s.endpoints == (("a", 1), ("b", 2)) and s.prefix == "/rallypoint/job" and str(s) == "etcd://a:1,b:2/rallypoint/job"


def test_one_leads_the_standby_refuses_and_takes_over_with_the_next_quorum_id(etcd_cluster) -> None:
    cl = etcd_cluster(members=1)
    spec = cl.spec("/rallypoint/t1")
    a = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1)
    b = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1)
    try:
        assert a.leadership is not None and b.leadership is not None
        _wait(lambda: a.leadership.leads() or b.leadership.leads(), 10, "a leader")
        leader, standby = (a, b) if a.leadership.leads() else (b, a)
        assert not standby.leadership.leads()
        # `rallypoint status --lighthouse standby,leader` shows the leader's status.
        from rallypoint.cli import _fetch_status

        assert _fetch_status(f"{standby.local_address()},{leader.local_address()}", 5)["lighthouse"]["role"] == "leader"
        assert _fetch_status(standby.local_address(), 5)["lighthouse"]["role"] == "standby"
        # The standby refuses what needs the leader, naming itself a standby.
        ch = grpc.insecure_channel(standby.local_address().replace("http://", ""))
        try:
            call = ch.unary_unary("/torchft.LighthouseService/Quorum", request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
                                  response_deserializer=pb.LighthouseQuorumResponse.FromString)
            with pytest.raises(grpc.RpcError) as e:
                call(pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="x")), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "standby lighthouse" in (e.value.details() or "")
        finally:
            ch.close()
        c = LighthouseClient(f"{standby.local_address()},{leader.local_address()}", connect_timeout=5)
        try:
            ids = [c.quorum("r1", timeout=5, step=1).quorum_id]
            ids.append(c.quorum("r1", timeout=5, step=2, commit_failures=1).quorum_id)
            leader.shutdown()  # a clean stop resigns: the standby takes over at once
            t = _wait(lambda: standby.leadership.leads(), 10, "the standby to take over")
            ids.append(c.quorum("r1", timeout=10, step=3, commit_failures=1).quorum_id)
            assert ids == sorted(set(ids)) and ids[0] >= 1, ids  # strictly increasing across the failover
            assert t < 2.0, t
        finally:
            c.close()
    finally:
        a.shutdown()
        b.shutdown()


def test_each_job_keeps_its_own_quorum_id_in_etcd_across_a_failover(etcd_cluster) -> None:
    """Jobs on an HA lighthouse: each job's quorum_id lives under its own etcd keys, is
    written by the same compare-and-swap, and continues on the new leader."""
    cl = etcd_cluster(members=1)
    spec = cl.spec("/rallypoint/jobs")
    a = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1)
    b = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1)
    clients = []
    try:
        assert a.leadership is not None and b.leadership is not None
        _wait(lambda: a.leadership.leads() or b.leadership.leads(), 10, "a leader")
        leader, standby = (a, b) if a.leadership.leads() else (b, a)
        both = f"{leader.local_address()},{standby.local_address()}"
        cx, cd = LighthouseClient(both, connect_timeout=5, job="x"), LighthouseClient(both, connect_timeout=5)
        clients += [cx, cd]
        x_ids = [cx.quorum("r", timeout=5, step=i, commit_failures=1).quorum_id for i in range(3)]
        d_ids = [cd.quorum("r", timeout=5, step=1).quorum_id]
        assert x_ids == [1, 2, 3] and d_ids == [1]
        leader.shutdown()
        _wait(lambda: standby.leadership.leads(), 10, "the standby to take over")
        x_ids.append(cx.quorum("r", timeout=10, step=5, commit_failures=1).quorum_id)
        d_ids.append(cd.quorum("r", timeout=10, step=5, commit_failures=1).quorum_id)
        assert x_ids == [1, 2, 3, 4] and d_ids == [1, 2], (x_ids, d_ids)
        assert standby.status(job="x")["quorum_id"] == 4
    finally:
        for c in clients:
            c.close()
        a.shutdown()
        b.shutdown()


def test_a_leader_that_loses_etcd_stops_answering_and_no_one_else_leads(etcd_cluster) -> None:
    cl = etcd_cluster(members=1)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=cl.spec("/rallypoint/t2"), ha_ttl_s=1)
    try:
        assert lh.leadership is not None
        _wait(lh.leadership.leads, 10, "the lighthouse to lead")
        c = LighthouseClient(lh.local_address(), connect_timeout=5)
        try:
            assert c.quorum("r1", timeout=5, step=1).quorum_id >= 1
            cl.stop()  # etcd gone: the lease cannot be kept alive
            _wait(lambda: not lh.leadership.leads(), 5, "the leader to step down")
            with pytest.raises(ConnectionError, match="standby lighthouse"):
                c.quorum("r1", timeout=3, step=2)
        finally:
            c.close()
    finally:
        lh.shutdown()


def test_etcd_unreachable_at_start_is_a_clear_error(etcd_cluster, rallypoint_cli) -> None:
    cl = etcd_cluster(members=1)
    spec = cl.spec("/rallypoint/t3")
    cl.stop()
    p = rallypoint_cli("lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off",
                       "--state", spec)
    assert p.wait(30) == 2
    assert "etcd is unreachable" in p.stderr_text()


def _attached(lhs: list[Any], prefix: str) -> bool:
    i = _leader(lhs)
    if i is None:
        return False
    rows = httpx.get(f"{lhs[i].http}/status", timeout=2).json()["replicas"]
    return any(row["replica_id"].startswith(prefix) and row["attached"] and not row["dead"] for row in rows)


def _leader(lhs: list[Any]) -> int | None:
    for i, lh in enumerate(lhs):
        if lh.proc.popen.poll() is None:
            try:
                if httpx.get(f"{lh.http}/status", timeout=2).json()["lighthouse"]["role"] == "leader":
                    return i
            except (httpx.HTTPError, KeyError, ValueError):
                continue
    return None


def test_training_survives_leader_sigkills_in_steady_state_a_membership_change_and_a_heal(
        etcd_cluster, cli_lighthouse, tmp_path) -> None:
    """Four CLI lighthouses on a 3-member etcd; replica groups given all three addresses.
    The leader is SIGKILLed (1) in steady training: leased groups go on; (2) right as a
    replica dies and the survivors need a new quorum; (3) while a returning replica heals.
    Every time a standby takes over and the job ends with every group identical."""
    from replica_worker import Replicas

    cl = etcd_cluster(members=3)
    spec = cl.spec("/rallypoint/train")
    lhs = [cli_lighthouse(min_replicas=1, state=spec, http=True, name=f"lh{i}",
                          extra=["--join-timeout-ms", "1000", "--etcd-ttl-s", "1"]) for i in range(4)]
    _wait(lambda: _leader(lhs) is not None, 15, "a leader")
    r = Replicas(tmp_path, ",".join(lh.address for lh in lhs))
    takeovers: list[float] = []

    def kill_leader() -> None:
        i = _leader(lhs)
        assert i is not None
        t0 = time.monotonic()
        lhs[i].proc.kill(signal.SIGKILL)
        lhs[i].proc.wait(10)
        _wait(lambda: _leader(lhs) not in (None, i), 10, "a standby to take over")
        takeovers.append(time.monotonic() - t0)

    try:
        opts = {"delay": 0.02, "width": 20000}
        r.start("replica_0", seed=1, **opts)
        r.start("replica_1", seed=2, **opts)
        r.start("replica_2", seed=3, **opts)
        r.wait_for("steady training", lambda: min(r.step(f"replica_{i}") for i in range(3)) >= 4, 40)
        s = r.step("replica_0")
        kill_leader()  # (1) steady: the groups are on a lease
        r.wait_for("training on", lambda: r.step("replica_0") >= s + 5, 30)
        victim = r.procs[next(k for k in r.procs if k.startswith("replica_2#"))]
        victim.kill()  # (2) a replica dies: the survivors need a new quorum ...
        victim.wait(10)
        kill_leader()  # ... from a new leader
        s = r.step("replica_0")
        r.wait_for("survivors go on", lambda: min(r.step("replica_0"), r.step("replica_1")) >= s + 5, 30)
        r.start("replica_2", seed=3, **opts)  # (3) it comes back: as soon as its stream is up, it asks
        r.wait_for("replica_2 attached", lambda: _attached(lhs, "replica_2"), 40)
        kill_leader()  # ... and the quorum that takes it in, and its heal, straddle the failover
        r.wait_for("replica_2 healed", lambda: r.step("replica_2") >= r.step("replica_0") - 1 >= s + 6, 40)
        target = max(r.step(f"replica_{i}") for i in range(3)) + 4
        r.finish(target, timeout=40)
        r.assert_identical([f"replica_{i}" for i in range(3)], target)
        assert len(takeovers) == 3 and max(takeovers) < 5.0, takeovers
    finally:
        r.kill_all()
