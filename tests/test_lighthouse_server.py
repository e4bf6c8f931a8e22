"""The lighthouse gRPC service end to end: real servers on 127.0.0.1:0, real clients.

What a user of the lighthouse relies on: every member of a quorum sees the same id and
member list, the fast path, quorum_id bumps, many waiters answered, walked-away callers
no longer counted, waiting callers kept alive, bad input refused without side effects,
bounded memory, auth, the HTTP face and Kill forwarding.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from rallypoint._proto import torchft_pb2 as pb
from rallypoint._proto import torchft_pb2_grpc as pb_grpc
from rallypoint.lighthouse.client import LivenessStream
from rallypoint.lighthouse.server import LighthouseServer

from conftest import ask_concurrently, assert_one_quorum, listening_ports, replica_row, reserved_port, wait_until

TOKEN = "test-token-123"
HTTP_TIMEOUT = 5.0


def raw_stub(lh: LighthouseServer) -> tuple[grpc.Channel, pb_grpc.LighthouseServiceStub]:
    channel = grpc.insecure_channel(lh.local_address().removeprefix("http://"))
    return channel, pb_grpc.LighthouseServiceStub(channel)


@pytest.fixture
def stub(closers: list[Callable[[], None]]) -> Callable[[LighthouseServer], pb_grpc.LighthouseServiceStub]:
    """``stub(lh)`` -> a raw torchft LighthouseService stub (its channel closed at teardown)."""

    def make(lh: LighthouseServer) -> pb_grpc.LighthouseServiceStub:
        channel, s = raw_stub(lh)
        closers.append(channel.close)
        return s

    return make


# ----------------------------------------------------------------------- forming


def test_three_replicas_agree_and_data_round_trips(lighthouse, client):
    lh = lighthouse(min_replicas=3, join_timeout_ms=60_000)
    c = client(lh)
    payload = {rid: {"replica": rid, "loss": 0.5, "tags": ["x", 1]} for rid in ("r2", "r0", "r1")}
    answers = ask_concurrently(c, ["r2", "r0", "r1"], kw_for=lambda rid: {"data": payload[rid], "step": 7})
    q = assert_one_quorum(answers, ["r0", "r1", "r2"])
    assert q.quorum_id >= 1
    for m in q.members:
        assert json.loads(m.data) == payload[m.replica_id]
        assert m.step == 7


def test_fast_path_keeps_id_and_does_not_wait_for_join_timeout(lighthouse, client):
    lh = lighthouse(min_replicas=2, join_timeout_ms=60_000)
    c = client(lh)
    first = assert_one_quorum(ask_concurrently(c, ["a", "b"]), ["a", "b"])
    # A healthy replica that is not asking would make a non-fast-path quorum wait up to
    # join_timeout (60 s) for it; the fast path must not.
    c.heartbeat("straggler")
    t0 = time.monotonic()
    second = assert_one_quorum(ask_concurrently(c, ["a", "b"], timeout=5.0), ["a", "b"])
    elapsed = time.monotonic() - t0
    assert second.quorum_id == first.quorum_id
    assert elapsed < 2.0, f"fast path took {elapsed:.2f}s"
    assert lh.status()["last_decision"]["rule"] == "fast_path"


def test_member_change_bumps_quorum_id(lighthouse, client):
    lh = lighthouse(min_replicas=2, join_timeout_ms=60_000)
    c = client(lh)
    first = assert_one_quorum(ask_concurrently(c, ["a", "b"]), ["a", "b"])
    # c asks first (alone it is no majority of a, b, c), then a and b join it.
    with cf.ThreadPoolExecutor(1) as ex:
        fc = ex.submit(c.quorum, "c", 10.0)
        wait_until(lambda: (replica_row(lh.status(), "c") or {}).get("participating"), 5.0, what="c participating")
        answers = ask_concurrently(c, ["a", "b"])
        answers["c"] = fc.result(10)
    second = assert_one_quorum(answers, ["a", "b", "c"])
    assert second.quorum_id == first.quorum_id + 1


def test_commit_failures_bump_quorum_id(lighthouse, client):
    lh = lighthouse(min_replicas=2)
    c = client(lh)
    q1 = assert_one_quorum(ask_concurrently(c, ["a", "b"]), ["a", "b"])
    q2 = assert_one_quorum(
        ask_concurrently(c, ["a", "b"], kw_for=lambda rid: {"commit_failures": 1 if rid == "b" else 0}), ["a", "b"]
    )
    assert q2.quorum_id == q1.quorum_id + 1
    q3 = assert_one_quorum(ask_concurrently(c, ["a", "b"]), ["a", "b"])
    assert q3.quorum_id == q2.quorum_id


def test_many_waiters_are_all_answered(lighthouse, client):
    n = 64
    lh = lighthouse(min_replicas=n, join_timeout_ms=60_000)
    c = client(lh)
    ids = [f"replica-{i:03d}" for i in range(n)]
    answers = ask_concurrently(c, ids, timeout=20.0)
    q = assert_one_quorum(answers, ids)
    assert len(q.members) == n
    # And the next round, all of them again (fast path).
    again = assert_one_quorum(ask_concurrently(c, ids, timeout=20.0), ids)
    assert again.quorum_id == q.quorum_id


# ----------------------------------------------------------------------- liveness


def test_timed_out_or_cancelled_request_stops_participating(lighthouse, client, stub):
    lh = lighthouse(min_replicas=2, join_timeout_ms=50)
    c = client(lh)
    with pytest.raises(TimeoutError):
        c.quorum("A", 0.3)
    wait_until(lambda: replica_row(lh.status(), "A")["participating"] is False, 1.0, what="A to stop participating")

    # B alone must not be matched with the A that walked away.
    with pytest.raises(TimeoutError):
        c.quorum("B", 0.5)

    # Explicit cancellation of a pending call (raw grpc) is seen too.
    s = stub(lh)
    fut = s.Quorum.future(pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="C")), timeout=10)
    wait_until(lambda: (replica_row(lh.status(), "C") or {}).get("participating"), 5.0, what="C participating")
    fut.cancel()
    wait_until(lambda: replica_row(lh.status(), "C")["participating"] is False, 1.0, what="C to stop participating")

    # Positive control: A and B together do form.
    assert_one_quorum(ask_concurrently(c, ["A", "B"], timeout=5.0), ["A", "B"])


def test_pending_request_keeps_replica_alive(lighthouse, client):
    lh = lighthouse(min_replicas=2, heartbeat_timeout_ms=200, join_timeout_ms=60_000)
    c = client(lh)
    with cf.ThreadPoolExecutor(1) as ex:
        fa = ex.submit(c.quorum, "A", 10.0)
        # A waits 5 x heartbeat_timeout with no heartbeat but its own pending request.
        with pytest.raises(cf.TimeoutError):
            fa.result(1.0)
        row = replica_row(lh.status(), "A")
        assert row is not None and row["participating"], row
        qb = c.quorum("B", 5.0)
        qa = fa.result(5.0)
    assert_one_quorum({"A": qa, "B": qb}, ["A", "B"])


# ----------------------------------------------------------------------- bad input


def _member(**kw: Any) -> pb.LighthouseQuorumRequest:
    base: dict[str, Any] = {"replica_id": "ok"}
    base.update(kw)
    return pb.LighthouseQuorumRequest(requester=pb.QuorumMember(**base))


BAD_QUORUM_REQUESTS = {
    "missing requester": (pb.LighthouseQuorumRequest(), "requester"),
    "empty replica_id": (_member(replica_id=""), "requester.replica_id"),
    "300-byte replica_id": (_member(replica_id="x" * 300), "requester.replica_id"),
    "non-printable replica_id": (_member(replica_id="a\x00b"), "requester.replica_id"),
    "negative step": (_member(step=-1), "requester.step"),
    "negative commit_failures": (_member(commit_failures=-3), "requester.commit_failures"),
    "data not json": (_member(data="not json"), "requester.data"),
    "data over 64 KiB": (_member(data=json.dumps("x" * (64 * 1024 + 10))), "requester.data"),
}


def _snapshot(lh: LighthouseServer) -> tuple:
    s = lh.status()
    return (
        s["quorum_id"],
        s["quorum"],
        sorted((r["replica_id"], r["participating"], r["step"]) for r in s["replicas"]),
        len(lh.core.store.events(limit=10_000)),
    )


@pytest.mark.parametrize("case", list(BAD_QUORUM_REQUESTS))
def test_bad_quorum_request_is_invalid_argument_without_state_change(lighthouse, client, stub, case):
    lh = lighthouse(min_replicas=1)
    client(lh).quorum("existing", 5.0, step=3)
    before = _snapshot(lh)
    request, field = BAD_QUORUM_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as ei:
        stub(lh).Quorum(request, timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in ei.value.details(), ei.value.details()
    assert _snapshot(lh) == before


def test_bad_heartbeat_is_invalid_argument(lighthouse, client, stub):
    lh = lighthouse(min_replicas=1)
    before = _snapshot(lh)
    with pytest.raises(grpc.RpcError) as ei:
        stub(lh).Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=""), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "replica_id" in ei.value.details()
    assert _snapshot(lh) == before
    # The client turns it into a ValueError naming the field.
    with pytest.raises(ValueError, match="replica_id"):
        client(lh).heartbeat("")


# ----------------------------------------------------------------------- shrink_only


def test_shrink_only_lone_newcomer_gets_itself_not_an_empty_quorum(lighthouse, client):
    lh = lighthouse(min_replicas=1, join_timeout_ms=60_000)
    c = client(lh)
    assert list(c.quorum("old", 5.0).replica_ids) == ["old"]
    stream = LivenessStream(lh.local_address(), "old")
    assert stream.start(5.0)
    stream.close("old replica finished")  # gone, for certain
    q = c.quorum("new", 5.0, shrink_only=True)
    assert list(q.replica_ids) == ["new"]


def test_shrink_only_never_below_min_replicas(lighthouse, client):
    lh = lighthouse(min_replicas=2, join_timeout_ms=60_000)
    c = client(lh)
    assert_one_quorum(ask_concurrently(c, ["a", "b"]), ["a", "b"])
    for rid in ("a", "b"):
        s = LivenessStream(lh.local_address(), rid)
        assert s.start(5.0)
        s.close("done")
    with cf.ThreadPoolExecutor(1) as ex:
        fc = ex.submit(c.quorum, "c", 10.0, shrink_only=True)
        with pytest.raises(cf.TimeoutError):
            fc.result(0.5)  # alone: below min_replicas, so no quorum (never an empty one)
        qd = c.quorum("d", 5.0)
        qc = fc.result(5.0)
    q = assert_one_quorum({"c": qc, "d": qd}, ["c", "d"])
    assert len(q.members) >= 2


# ----------------------------------------------------------------------- bounded state


def test_forgotten_replicas_keep_status_small(lighthouse, stub):
    lh = lighthouse(min_replicas=1, heartbeat_timeout_ms=100, forget_after_ms=300)
    s = stub(lh)
    n = 2000
    for start in range(0, n, 250):
        futs = [
            s.Heartbeat.future(pb.LighthouseHeartbeatRequest(replica_id=f"ephemeral-{i:05d}"), timeout=10)
            for i in range(start, min(n, start + 250))
        ]
        for f in futs:
            f.result()
    assert len(lh.status()["replicas"]) > 0

    def forgotten() -> dict | None:
        st = lh.status()
        return None if st["replicas"] else st

    status = wait_until(forgotten, 10.0, interval=0.05, what="replicas forgotten")
    size = len(json.dumps(status))
    assert size < 4096, f"status is {size} bytes after forgetting {n} replicas"


def test_replicas_that_left_leave_nothing_behind(lighthouse, client):
    """Replicas that asked for a quorum (address and step recorded) and then left (each
    restart is a new id) are forgotten entirely after forget_after, not only from status."""
    lh = lighthouse(min_replicas=1, heartbeat_timeout_ms=100, forget_after_ms=300)
    c = client(lh)
    for i in range(20):
        rid = f"restart-{i}"
        assert list(c.quorum(rid, 5.0).replica_ids) == [rid]
        s = LivenessStream(lh.local_address(), rid, address=f"http://127.0.0.1:{1000 + i}")
        assert s.start(5.0)
        s.close("restarting")
    assert lh.core._addresses and lh.core._steps  # held while the replicas are remembered
    wait_until(lambda: not lh.core._addresses and not lh.core._steps, 10.0,
               interval=0.05, what="per-replica state forgotten")


# ----------------------------------------------------------------------- auth


def test_token_required_on_grpc(lighthouse, stub, monkeypatch):
    monkeypatch.delenv("RALLYPOINT_TOKEN", raising=False)
    lh = lighthouse(min_replicas=1, token=TOKEN)
    s = stub(lh)
    for call, req in (
        (s.Quorum, pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a"))),
        (s.Heartbeat, pb.LighthouseHeartbeatRequest(replica_id="a")),
    ):
        with pytest.raises(grpc.RpcError) as ei:
            call(req, timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msg = ei.value.details()
        assert "authorization" in msg and "Bearer" in msg and "RALLYPOINT_TOKEN" in msg, msg
    with pytest.raises(grpc.RpcError) as ei:
        s.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="a"), timeout=5, metadata=[("authorization", "Bearer wrong")])
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Nothing refused reached the state.
    assert lh.status()["replicas"] == []


def test_client_token_argument_and_env(lighthouse, client, monkeypatch):
    monkeypatch.delenv("RALLYPOINT_TOKEN", raising=False)
    lh = lighthouse(min_replicas=1, token=TOKEN)
    with pytest.raises(PermissionError, match="Bearer"):
        client(lh).heartbeat("a")
    c = client(lh, token=TOKEN)
    c.heartbeat("a")
    assert list(c.quorum("a", 5.0).replica_ids) == ["a"]
    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    c_env = client(lh)
    assert list(c_env.quorum("a", 5.0).replica_ids) == ["a"]
    assert c_env.status()["quorum_id"] >= 1


def test_http_routes_and_token(lighthouse, client):
    lh = lighthouse(min_replicas=1, token=TOKEN, http_bind="127.0.0.1:0")
    client(lh, token=TOKEN).quorum("a", 5.0)
    base = lh.http_address()
    assert base is not None
    with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT) as http:
        r = http.post("/replica/x/kill")
        assert r.status_code == 401
        assert "Bearer" in r.text
        r = http.post("/replica/x/kill", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = http.post("/replica/x/kill", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404  # authorized, but no such replica
        assert http.get("/status").status_code == 401  # the status lists every address
        assert http.get("/healthz").status_code == 200
        http.headers["Authorization"] = f"Bearer {TOKEN}"
        r = http.get("/status")
        assert r.status_code == 200
        body = r.json()
        assert body["quorum_id"] >= 1 and [m["replica_id"] for m in body["quorum"]["members"]] == ["a"]
        r = http.get("/metrics")
        assert r.status_code == 200
        assert "rallypoint_lighthouse_quorum_id" in r.text


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads this process's sockets from /proc (Linux)")
def test_failed_http_start_releases_grpc_port(lighthouse, monkeypatch):
    import rallypoint.lighthouse.server as lh_server

    bound: list[int] = []
    real_server = lh_server.grpc.aio.server

    def recording_server(*a, **kw):
        server = real_server(*a, **kw)
        add = server.add_insecure_port
        server.add_insecure_port = lambda addr: bound.append(add(addr)) or bound[-1]  # type: ignore[method-assign]
        return server

    monkeypatch.setattr(lh_server.grpc.aio, "server", recording_server)
    with reserved_port(listen=True) as busy, pytest.raises(OSError, match="in use"):
        lighthouse(bind="127.0.0.1:0", http_bind=f"127.0.0.1:{busy}")
    # It had bound a gRPC port (port 0: the OS chose one) and no longer listens on it.
    assert len(bound) == 1 and bound[0] > 0
    assert bound[0] not in listening_ports()


# ----------------------------------------------------------------------- kill


class FakeManager:
    """A torchft ManagerService that only implements Kill and records its requests."""

    def __init__(self) -> None:
        self.kills: queue.Queue[pb.KillRequest] = queue.Queue()
        self._pool = cf.ThreadPoolExecutor(2)
        self.server = grpc.server(self._pool)
        handler = grpc.method_handlers_generic_handler(
            "torchft.ManagerService",
            {
                "Kill": grpc.unary_unary_rpc_method_handler(
                    self._kill,
                    request_deserializer=pb.KillRequest.FromString,
                    response_serializer=pb.KillResponse.SerializeToString,
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"http://127.0.0.1:{self.port}"

    def _kill(self, request: pb.KillRequest, _context: grpc.ServicerContext) -> pb.KillResponse:
        self.kills.put(request)
        return pb.KillResponse()

    def stop(self) -> None:
        self.server.stop(0).wait(5)
        self._pool.shutdown(wait=False)


@pytest.fixture
def fake_manager() -> Iterator[FakeManager]:
    m = FakeManager()
    yield m
    m.stop()


def test_kill_is_forwarded_to_the_manager(lighthouse, client, fake_manager):
    lh = lighthouse(min_replicas=1, http_bind="127.0.0.1:0")
    c = client(lh)
    c.quorum("r1", 5.0, address=fake_manager.address)
    with httpx.Client(base_url=lh.http_address(), timeout=HTTP_TIMEOUT) as http:
        r = http.post("/replica/r1/kill", json={"reason": "operator says stop"})
        assert r.status_code == 200, r.text
        assert r.json()["address"] == fake_manager.address
        assert fake_manager.kills.get(timeout=5).msg == "operator says stop"
        r = http.post("/replica/ghost/kill", json={"reason": "x"})
        assert r.status_code == 404
        assert "ghost" in r.json()["detail"]

    assert c.kill("r1", reason="from the client") == fake_manager.address
    assert fake_manager.kills.get(timeout=5).msg == "from the client"
    with pytest.raises(KeyError):
        c.kill("ghost")
    assert fake_manager.kills.empty()
    kills = [e for e in lh.core.store.events(limit=100) if e.kind == "kill"]
    assert [e.replica_id for e in kills] == ["r1", "r1"]


# ----------------------------------------------------------------------- shutdown


def test_core_stop_ends_the_timer_even_when_its_wakeup_and_the_cancel_coincide() -> None:
    """On Python 3.11, ``asyncio.wait_for`` returns the result and swallows a cancel that
    arrives after the awaited wait finished. The timer then slept on (every 0.5 s, for the
    heartbeat sweep) and a lighthouse shutdown waited its whole 10 s timeout (seen about
    once in eight runs of this file). Here the timer's wait finishes and the cancel comes
    before it resumes: ``stop`` must still end at once."""
    import asyncio

    from rallypoint.lighthouse.core import LighthouseCore
    from rallypoint.lighthouse.metrics import LighthouseMetrics
    from rallypoint.lighthouse.quorum import Options
    from rallypoint.lighthouse.state import StateStore

    async def go() -> None:
        core = LighthouseCore(Options(min_replicas=1, join_timeout=0.05), StateStore(":memory:"), LighthouseMetrics())
        core.start()
        core.heartbeat("a")  # a known replica: the timer's wait has a deadline (the sweep)
        for _ in range(5):
            await asyncio.sleep(0)  # the timer is in its wait_for
        assert core._wakeup is not None and core._timer is not None
        core._wakeup.set()
        await asyncio.sleep(0)  # the wait finished; the timer has not resumed yet
        stopping = asyncio.ensure_future(core.stop())
        t0 = time.monotonic()
        await asyncio.wait({stopping}, timeout=5)  # (wait_for would cancel it: a second cancel ends it)
        assert stopping.done() and core._timer.done(), f"stop still waits for the timer after {time.monotonic() - t0:.1f}s"
        assert time.monotonic() - t0 < 1.0

    asyncio.run(go())
