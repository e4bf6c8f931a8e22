"""Lighthouse high availability on the client side: ``LighthouseClient`` and
``LivenessStream`` given a comma-separated list of lighthouses follow the one that
serves (the leader) and fail over on their own when it goes.

A standby is simulated by a tiny gRPC server that answers every lighthouse call with
UNAVAILABLE "standby lighthouse: ..." (what a real standby answers); leaders are real
in-process ``LighthouseServer``s. Dead addresses are ports held bound but not listening
(``reserved_port``), so connections are refused and nothing else can take them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import pytest

from conftest import replica_row, reserved_port, wait_until
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream, split_addresses
from rallypoint.lighthouse.server import LighthouseServer

STANDBY_DETAIL = "standby lighthouse: not the leader"


class Standby:
    """A gRPC server refusing Quorum, Heartbeat and Attach as a standby lighthouse does;
    ``hits`` counts the calls it refused (by method name)."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("torchft.LighthouseService", {
                "Quorum": grpc.unary_unary_rpc_method_handler(self._unary("Quorum")),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(self._unary("Heartbeat")),
            }),
            grpc.method_handlers_generic_handler("rallypoint.RallypointLighthouse", {
                "Attach": grpc.stream_stream_rpc_method_handler(self._attach),
            }),
        ))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"http://127.0.0.1:{port}"

    def _refuse(self, method: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.hits[method] = self.hits.get(method, 0) + 1
        context.abort(grpc.StatusCode.UNAVAILABLE, STANDBY_DETAIL)

    def _unary(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handle(_request: bytes, context: grpc.ServicerContext) -> bytes:
            self._refuse(method, context)
            raise AssertionError("unreachable: abort raises")

        return handle

    def _attach(self, _requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._refuse("Attach", context)
        yield b""  # pragma: no cover - abort raises first

    def count(self, method: str) -> int:
        with self._lock:
            return self.hits.get(method, 0)

    def stop(self) -> None:
        self.server.stop(0).wait(5)


@contextlib.contextmanager
def standbys(n: int = 1) -> Iterator[list[Standby]]:
    made: list[Standby] = []
    try:
        for _ in range(n):
            made.append(Standby())
        yield made
    finally:
        for s in made:
            s.stop()


def attached(lh: LighthouseServer, rid: str) -> bool:
    return bool((replica_row(lh.status(), rid) or {}).get("attached"))


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("http://a:1", ["http://a:1"]),
        ("http://a:1,http://b:2,c:3", ["http://a:1", "http://b:2", "c:3"]),
        ("  http://a:1 ,  http://b:2  ", ["http://a:1", "http://b:2"]),
        (",http://a:1,,http://b:2,", ["http://a:1", "http://b:2"]),
    ],
)
def test_split_addresses(raw: str, expected: list[str]) -> None:
    assert split_addresses(raw) == expected


@pytest.mark.parametrize("raw", ["", " ", ",", " , ,"])
def test_split_addresses_refuses_no_address(raw: str) -> None:
    with pytest.raises(ValueError) as err:
        split_addresses(raw)
    assert repr(raw) in str(err.value)


def test_quorum_follows_the_leader_past_a_standby(lighthouse: Callable[..., LighthouseServer],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    lh = lighthouse(min_replicas=1)
    with standbys() as (sb,):
        c = LighthouseClient(f"{sb.address},{lh.local_address()}", connect_timeout=5.0)
        try:
            with caplog.at_level(logging.INFO, logger="rallypoint.lighthouse.client"):
                assert c.quorum("r0", 5.0).replica_ids == ("r0",)
                assert sb.count("Quorum") == 1
                # The next calls start at the lighthouse that answered: the standby is not asked again.
                c.heartbeat("r0")
                assert c.quorum("r0", 5.0).replica_ids == ("r0",)
            assert sb.count("Quorum") == 1 and sb.count("Heartbeat") == 0
            assert c.current_address == lh.local_address()
            following = [r.getMessage() for r in caplog.records if "following it" in r.getMessage()]
            assert following == [f"lighthouse at {lh.local_address()} answered; following it"]
        finally:
            c.close()


def test_quorum_fails_over_to_the_next_lighthouse_when_the_leader_dies(
        lighthouse: Callable[..., LighthouseServer], client: Callable[..., LighthouseClient]) -> None:
    first, second = lighthouse(min_replicas=1), lighthouse(min_replicas=1)
    c = client(f"{first.local_address()},{second.local_address()}")
    assert c.quorum("r0", 5.0).replica_ids == ("r0",)
    assert c.current_address == first.local_address()
    first.shutdown()
    t0 = time.monotonic()
    assert c.quorum("r0", 5.0).replica_ids == ("r0",)
    assert time.monotonic() - t0 < 5.0
    assert c.current_address == second.local_address()
    assert replica_row(second.status(), "r0") is not None


def test_all_standbys_fail_within_the_timeout_without_hammering() -> None:
    with standbys(2) as (a, b):
        c = LighthouseClient(f"{a.address},{b.address}", connect_timeout=5.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(ConnectionError) as err:
                c.quorum("r0", timeout=1.0)
            elapsed = time.monotonic() - t0
        finally:
            c.close()
    assert 0.8 <= elapsed < 1.0 + 2.0, elapsed
    msg = str(err.value)
    assert "UNAVAILABLE" in msg and STANDBY_DETAIL in msg and a.address in msg and b.address in msg, msg
    # Retried (both asked more than once), but paused between passes: not hundreds of calls.
    assert 2 <= a.count("Quorum") <= 20 and 2 <= b.count("Quorum") <= 20, a.hits | {"b": b.hits}


def test_a_single_dead_lighthouse_fails_at_once_as_before(lighthouse: Callable[..., LighthouseServer],
                                                         client: Callable[..., LighthouseClient]) -> None:
    """One address: no failover loop, so a dead lighthouse fails the call at once (the
    manager's outage backoff counts on it)."""
    lh = lighthouse(min_replicas=1)
    c = client(lh)
    c.heartbeat("r0")
    lh.shutdown()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        c.quorum("r0", 5.0)
    assert time.monotonic() - t0 < 2.0


def test_constructor_names_every_dead_address() -> None:
    with reserved_port() as p1, reserved_port() as p2:
        dead = [f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"]
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as err:
            LighthouseClient(",".join(dead), connect_timeout=1.0)
        elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 2.0, elapsed
    msg = str(err.value)
    assert all(a in msg for a in dead) and "rallypoint lighthouse" in msg, msg


def test_constructor_connects_when_any_address_is_up(lighthouse: Callable[..., LighthouseServer]) -> None:
    lh = lighthouse(min_replicas=1)
    with reserved_port() as port:
        c = LighthouseClient(f"http://127.0.0.1:{port},{lh.local_address()}", connect_timeout=5.0)
        try:
            assert c.quorum("r0", 5.0).replica_ids == ("r0",)
        finally:
            c.close()


def test_liveness_stream_follows_the_leader_and_reattaches_after_it_dies(
        lighthouse: Callable[..., LighthouseServer]) -> None:
    first, second = lighthouse(min_replicas=1), lighthouse(min_replicas=1)
    hellos: list[int] = []  # one entry per hello built: the held lease is read per stream

    def held_lease() -> int:
        hellos.append(1)
        return 0

    with standbys() as (sb,):
        addrs = f"{sb.address},{first.local_address()},{second.local_address()}"
        stream = LivenessStream(addrs, "r0", held_lease=held_lease, reconnect_backoff=(0.05, 0.2))
        try:
            assert stream.start(5.0)
            assert sb.count("Attach") == 1
            assert stream.current_address == first.local_address()
            wait_until(lambda: attached(first, "r0"), 5.0, what="r0 attached to the first leader")
            assert not attached(second, "r0")
            built = len(hellos)
            first.shutdown()
            wait_until(lambda: attached(second, "r0"), 10.0, what="r0 re-attached to the next lighthouse")
            wait_until(lambda: stream.connected, 5.0, what="the stream welcomed again")
            assert stream.current_address == second.local_address()
            assert len(hellos) > built  # the re-attach said hello afresh, with the lease held now
            # Straight to the next lighthouse: the standby before the dead leader is not asked again.
            assert sb.count("Attach") == 1
        finally:
            stream.close()
    wait_until(lambda: not attached(second, "r0"), 5.0, what="the goodbye to reach the lighthouse")


def test_liveness_stream_with_only_standbys_keeps_trying_with_backoff() -> None:
    """No leader yet: the stream passes over the standbys again and again, backing off
    between passes (not hammering them), and never reports itself connected."""
    with standbys(2) as (a, b):
        stream = LivenessStream(f"{a.address},{b.address}", "r0", reconnect_backoff=(0.05, 0.2))
        try:
            assert not stream.start(0.5)
            assert not stream.connected
            wait_until(lambda: a.count("Attach") >= 2 and b.count("Attach") >= 2, 5.0, what="a second pass")
            assert a.count("Attach") < 30, a.hits  # ~0.05 + 0.1 + 0.2 + 0.2 ... s between passes
        finally:
            stream.close()
