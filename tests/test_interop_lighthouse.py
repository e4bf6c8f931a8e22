"""Interop with the real torchft 0.2.0 wheel, over the lighthouse and manager protocols.

Both directions run here, on loopback with port 0 (the OS picks free ports):

* torchft's Rust ``LighthouseClient`` and ``ManagerServer``/``ManagerClient`` against
  OUR lighthouse (quorums, ``data`` round-trip, heartbeats, membership changes,
  healing assignments computed by torchft from our quorum);
* OUR ``LighthouseClient`` and ``LivenessStream`` against torchft's ``LighthouseServer``;
* a raw-wire check: our generated stubs, sent with plain grpc to torchft's lighthouse,
  come back field for field (proves the field numbers of ``QuorumMember`` match).

torchft is imported plainly: CI guarantees the peer wheel is installed, and a missing
peer must fail loudly rather than skip.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.unknown_fields import UnknownFieldSet
from torchft._torchft import LighthouseClient as TorchftLighthouseClient
from torchft._torchft import LighthouseServer as TorchftLighthouseServer
from torchft._torchft import ManagerClient as TorchftManagerClient
from torchft._torchft import ManagerServer as TorchftManagerServer

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream
from rallypoint.lighthouse.server import LighthouseServer

pytestmark = pytest.mark.interop

T = TypeVar("T")
TORCHFT_03_FIELDS = ("reconfigure_handles",)  # QuorumMember fields torchft 0.2.0 does not know

CONNECT = timedelta(seconds=10)
QUORUM_TIMEOUT = timedelta(seconds=10)
# Upper bound on any thread/future wait in this file (well under pytest's 120 s).
JOIN_S = 30.0


# --------------------------------------------------------------------- helpers
@pytest.fixture
def our_lighthouse() -> Iterator[Callable[..., LighthouseServer]]:
    """Factory for our lighthouse on a free loopback port; all are shut down after."""
    started: list[LighthouseServer] = []

    def make(**kwargs: Any) -> LighthouseServer:
        kwargs.setdefault("heartbeat_timeout_ms", 5000)
        lh = LighthouseServer(bind="127.0.0.1:0", quorum_tick_ms=None, **kwargs)
        started.append(lh)
        return lh

    try:
        yield make
    finally:
        for lh in reversed(started):
            lh.shutdown()


@pytest.fixture
def torchft_lighthouse() -> Iterator[Callable[..., TorchftLighthouseServer]]:
    """Factory for torchft's own (Rust) lighthouse on a free loopback port."""
    started: list[TorchftLighthouseServer] = []

    def make(**kwargs: Any) -> TorchftLighthouseServer:
        lh = TorchftLighthouseServer(bind="127.0.0.1:0", **kwargs)
        started.append(lh)
        return lh

    try:
        yield make
    finally:
        for lh in reversed(started):
            lh.shutdown()


def concurrently(*calls: Callable[[], T], timeout: float = JOIN_S) -> list[T]:
    """Run the calls in parallel threads; results in call order; re-raises the first error."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futures]


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``pred`` (a cheap status read) until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(0.01)


def replica_row(lh: LighthouseServer, replica_id: str) -> dict | None:
    for row in lh.status()["replicas"]:
        if row["replica_id"] == replica_id:
            return row
    return None


def participating(lh: LighthouseServer, replica_id: str) -> bool:
    row = replica_row(lh, replica_id)
    return bool(row and row["participating"])


def ts_seconds(ts: Any) -> float:
    return ts.seconds + ts.nanos / 1e9


def tf_quorum(client: TorchftLighthouseClient, rid: str, step: int, data: dict | None = None, **kw: Any) -> Any:
    """torchft's client asks our lighthouse, with every member field set from ``rid``."""
    return client.quorum(
        replica_id=rid,
        timeout=kw.pop("timeout", QUORUM_TIMEOUT),
        address=f"http://{rid}.example:29512",
        store_address=f"{rid}.example:29500",
        step=step,
        world_size=kw.pop("world_size", 2),
        shrink_only=False,
        data=data,
        **kw,
    )


# ------------------------------------------------- 1. torchft client -> our lighthouse
def test_torchft_client_gets_quorum_from_our_lighthouse(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    lh = our_lighthouse(min_replicas=3, join_timeout_ms=60_000)
    ids = ["rep-c", "rep-a", "rep-b"]  # asked out of order on purpose
    data = {
        rid: {"rid": rid, "n": i, "loss": 0.25 * i, "nested": {"list": [1, "two", None, True]}, "ünï": "çödé"}
        for i, rid in enumerate(ids)
    }
    clients = {rid: TorchftLighthouseClient(addr=lh.address(), connect_timeout=CONNECT) for rid in ids}
    steps = {"rep-a": 7, "rep-b": 9, "rep-c": 8}

    before = time.time()
    quorums = concurrently(*(lambda rid=rid: tf_quorum(clients[rid], rid, steps[rid], data[rid]) for rid in ids))
    after = time.time()

    qids = {q.quorum_id for q in quorums}
    assert len(qids) == 1, f"callers got different quorum ids: {qids}"
    qid = qids.pop()
    assert isinstance(qid, int) and qid >= 1
    for q in quorums:
        assert [p.replica_id for p in q.participants] == ["rep-a", "rep-b", "rep-c"]
        for p in q.participants:
            rid = p.replica_id
            assert p.address == f"http://{rid}.example:29512"
            assert p.store_address == f"{rid}.example:29500"
            assert p.step == steps[rid]
            assert p.world_size == 2
            assert p.shrink_only is False
            # torchft sends data as a JSON string and parses it back into a dict.
            assert p.data == data[rid]
        # created: set when the quorum formed, i.e. inside the window of our calls.
        assert before - 1.0 <= ts_seconds(q.created) <= after + 1.0
        assert 0 <= q.created.nanos < 1_000_000_000
    assert len({ts_seconds(q.created) for q in quorums}) == 1, "one quorum, one creation time"


def test_torchft_client_data_none_and_empty(
    our_lighthouse: Callable[..., LighthouseServer],
    torchft_lighthouse: Callable[..., TorchftLighthouseServer],
) -> None:
    """What torchft's client gets back for data=None / {} is the same from both lighthouses."""
    ours = our_lighthouse(min_replicas=1, join_timeout_ms=100)
    theirs = torchft_lighthouse(min_replicas=1, join_timeout_ms=100)
    seen: dict[str, list[Any]] = {}
    for name, addr in (("ours", ours.address()), ("theirs", theirs.address())):
        client = TorchftLighthouseClient(addr=addr, connect_timeout=CONNECT)
        seen[name] = [
            tf_quorum(client, "solo", 1, data=d, world_size=1).participants[0].data for d in (None, {}, {"x": 1})
        ]
        # The bare call (only replica_id + timeout), as torchft's own tests make it.
        bare = client.quorum(replica_id="solo", timeout=QUORUM_TIMEOUT)
        assert [p.replica_id for p in bare.participants] == ["solo"]
    assert seen["ours"] == seen["theirs"], seen
    assert seen["ours"][2] == {"x": 1}


def test_torchft_heartbeat_reaches_our_lighthouse(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    lh = our_lighthouse(min_replicas=2, join_timeout_ms=60_000)
    client = TorchftLighthouseClient(addr=lh.address(), connect_timeout=CONNECT)
    assert replica_row(lh, "hb-only") is None
    client.heartbeat("hb-only")
    client.heartbeat("hb-only", timeout=timedelta(seconds=2))
    row = replica_row(lh, "hb-only")
    assert row is not None, "heartbeat did not register the replica"
    assert row["participating"] is False
    assert row["heartbeat_age_s"] is not None and 0 <= row["heartbeat_age_s"] < 2.0


def test_torchft_client_membership_change_bumps_quorum_id(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    """3 replicas -> one leaves (stops asking) -> 2 form after join_timeout with a new
    quorum_id -> the same 2 again keep it (fast path) -> the third returns: new id."""
    join_ms = 1000
    lh = our_lighthouse(min_replicas=2, join_timeout_ms=join_ms, heartbeat_timeout_ms=30_000)
    ids = ["r0", "r1", "r2"]
    clients = {rid: TorchftLighthouseClient(addr=lh.address(), connect_timeout=CONNECT) for rid in ids}
    # Everyone heartbeats first, so round 1 waits for all three (no early 2-quorum).
    for rid in ids:
        clients[rid].heartbeat(rid)

    def ask(rid: str, step: int) -> Any:
        return tf_quorum(clients[rid], rid, step, {"rid": rid})

    q1 = concurrently(*(lambda rid=rid: ask(rid, 1) for rid in ids))
    assert {q.quorum_id for q in q1} == {q1[0].quorum_id}
    assert [p.replica_id for p in q1[0].participants] == ids
    id1 = q1[0].quorum_id

    # r2 leaves: it stops asking but is still heartbeat-healthy, so the other two wait
    # out join_timeout and then form without it (2 of 3 healthy is a majority).
    t0 = time.monotonic()
    q2 = concurrently(lambda: ask("r0", 2), lambda: ask("r1", 2))
    waited = time.monotonic() - t0
    assert {q.quorum_id for q in q2} == {q2[0].quorum_id}
    assert [p.replica_id for p in q2[0].participants] == ["r0", "r1"]
    assert q2[0].quorum_id > id1, "membership shrank but quorum_id did not increase"
    assert waited >= join_ms / 1000 * 0.8, f"formed after {waited:.3f}s, before join_timeout"
    assert ts_seconds(q2[0].created) > ts_seconds(q1[0].created)

    # Same two members again: fast path, same id.
    q3 = concurrently(lambda: ask("r0", 3), lambda: ask("r1", 3))
    assert {q.quorum_id for q in q3} == {q2[0].quorum_id}
    assert [p.step for p in q3[0].participants] == [3, 3]

    # r2 comes back: it asks first; once it is pending the previous members' requests
    # complete the fast path with all three participants and a new id.
    with ThreadPoolExecutor(max_workers=3) as pool:
        back = pool.submit(ask, "r2", 4)
        wait_until(lambda: participating(lh, "r2"), what="r2's request to be pending")
        rest = [pool.submit(ask, rid, 4) for rid in ("r0", "r1")]
        q4 = [f.result(timeout=JOIN_S) for f in (back, *rest)]
    assert {q.quorum_id for q in q4} == {q4[0].quorum_id}
    assert [p.replica_id for p in q4[0].participants] == ids
    assert q4[0].quorum_id > q2[0].quorum_id
    assert [p.data for p in q4[0].participants] == [{"rid": rid} for rid in ids]


def test_torchft_client_timeout_releases_participant(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    """torchft's client gives up (its own deadline): our lighthouse drops the request, so
    a later pair forms without the quitter instead of counting it as a participant."""
    lh = our_lighthouse(min_replicas=2, join_timeout_ms=200, heartbeat_timeout_ms=30_000)
    client = TorchftLighthouseClient(addr=lh.address(), connect_timeout=CONNECT)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        tf_quorum(client, "quitter", 1, timeout=timedelta(milliseconds=300))
    assert time.monotonic() - t0 < 5.0
    wait_until(lambda: not participating(lh, "quitter"), timeout=5.0, what="the cancelled request to be dropped")

    qs = concurrently(lambda: tf_quorum(client, "a", 1), lambda: tf_quorum(client, "b", 1))
    assert [p.replica_id for p in qs[0].participants] == ["a", "b"]
    assert qs[0].quorum_id == qs[1].quorum_id


# ------------------------------------- 2. torchft ManagerServers -> our lighthouse
def _managers(lighthouse_addr: str, n: int) -> list[TorchftManagerServer]:
    servers: list[TorchftManagerServer] = []
    try:
        for i in range(n):
            servers.append(
                TorchftManagerServer(
                    replica_id=f"rep{i}",
                    lighthouse_addr=lighthouse_addr,
                    hostname="127.0.0.1",
                    bind="127.0.0.1:0",
                    store_addr=f"127.0.0.1:123{i}",
                    world_size=1,
                    heartbeat_interval=timedelta(milliseconds=100),
                    connect_timeout=CONNECT,
                    quorum_retries=0,
                )
            )
    except BaseException:
        for s in servers:
            s.shutdown()
        raise
    return servers


def _manager_ask(client: TorchftManagerClient, step: int, commit_failures: int = 0, shrink_only: bool = False) -> Any:
    return client._quorum(
        group_rank=0,
        step=step,
        checkpoint_metadata="m",
        shrink_only=shrink_only,
        timeout=QUORUM_TIMEOUT,
        commit_failures=commit_failures,
        init_sync=True,
    )


def test_torchft_managers_quorum_through_our_lighthouse(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    lh = our_lighthouse(min_replicas=3, join_timeout_ms=60_000)
    servers = _managers(lh.address(), 3)
    try:
        addresses = [s.address() for s in servers]
        clients = [TorchftManagerClient(addr=a, connect_timeout=CONNECT) for a in addresses]
        # The managers' background heartbeats reach our lighthouse.
        wait_until(
            lambda: all(replica_row(lh, f"rep{i}") is not None for i in range(3)),
            what="the three managers' heartbeats",
        )

        def ask(i: int, step: int) -> Any:
            return clients[i]._quorum(
                group_rank=0,
                step=step,
                checkpoint_metadata=f"meta-{i}",
                shrink_only=False,
                timeout=QUORUM_TIMEOUT,
                commit_failures=0,
                init_sync=True,
            )

        # Round 1: rep1 is behind and must heal from an up-to-date peer.
        steps = [5, 3, 5]
        r1 = concurrently(*(lambda i=i: ask(i, steps[i]) for i in range(3)))
        qid = r1[0].quorum_id
        up_to_date = {i for i in range(3) if steps[i] == max(steps)}
        for i, r in enumerate(r1):
            assert r.quorum_id == qid
            assert r.replica_world_size == 3
            assert r.replica_rank == i
            assert r.replica_ids == ["rep0", "rep1", "rep2"]
            assert r.max_step == 5
            assert r.max_world_size == len(up_to_date)
            assert r.store_address in {f"127.0.0.1:123{j}" for j in up_to_date}
            # (QuorumResult.commit_failures is in torchft's .pyi but not in the 0.2.0 binary.)
            if i in up_to_date:
                assert r.heal is False
                assert r.recover_src_manager_address == ""
                assert r.recover_src_replica_rank is None
                assert r.max_replica_rank is not None
            else:
                assert r.heal is True
                assert r.recover_src_replica_rank in up_to_date
                assert r.recover_src_manager_address == addresses[r.recover_src_replica_rank]
                assert r.max_replica_rank is None
        # Every healing replica is someone's destination, exactly once.
        dsts = sorted(d for r in r1 for d in r.recover_dst_replica_ranks)
        assert dsts == [1]
        src = r1[1].recover_src_replica_rank
        assert r1[src].recover_dst_replica_ranks == [1]
        # The healer can read the source's checkpoint metadata over torchft's own RPC.
        assert clients[src]._checkpoint_metadata(0, timeout=QUORUM_TIMEOUT) == f"meta-{src}"

        # Round 2: everyone at the same step -> fast path, same quorum id, nobody heals.
        r2 = concurrently(*(lambda i=i: ask(i, 6) for i in range(3)))
        for i, r in enumerate(r2):
            assert r.quorum_id == qid
            assert r.replica_rank == i
            assert r.replica_world_size == 3
            assert r.max_step == 6
            assert r.max_world_size == 3
            assert r.heal is False
            assert r.recover_dst_replica_ranks == []
            assert r.replica_ids == ["rep0", "rep1", "rep2"]
        assert lh.status()["last_decision"]["rule"] == "fast_path"
    finally:
        for s in servers:
            s.shutdown()


def test_torchft_managers_commit_failures_bump_like_torchft(
    our_lighthouse: Callable[..., LighthouseServer],
    torchft_lighthouse: Callable[..., TorchftLighthouseServer],
) -> None:
    """The quorum_id sequence seen by torchft managers is the same with either lighthouse:
    unchanged on the fast path, bumped when a member reports commit_failures > 0."""
    rounds = [(0, False), (0, False), (1, False), (0, False), (0, True)]
    seen: dict[str, list[list[int]]] = {}
    for name, lh in (("ours", our_lighthouse(min_replicas=2)), ("theirs", torchft_lighthouse(min_replicas=2))):
        servers = _managers(lh.address(), 2)
        try:
            clients = [TorchftManagerClient(addr=s.address(), connect_timeout=CONNECT) for s in servers]
            seen[name] = [
                [
                    r.quorum_id
                    for r in concurrently(
                        lambda: _manager_ask(clients[0], step, cf, shrink),
                        lambda: _manager_ask(clients[1], step),
                    )
                ]
                for step, (cf, shrink) in enumerate(rounds, start=1)
            ]
        finally:
            for s in servers:
                s.shutdown()
    assert seen["ours"] == seen["theirs"], seen
    assert seen["ours"] == [[1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]


def test_torchft_manager_death_is_seen_by_heartbeat_timeout(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    """A torchft manager shuts down: its heartbeats stop, and once they expire the two
    survivors get a smaller quorum with a new id, without waiting for join_timeout."""
    hb_ms = 1500
    lh = our_lighthouse(min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=hb_ms)
    servers = _managers(lh.address(), 3)
    try:
        clients = [TorchftManagerClient(addr=s.address(), connect_timeout=CONNECT) for s in servers]
        # All three must be heartbeat-healthy before round 1, or the first two to ask
        # would (rightly) form without the third.
        wait_until(lambda: all(replica_row(lh, f"rep{i}") for i in range(3)), what="the managers' heartbeats")
        r1 = concurrently(*(lambda c=c: _manager_ask(c, 1) for c in clients))
        assert [r.replica_world_size for r in r1] == [3, 3, 3]
        servers[2].shutdown()
        t0 = time.monotonic()
        r2 = concurrently(lambda: _manager_ask(clients[0], 2), lambda: _manager_ask(clients[1], 2))
        waited = time.monotonic() - t0
        for i, r in enumerate(r2):
            assert r.replica_ids == ["rep0", "rep1"]
            assert r.replica_world_size == 2
            assert r.replica_rank == i
            assert r.quorum_id > r1[0].quorum_id
        assert waited < 10.0, f"survivors waited {waited:.1f}s (join_timeout is 60 s)"
    finally:
        for s in servers:
            s.shutdown()


# ------------------------------------------ 3. our client -> torchft's lighthouse
def test_our_client_against_torchft_lighthouse(torchft_lighthouse: Callable[..., TorchftLighthouseServer]) -> None:
    theirs = torchft_lighthouse(min_replicas=2)
    data = {"a": {"rid": "a", "x": [1, 2]}, "b": {"rid": "b", "x": [3]}}
    with LighthouseClient(theirs.address(), connect_timeout=10.0) as ca, LighthouseClient(
        theirs.address(), connect_timeout=timedelta(seconds=10)
    ) as cb:

        def ask(client: LighthouseClient, rid: str, step: int) -> Any:
            return client.quorum(
                rid,
                timeout=QUORUM_TIMEOUT,
                address=f"http://{rid}:1",
                store_address=f"{rid}:2",
                step=step,
                world_size=4,
                shrink_only=False,
                data=data[rid],
            )

        qb, qa = concurrently(lambda: ask(cb, "b", 11), lambda: ask(ca, "a", 10))
        assert qa.quorum_id == qb.quorum_id >= 1
        assert qa.members == qb.members
        assert [m.replica_id for m in qa.members] == ["a", "b"]
        for m in qa.members:
            assert m.address == f"http://{m.replica_id}:1"
            assert m.store_address == f"{m.replica_id}:2"
            assert m.world_size == 4
            assert m.shrink_only is False
            assert json.loads(m.data) == data[m.replica_id]
        assert [m.step for m in qa.members] == [10, 11]
        assert abs(qa.created - time.time()) < 60

        ca.heartbeat("a")
        cb.heartbeat("b", timeout=timedelta(seconds=2))

        # Same members again: torchft's fast path keeps the id.
        qa2, qb2 = concurrently(lambda: ask(ca, "a", 12), lambda: ask(cb, "b", 12))
        assert qa2.quorum_id == qb2.quorum_id == qa.quorum_id


def test_our_client_quorum_timeout_is_timeout_error_against_torchft(
    torchft_lighthouse: Callable[..., TorchftLighthouseServer],
) -> None:
    """No quorum within the caller's timeout must raise TimeoutError, whichever side's
    timer fires first. torchft's server (tonic) enforces the grpc-timeout header itself
    and answers CANCELLED "Timeout expired"; that races the client's own
    DEADLINE_EXCEEDED, so ~10-20 % of timeouts arrive as CANCELLED. 30 tries."""
    theirs = torchft_lighthouse(min_replicas=1000)  # never forms
    with LighthouseClient(theirs.address(), connect_timeout=10.0) as client:
        for i in range(30):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=f"lonely{i}"):
                client.quorum(f"lonely{i}", timeout=0.1)
            assert time.monotonic() - t0 < 5.0


def test_our_client_maps_server_side_timeout_to_timeout_error() -> None:
    """Deterministic form of the test above: a server that answers the way torchft's
    tonic server does when the request's grpc-timeout expires on its side."""

    def quorum(_request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.CANCELLED, "Timeout expired")
        raise AssertionError("unreachable")

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "torchft.LighthouseService",
                {"Quorum": grpc.unary_unary_rpc_method_handler(quorum)},
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=10.0) as client:
            with pytest.raises(TimeoutError, match="rep0"):
                client.quorum("rep0", timeout=5.0)
    finally:
        server.stop(grace=None).wait(5)


def test_our_liveness_stream_against_torchft_lighthouse(
    torchft_lighthouse: Callable[..., TorchftLighthouseServer],
) -> None:
    theirs = torchft_lighthouse(min_replicas=1)
    stream = LivenessStream(theirs.address(), "live-0", address="http://127.0.0.1:1", ping_interval=0.05)
    try:
        t0 = time.monotonic()
        assert stream.start(timeout=10.0) is True
        assert time.monotonic() - t0 < 5.0
        assert stream.unsupported is True
        assert stream.welcome is None
        # The lighthouse still serves quorums for the same replica (nothing broke).
        with LighthouseClient(theirs.address(), connect_timeout=10.0) as client:
            q = client.quorum("live-0", timeout=QUORUM_TIMEOUT)
            assert [m.replica_id for m in q.members] == ["live-0"]
    finally:
        t0 = time.monotonic()
        stream.close(timeout=5.0)
        assert time.monotonic() - t0 < 5.0
    assert not stream._thread.is_alive()


# -------------------------------------------------------------- 4. raw wire
def test_raw_wire_every_member_field_round_trips_through_torchft(
    torchft_lighthouse: Callable[..., TorchftLighthouseServer],
) -> None:
    theirs = torchft_lighthouse(min_replicas=1, join_timeout_ms=100)
    requester = pb.QuorumMember(
        replica_id="wire-ü",
        address="http://wire.example:29512",
        store_address="wire.example:29500",
        step=123_456_789_012,
        world_size=2**40 + 3,
        shrink_only=True,
        data=json.dumps({"k": [1, 2.5, "v"], "o": {"p": None}}),
        commit_failures=7,
    )
    request = pb.LighthouseQuorumRequest(requester=requester)
    # Every field torchft 0.2 knows is non-default, so every field number appears on the wire
    # (torchft 0.3's reconfigure_handles, field 9, is tested with torchft-nightly's lighthouse
    # in test_interop_nightly.py; torchft 0.2.0's drops it).
    assert len(requester.ListFields()) == len(pb.QuorumMember.DESCRIPTOR.fields) - len(TORCHFT_03_FIELDS)
    target = theirs.address().removeprefix("http://")
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        call = channel.unary_unary(
            "/torchft.LighthouseService/Quorum",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        raw = call(request.SerializeToString(), timeout=10)
        heartbeat = channel.unary_unary(
            "/torchft.LighthouseService/Heartbeat",
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )
        assert heartbeat(pb.LighthouseHeartbeatRequest(replica_id="wire-ü"), timeout=10) == pb.LighthouseHeartbeatResponse()
    resp = pb.LighthouseQuorumResponse.FromString(raw)
    assert resp.HasField("quorum")
    assert resp.quorum.quorum_id >= 1
    assert resp.quorum.HasField("created") and abs(resp.quorum.created.seconds - time.time()) < 60
    assert list(resp.quorum.participants) == [requester]
    echoed = resp.quorum.participants[0]
    for field in pb.QuorumMember.DESCRIPTOR.fields:
        assert getattr(echoed, field.name) == getattr(requester, field.name), field.name
    # Nothing unknown came back (a field number we do not declare would land here).
    for msg in (resp, resp.quorum, echoed, resp.quorum.created):
        assert len(UnknownFieldSet(msg)) == 0, type(msg).__name__
