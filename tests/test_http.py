"""Tests of the lighthouse's HTTP face (rallypoint.lighthouse.http) and its metrics.

Routes are exercised in-process through httpx's ASGI transport (no socket, no
threads); HttpService is exercised for real: uvicorn on an asyncio loop, a real
socket, an httpx client. Every network call has a timeout.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest

from conftest import listening_ports

from rallypoint.lighthouse.http import AUTH_HELP, DEFAULT_KILL_REASON, HttpService, _parse_bind, create_app
from rallypoint.lighthouse.metrics import LighthouseMetrics

T = TypeVar("T")
TIMEOUT = httpx.Timeout(5.0)
TOKEN = "s3cret-token"

STATUS: dict[str, Any] = {
    "quorum_id": 7,
    "quorum": {
        "quorum_id": 7,
        "created": 1700000000.5,
        "members": [
            {
                "replica_id": "job/a:1",
                "address": "http://hosta:29512",
                "store_address": "hosta:29500",
                "step": 42,
                "world_size": 2,
                "shrink_only": False,
                "commit_failures": 0,
                "data": "",
            }
        ],
    },
    "replicas": [
        {
            "replica_id": "job/a:1",
            "heartbeat_age_s": 0.25,
            "participating": True,
            "attached": True,
            "step": 42,
            "address": "http://hosta:29512",
        },
        {
            "replica_id": "b",
            "heartbeat_age_s": None,
            "participating": False,
            "attached": False,
            "step": None,
            "address": "",
        },
    ],
    "last_decision": {"rule": "fast_path", "reason": "all previous members asked", "time": 1700000000.5},
    "options": {"min_replicas": 1, "join_timeout_ms": 60000, "heartbeat_timeout_ms": 5000},
    "lighthouse": {"version": "0.1.0", "started": 1699999999.0, "state_path": "/tmp/x.db"},
}


class FakeView:
    """A LighthouseView that records calls and answers from canned data."""

    def __init__(self) -> None:
        self.metrics_obj = LighthouseMetrics()
        self.event_calls: list[tuple[int, int | None, str | None]] = []
        self.kills: list[tuple[str, str]] = []
        self.managers = {"job/a:1": "http://hosta:29512", "b": "http://hostb:29512"}
        self.unreachable: set[str] = {"b"}

    def status(self) -> dict[str, Any]:
        return STATUS

    def events(self, limit: int, since_id: int | None, replica_id: str | None) -> list[dict[str, Any]]:
        self.event_calls.append((limit, since_id, replica_id))
        return [{"id": 1, "time": 1.0, "kind": "joined", "replica_id": "b", "message": "hello"}]

    def metrics(self) -> bytes:
        return self.metrics_obj.render()

    async def kill(self, replica_id: str, reason: str) -> str:
        self.kills.append((replica_id, reason))
        if replica_id not in self.managers:
            raise KeyError(replica_id)
        if replica_id in self.unreachable:
            raise ConnectionError("connection refused by hostb:29512")
        return self.managers[replica_id]


def run(coro_fn: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    """Run one async test body on a fresh loop with an overall timeout."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout)

    return asyncio.run(bounded())


def request(view: FakeView, method: str, url: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
    """One request to create_app(view, token) through the in-process ASGI transport."""
    app = create_app(view, token=token)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lighthouse", timeout=TIMEOUT) as client:
            return await client.request(method, url, **kwargs)

    return run(go)


# ------------------------------------------------------------------ read-only routes


def test_status_passthrough() -> None:
    r = request(FakeView(), "GET", "/status")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == STATUS


def test_metrics_content_type_and_names() -> None:
    view = FakeView()
    m = view.metrics_obj
    m.set_quorum(3, 2)
    m.observe_quorum_latency(0.012)
    m.heartbeat()
    m.quorum_request()
    m.decision("fast_path")
    m.set_replicas(healthy=3, participating=2, attached=1)
    m.replica_down("stream_broken")
    m.rejected("unauthenticated")
    r = request(view, "GET", "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    for line in (
        "rallypoint_lighthouse_quorum_id 3.0",
        "rallypoint_lighthouse_quorum_members 2.0",
        "rallypoint_lighthouse_quorum_latency_seconds_count 1.0",
        'rallypoint_lighthouse_quorum_latency_seconds_bucket{le="0.0005"} 0.0',
        'rallypoint_lighthouse_quorum_latency_seconds_bucket{le="60.0"} 1.0',
        "rallypoint_lighthouse_heartbeats_total 1.0",
        "rallypoint_lighthouse_quorum_requests_total 1.0",
        'rallypoint_lighthouse_decisions_total{rule="fast_path"} 1.0',
        'rallypoint_lighthouse_replicas{state="healthy"} 3.0',
        'rallypoint_lighthouse_replicas{state="participating"} 2.0',
        'rallypoint_lighthouse_replicas{state="attached"} 1.0',
        'rallypoint_lighthouse_replica_down_total{reason="stream_broken"} 1.0',
        'rallypoint_lighthouse_replica_down_total{reason="heartbeat_expired"} 0.0',
        'rallypoint_lighthouse_rejected_requests_total{reason="unauthenticated"} 1.0',
        'rallypoint_lighthouse_rejected_requests_total{reason="invalid_argument"} 0.0',
    ):
        assert line in text.splitlines(), line


def test_metrics_registries_are_independent() -> None:
    a, b = LighthouseMetrics(), LighthouseMetrics()  # a second one must not collide
    a.heartbeat()
    assert b"rallypoint_lighthouse_heartbeats_total 1.0" in a.render()
    assert b"rallypoint_lighthouse_heartbeats_total 0.0" in b.render()


def test_events_query_params() -> None:
    view = FakeView()
    r = request(view, "GET", "/events")
    assert r.status_code == 200
    assert r.json() == [{"id": 1, "time": 1.0, "kind": "joined", "replica_id": "b", "message": "hello"}]
    request(view, "GET", "/events", params={"limit": 5, "since_id": 10, "replica_id": "job/a:1"})
    request(view, "GET", "/events?since_id=&replica_id=")  # empty values mean "no filter"
    assert view.event_calls == [(100, None, None), (5, 10, "job/a:1"), (100, None, None)]


@pytest.mark.parametrize("query", ["limit=0", "limit=1001", "limit=x", "since_id=abc"])
def test_events_bad_params(query: str) -> None:
    view = FakeView()
    r = request(view, "GET", f"/events?{query}")
    assert r.status_code == 422
    assert view.event_calls == []


def test_events_limit_bounds_accepted() -> None:
    view = FakeView()
    assert request(view, "GET", "/events?limit=1").status_code == 200
    assert request(view, "GET", "/events?limit=1000").status_code == 200
    assert [c[0] for c in view.event_calls] == [1, 1000]


def test_dashboard_is_self_contained() -> None:
    r = request(FakeView(), "GET", "/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?//""", html), "protocol-relative external reference"
    assert 'fetch(path' in html and 'getJSON("/status")' in html
    assert "/events?" in html
    assert "/replica/" in html and "/kill" in html
    assert "sessionStorage" in html and '"Bearer "' in html


def test_no_cdn_docs() -> None:
    # FastAPI's /docs pulls swagger-ui from a CDN; the lighthouse serves none of that.
    assert request(FakeView(), "GET", "/docs").status_code == 404


# ------------------------------------------------------------------ kill and auth


def test_kill_ok_with_default_and_given_reason() -> None:
    view = FakeView()
    r = request(view, "POST", "/replica/job/a:1/kill")
    assert r.status_code == 200
    assert r.json() == {"replica_id": "job/a:1", "address": "http://hosta:29512", "reason": DEFAULT_KILL_REASON}
    r = request(view, "POST", "/replica/job%2Fa%3A1/kill", json={"reason": "bad GPU"})
    assert r.status_code == 200
    assert r.json()["reason"] == "bad GPU"
    assert view.kills == [("job/a:1", DEFAULT_KILL_REASON), ("job/a:1", "bad GPU")]


def test_kill_unknown_replica_404() -> None:
    r = request(FakeView(), "POST", "/replica/ghost/kill")
    assert r.status_code == 404
    assert "ghost" in r.json()["detail"]


def test_kill_unreachable_manager_502() -> None:
    r = request(FakeView(), "POST", "/replica/b/kill")
    assert r.status_code == 502
    detail = r.json()["detail"]
    assert "'b'" in detail and "connection refused by hostb:29512" in detail


@pytest.mark.parametrize("body", [b"garbage", b"[1]", b'{"reason": 5}'])
def test_kill_bad_body_422(body: bytes) -> None:
    view = FakeView()
    r = request(view, "POST", "/replica/job/a:1/kill", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert view.kills == []


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
def test_kill_needs_token(headers: dict[str, str]) -> None:
    view = FakeView()
    r = request(view, "POST", "/replica/job/a:1/kill", token=TOKEN, headers=headers, content=b"garbage")
    assert r.status_code == 401  # before the body is even looked at
    assert r.json()["detail"] == AUTH_HELP
    assert "Authorization: Bearer" in AUTH_HELP
    assert r.headers["www-authenticate"] == "Bearer"
    assert view.kills == []


def test_kill_with_right_token() -> None:
    view = FakeView()
    r = request(view, "POST", "/replica/job/a:1/kill", token=TOKEN, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    r = request(view, "POST", "/replica/job/a:1/kill", token=TOKEN, headers={"authorization": f"bearer  {TOKEN} "})
    assert r.status_code == 200
    assert len(view.kills) == 2


def test_reading_routes_need_the_token_when_one_is_set() -> None:
    """The status lists every manager and store address: with a token, only the
    dashboard shell and /healthz are open."""
    view = FakeView()
    for path in ("/", "/healthz"):
        assert request(view, "GET", path, token=TOKEN).status_code == 200, path
    for path in ("/status", "/metrics", "/events", "/events?since_id=-"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = request(view, "GET", path, token=TOKEN, headers=headers)
            assert r.status_code == 401, (path, headers, r.status_code)
            assert TOKEN not in r.text
        r = request(view, "GET", path, token=TOKEN, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == (422 if "since_id=-" in path else 200), (path, r.status_code, r.text)
    for path in ("/", "/healthz", "/status", "/metrics", "/events"):  # no token configured: all open
        assert request(view, "GET", path).status_code == 200, path


# ------------------------------------------------------------------ bind parsing


@pytest.mark.parametrize(
    "bind,expected",
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::]:29511", ("::", 29511)),
        ("[::1]:0", ("::1", 0)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("http://localhost:8080", ("localhost", 8080)),
        ("http://[::1]:8080/", ("::1", 8080)),
        ("*:80", ("", 80)),
    ],
)
def test_parse_bind(bind: str, expected: tuple[str, int]) -> None:
    assert _parse_bind(bind) == expected


@pytest.mark.parametrize("bind", ["localhost", "::1:80", "[::1]80", "host:http", "host:70000", "https://h:1"])
def test_parse_bind_rejects(bind: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bind))):
        _parse_bind(bind)


# ------------------------------------------------------------------ real server


async def _serve_and_get(bind: str) -> tuple[str, httpx.Response, httpx.Response]:
    view = FakeView()
    service = HttpService(create_app(view, token=TOKEN), bind)
    await service.start()
    try:
        assert service.port > 0
        address = service.address()
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            status = await client.get(f"{address}/status", headers={"Authorization": f"Bearer {TOKEN}"})
            killed = await client.post(
                f"{address}/replica/job%2Fa%3A1/kill",  # encoded like the dashboard sends it
                headers={"Authorization": f"Bearer {TOKEN}"},
                json={"reason": "test"},
            )
    finally:
        await service.stop(timeout=5.0)
    return address, status, killed


def test_http_service_real_ipv4() -> None:
    address, status, killed = run(lambda: _serve_and_get("127.0.0.1:0"))
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", address)
    assert status.status_code == 200 and status.json() == STATUS
    assert killed.status_code == 200 and killed.json()["reason"] == "test"
    # Nothing listens on the port after stop() (read from /proc: binding it again to
    # check would race with anything else on the machine taking it).
    port = int(address.rsplit(":", 1)[1])
    if os.path.isdir("/proc/self/fd"):
        assert port not in listening_ports()


def _ipv6_loopback_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback_works(), reason="no IPv6 loopback on this machine")
def test_http_service_real_ipv6() -> None:
    address, status, _ = run(lambda: _serve_and_get("[::1]:0"))
    assert re.fullmatch(r"http://\[::1\]:\d+", address)
    assert status.status_code == 200 and status.json()["quorum_id"] == 7


@pytest.mark.parametrize(
    "bind",
    [
        "0.0.0.0:0",
        pytest.param(
            "[::]:0",
            marks=pytest.mark.skipif(not _ipv6_loopback_works(), reason="no IPv6 on this machine"),
        ),
    ],
)
def test_http_service_wildcard_address_is_local(bind: str) -> None:
    # "[::]" is dual-stack, so the IPv4 loopback reaches it too.
    address, status, killed = run(lambda: _serve_and_get(bind))
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", address)
    assert status.status_code == 200
    assert killed.json()["replica_id"] == "job/a:1"


def test_http_service_bind_conflict_names_address() -> None:
    async def go() -> None:
        first = HttpService(create_app(FakeView()), "127.0.0.1:0")
        await first.start()
        try:
            bind = f"127.0.0.1:{first.port}"
            second = HttpService(create_app(FakeView()), bind)
            with pytest.raises(OSError, match=re.escape(repr(bind))):
                await second.start()
            await second.stop()  # never started: a no-op
        finally:
            await first.stop()
            await first.stop()  # idempotent

    run(go)


def test_http_service_does_not_touch_signals() -> None:
    import signal

    async def go() -> None:
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        service = HttpService(create_app(FakeView()), "127.0.0.1:0")
        await service.start()
        try:
            assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        finally:
            await service.stop()
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before

    run(go)


def test_http_service_stop_is_bounded_with_open_request() -> None:
    class SlowView(FakeView):
        def __init__(self) -> None:
            super().__init__()
            self.entered = asyncio.Event()

        async def kill(self, replica_id: str, reason: str) -> str:
            self.entered.set()
            await asyncio.sleep(60)
            return "never"

    async def go() -> float:
        view = SlowView()
        service = HttpService(create_app(view), "127.0.0.1:0")
        await service.start()
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            pending = asyncio.ensure_future(client.post(f"{service.address()}/replica/b/kill"))
            await asyncio.wait_for(view.entered.wait(), 5.0)  # the request is in the handler
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await service.stop(timeout=1.0)
            elapsed = loop.time() - t0
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        return elapsed

    assert run(go) < 2.5


def test_silent_and_half_request_clients_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that connects and sends nothing, or half a request head, is closed after
    the head timeout (uvicorn alone would hold it forever); a real request still works."""
    import socket
    import time

    import rallypoint.lighthouse.http as lh_http
    from rallypoint.lighthouse.server import LighthouseServer

    monkeypatch.setattr(lh_http, "HEAD_TIMEOUT_S", 0.5)
    lh = LighthouseServer(bind="127.0.0.1:0", http_bind="127.0.0.1:0")
    try:
        port = int(lh.http_address().rsplit(":", 1)[1])  # type: ignore[union-attr]
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert silent.recv(1) == b"" and half.recv(1) == b""
        assert time.monotonic() - t0 < 3.0
        silent.close()
        half.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as ok:
            ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert ok.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        lh.shutdown()


def test_idle_connections_give_way_to_a_request_and_proven_ones_keep_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every connection slot held by sockets that sent nothing, a client with a real
    request is still answered (the oldest idle one is closed for it); with every slot held
    by connections that sent requests, a newcomer is closed and they are still served."""
    import socket

    from http_wire import closed_by_server as closed, read_response as answer

    import rallypoint.lighthouse.http as lh_http
    from rallypoint.lighthouse.server import LighthouseServer

    monkeypatch.setattr(lh_http, "MAX_CONNECTIONS", 4)
    lh = LighthouseServer(bind="127.0.0.1:0", http_bind="127.0.0.1:0")
    ask = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"

    try:
        port = int(lh.http_address().rsplit(":", 1)[1])  # type: ignore[union-attr]
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as ok:
            ok.sendall(ask)
            assert answer(ok).startswith(b"HTTP/1.1 200")
        assert closed(idle[0]), "the oldest idle connection gave its slot to the request"
        for s in idle:
            s.close()
        proven = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        for s in proven:
            s.sendall(ask)
            assert answer(s).startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert closed(extra), "every slot holds a client that sent a request: the newcomer is closed"
        for s in proven:
            s.sendall(ask)
            assert answer(s).startswith(b"HTTP/1.1 200")
            s.close()
    finally:
        lh.shutdown()
