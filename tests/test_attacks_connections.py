"""Issue 37, items 4 and 5: an attacker on loopback holding a real lighthouse's (and a real
ManagerServer's) connections.

4. HTTP: keep-alive sockets re-sending a request with a bad token used to hold every slot of
   the lighthouse's HTTP endpoint (any request proved a connection). Now a refused request
   closes its connection and is counted, and only a request with a valid credential proves
   one, so the operator's ``/status`` is still answered.
5. gRPC: a socket that sent the HTTP/2 preface and SETTINGS and then nothing stayed open, and
   nothing capped how many one peer held. Now such a socket is closed within the idle limit,
   and one source address holds at most its cap while another address is still served.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from http_wire import closed_by_server, read_response

from rallypoint._net import peercap, rpc
from rallypoint._net.peercap import parse_grpc_peer, peer_host
from rallypoint._net.slots import closes_connection, proves_connection

TOKEN = "tok-secret-37"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
ATTACKER = "127.0.0.2"  # another source address on loopback (Linux routes all of 127/8 to lo)


# ---------------------------------------------------------------------- pure rules

@pytest.mark.parametrize("status, closes", [(200, False), (204, False), (404, False), (500, False),
                                            (400, True), (401, True), (403, True), (413, True), (431, True)])
def test_refused_answers_close_their_connection(status: int, closes: bool) -> None:
    assert closes_connection(status) is closes


@pytest.mark.parametrize("credentialed, configured, proves", [
    (True, True, True),  # the operator's token
    (False, True, False),  # /healthz without a token on a secured lighthouse: evictable
    (False, False, True),  # no credential configured: any well-formed request
    (True, False, True),
])
def test_only_a_credential_proves_a_connection_where_one_is_configured(credentialed: bool, configured: bool,
                                                                      proves: bool) -> None:
    assert proves_connection(credentialed, configured) is proves


@pytest.mark.parametrize("peer, parsed", [
    ("ipv4:127.0.0.1:5000", ("127.0.0.1", 5000)),
    ("ipv6:[::1]:6000", ("::1", 6000)),
    ("ipv6:%5B::1%5D:6001", ("::1", 6001)),
    ("ipv6:[::ffff:10.0.0.7]:7", ("10.0.0.7", 7)),
    ("ipv6:[fe80::1%25eth0]:8", ("fe80::1", 8)),
    ("ipv6:[fe80::1%eth0]:9", ("fe80::1", 9)),
    ("unix:/tmp/x.sock", None),
    ("ipv4:127.0.0.1:x", None),
])
def test_grpc_peer_strings(peer: str, parsed: tuple[str, int] | None) -> None:
    assert parse_grpc_peer(peer) == parsed


def test_peer_host_folds_ipv4_mapped_addresses() -> None:
    assert peer_host(("::ffff:127.0.0.1", 1, 0, 0)) == "127.0.0.1"
    assert peer_host(("::1", 1, 0, 0)) == "::1"
    assert peer_host(("10.1.2.3", 1)) == "10.1.2.3"


# ---------------------------------------------------------------------- helpers

def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _connect(port: int, source: str = "127.0.0.1", timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _http(port: int, path: str, token: str | None, source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    """A keep-alive connection that asked ``path`` once; its response head."""
    s = _connect(port, source)
    _ask(s, path, token)
    return s, read_response(s)


def _ask(s: socket.socket, path: str, token: str | None) -> None:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())


def _body(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends on ``s`` until it closes it."""
    s.settimeout(timeout)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk


def _get(port: int, path: str, token: str | None) -> bytes:
    with _connect(port) as s:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n".encode())
        return _body(s)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1].rstrip("/"))


# ---------------------------------------------------------------------- item 4: HTTP slots

@pytest.fixture
def secured_lighthouse(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    import rallypoint.lighthouse.http as lh_http
    from rallypoint.lighthouse.server import LighthouseServer

    monkeypatch.setattr(lh_http, "MAX_CONNECTIONS", 8)
    lh = LighthouseServer(bind="127.0.0.1:0", http_bind="127.0.0.1:0", min_replicas=1, token=TOKEN)
    try:
        yield lh
    finally:
        lh.shutdown()


def test_bad_token_keepalive_sockets_cannot_hold_the_http_slots(secured_lighthouse: object) -> None:
    """Eight keep-alive sockets (the cap) re-sending /status with a wrong token: each is
    answered 401 and closed by the server, so they hold no slot; eight more that ask the open
    /healthz without a token stay open but give way; the operator's /status is answered and
    its connection keeps its slot through another wave; the refusals are counted."""
    lh = secured_lighthouse
    port = _port(lh.http_address())  # type: ignore[attr-defined]
    before = _fds()
    for _round in range(3):  # the attacker re-sends, reconnecting each time it is closed
        bad = [_http(port, "/status", "wrong-token", source=ATTACKER) for _ in range(8)]
        for s, head in bad:
            assert head.startswith(b"HTTP/1.1 401"), head
            assert closed_by_server(s, timeout=5.0), "a connection whose request was refused was kept open"
            s.close()
    # Slots filled by sockets that asked an open route without the token: not proven.
    squatters = [_http(port, "/healthz", None, source=ATTACKER) for _ in range(8)]
    assert all(head.startswith(b"HTTP/1.1 200") for _, head in squatters)
    operator, head = _http(port, "/status", TOKEN)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert closed_by_server(squatters[0][0], timeout=5.0), "the oldest unproven squatter gave its slot"
    # Another wave of bad requests, then the operator asks again on the same connection.
    for _ in range(8):
        s, head = _http(port, "/status", "wrong-token", source=ATTACKER)
        assert head.startswith(b"HTTP/1.1 401") and closed_by_server(s, timeout=5.0)
        s.close()
    _ask(operator, "/status", TOKEN)
    assert read_response(operator).startswith(b"HTTP/1.1 200"), "the operator's proven connection kept its slot"
    operator.close()
    for s, _ in squatters:
        s.close()
    metrics = _get(port, "/metrics", TOKEN)
    line = next(ln for ln in metrics.decode().splitlines()
                if ln.startswith("rallypoint_lighthouse_rejected_requests_total") and 'reason="http_refused"' in ln)
    assert float(line.rsplit(" ", 1)[1]) >= 32, line  # 3 x 8 + 8 refused requests
    deadline = time.monotonic() + 5
    while _fds() > before + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() <= before + 4, "descriptors stay flat"


def test_a_refused_request_closes_even_on_a_lighthouse_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no credential configured a well-formed request proves its connection (it keeps
    its slot), and a malformed one (a bad job name: 400) closes it."""
    import rallypoint.lighthouse.http as lh_http
    from rallypoint.lighthouse.server import LighthouseServer

    monkeypatch.setattr(lh_http, "MAX_CONNECTIONS", 2)
    lh = LighthouseServer(bind="127.0.0.1:0", http_bind="127.0.0.1:0", min_replicas=1)
    try:
        port = _port(lh.http_address())  # type: ignore[arg-type]
        bad, head = _http(port, "/status?job=%00bad", None)
        assert head.startswith(b"HTTP/1.1 400"), head
        assert closed_by_server(bad, timeout=5.0)
        bad.close()
        held = [_http(port, "/status", None) for _ in range(2)]
        extra = _connect(port)
        assert closed_by_server(extra, timeout=5.0), "both slots hold proven connections: the newcomer goes"
        extra.close()
        for s, _ in held:
            _ask(s, "/status", None)
            assert read_response(s).startswith(b"HTTP/1.1 200")
            s.close()
    finally:
        lh.shutdown()


# ---------------------------------------------------------------------- item 5: gRPC sockets

def _closed_within(s: socket.socket, seconds: float) -> float:
    """How long the server took to close ``s`` (reading and dropping what it sends)."""
    s.settimeout(seconds)
    t0 = time.monotonic()
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return float("inf")
    return time.monotonic() - t0


def _served(port: int, source: str) -> bool:
    """Whether the server answers a new connection from ``source`` with its SETTINGS."""
    with _connect(port, source) as s:
        s.sendall(PREFACE)
        s.settimeout(3.0)
        try:
            return len(s.recv(9)) > 0
        except (TimeoutError, ConnectionResetError):
            return False


@pytest.fixture
def grpc_servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, object]]]:
    """A secured lighthouse and a ManagerServer, with a 1.5 s idle limit and a cap of 4 per peer."""
    from rallypoint.lighthouse.server import LighthouseServer
    from rallypoint.manager.server import ManagerServer

    monkeypatch.setattr(rpc, "CONNECTION_IDLE_MS", 1500)
    monkeypatch.setattr(peercap, "MAX_CONNS_PER_PEER", 4)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, token=TOKEN)
    ms = ManagerServer(replica_id="r0", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                       store_addr="127.0.0.1:29500", world_size=1, connect_timeout=timedelta(seconds=10),
                       token=TOKEN)
    try:
        yield [("lighthouse", lh), ("manager", ms)]
    finally:
        ms.shutdown()
        lh.shutdown()


def test_a_socket_that_sends_the_preface_then_nothing_is_closed_within_the_idle_limit(
        grpc_servers: list[tuple[str, object]]) -> None:
    socks = []
    for _name, server in grpc_servers:
        s = _connect(_port(server.address()), ATTACKER)  # type: ignore[attr-defined]
        s.sendall(PREFACE)
        socks.append(s)
    for (name, _), s in zip(grpc_servers, socks):
        took = _closed_within(s, 8.0)
        s.close()
        assert took < 5.0, f"{name}: a connection with the preface and no call was held {took:.1f} s"


def _heartbeat(ch: object, token: str = TOKEN) -> None:
    """One admitted Heartbeat call on the raw channel ``ch``."""
    from rallypoint._proto import torchft_pb2 as pb

    call = ch.unary_unary("/torchft.LighthouseService/Heartbeat",  # type: ignore[attr-defined]
                          request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
                          response_deserializer=pb.LighthouseHeartbeatResponse.FromString)
    call(pb.LighthouseHeartbeatRequest(replica_id="probe"), metadata=[("authorization", f"Bearer {token}")], timeout=5)


def _own_channel(port: int) -> object:
    """A channel with its own connection (not shared with this process's other channels)."""
    import grpc

    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def test_a_client_whose_idle_connection_was_closed_calls_again(grpc_servers: list[tuple[str, object]]) -> None:
    """The idle limit costs a real client nothing: after its connection was closed for
    idleness (1.5 s here), its next call simply reconnects."""
    from rallypoint.manager.client import ManagerClient

    lh, ms = grpc_servers[0][1], grpc_servers[1][1]
    lh_cap, ms_cap = lh.peer_cap, ms.peer_cap  # type: ignore[attr-defined]
    streams = lh_cap.held("127.0.0.1")  # the manager's own connection (its liveness stream: never idle)
    ch = _own_channel(_port(lh.address()))  # type: ignore[attr-defined]
    mc = ManagerClient(ms.address(), connect_timeout=5, token=TOKEN)  # type: ignore[attr-defined]
    try:
        _heartbeat(ch)
        assert mc.should_commit(0, 1, True, timeout=timedelta(seconds=5)) is True
        assert lh_cap.held("127.0.0.1") == streams + 1 and ms_cap.held("127.0.0.1") == 1
        deadline = time.monotonic() + 8  # the servers close both connections after 1.5 s without a call
        while (lh_cap.held("127.0.0.1") > streams or ms_cap.held("127.0.0.1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lh_cap.held("127.0.0.1") == streams and ms_cap.held("127.0.0.1") == 0, "idle connections stayed"
        _heartbeat(ch)
        assert mc.should_commit(0, 2, True, timeout=timedelta(seconds=5)) is True
    finally:
        mc.close()
        ch.close()  # type: ignore[attr-defined]


def test_one_peer_past_its_cap_is_refused_while_another_is_served(grpc_servers: list[tuple[str, object]]) -> None:
    """From 127.0.0.2, 12 sockets (3x the cap) that send the preface: at most 4 stay open
    (the oldest give way to newcomers), descriptors stay flat, and 127.0.0.1 is still served:
    a real client with the token gets its call answered."""
    from rallypoint.lighthouse.client import LighthouseClient
    from rallypoint.manager.client import ManagerClient

    for name, server in grpc_servers:
        port = _port(server.address())  # type: ignore[attr-defined]
        cap = server.peer_cap  # type: ignore[attr-defined]
        before = _fds()
        held = []
        for _ in range(12):
            s = _connect(port, ATTACKER)
            s.sendall(PREFACE)
            held.append(s)
        deadline = time.monotonic() + 5  # gRPC accepts them one by one
        while cap.refused < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cap.refused == 8, f"{name}: {cap.refused} connections were closed for the cap"
        assert cap.held(ATTACKER) == 4, f"{name}: one peer holds {cap.held(ATTACKER)} connections"
        closed = sum(_closed_within(s, 0.5) < 0.5 for s in held[:8])
        assert closed == 8, f"{name}: the 8 oldest of the attacker's sockets were closed, {closed} were"
        # Another address is served meanwhile, by a raw socket and by a real client.
        assert _served(port, "127.0.0.1"), f"{name}: another peer was refused"
        if name == "lighthouse":
            client = LighthouseClient(server.address(), connect_timeout=5, token=TOKEN)  # type: ignore[attr-defined]
            try:
                q = client.quorum("r0", timeout=timedelta(seconds=10), store_address="127.0.0.1:1")
            finally:
                client.close()
            assert q.replica_ids == ("r0",)
        else:
            mc = ManagerClient(server.address(), connect_timeout=5, token=TOKEN)  # type: ignore[attr-defined]
            try:
                assert mc.should_commit(0, 1, True, timeout=timedelta(seconds=5)) is True
            finally:
                mc.close()
        # Server-side descriptors: at most the cap's worth for the attacker, on top of ours.
        ours = sum(1 for s in held if s.fileno() >= 0)
        assert _fds() - ours <= before + 4 + 6, f"{name}: descriptors grew"
        for s in held:
            s.close()


def test_a_peer_whose_connections_all_carry_admitted_calls_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """When every connection of a peer carries admitted calls (proven), a newcomer from it is
    closed at once, its proven connections still work, and another address is served."""
    from rallypoint.lighthouse.server import LighthouseServer

    monkeypatch.setattr(peercap, "MAX_CONNS_PER_PEER", 2)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, token=TOKEN)
    channels: list[object] = []
    try:
        port = _port(lh.address())
        for _ in range(2):  # two separate connections
            ch = _own_channel(port)
            channels.append(ch)
            _heartbeat(ch)
        assert lh.peer_cap.held("127.0.0.1") == 2  # type: ignore[union-attr]
        extra = _connect(port)
        extra.sendall(PREFACE)
        assert _closed_within(extra, 3.0) < 3.0, "a third connection from a peer at its cap was kept"
        extra.close()
        for ch in channels:
            _heartbeat(ch)  # the proven connections still serve
        assert _served(port, ATTACKER), "another peer address was refused"
        metrics = lh.jobs.default.metrics  # type: ignore[union-attr]
        assert "peer_cap" in metrics.render().decode()  # type: ignore[attr-defined]
    finally:
        for ch in channels:
            ch.close()  # type: ignore[attr-defined]
        lh.shutdown()
