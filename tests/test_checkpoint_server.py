"""The checkpoint server as an attacker or a broken client meets it: every wait is
bounded (a client that connects and sends nothing, or half a request, is dropped within
the header timeout), requests that are not the three GET routes get a clear 4xx, the
connection count is capped, connections without the token cannot hold the slots a
receiver needs, and none of it disturbs a legal receiver."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch

from http_wire import closed_by_server, read_response

from rallypoint._net.slots import evict_for_newcomer
from rallypoint.transports._http_serve import BadRequest, int_param, parse_head
from rallypoint.transports.http import HTTPTransport

TEN = timedelta(seconds=10)


class Quick(HTTPTransport):
    HEADER_TIMEOUT_S = 0.5
    MAX_CONNECTIONS = 8


@pytest.mark.parametrize("head, status", [
    (b"GET /checkpoint/1/header HTTP/1.1\r\nHost: x", None),
    (b"GET /x HTTP/2.0", 400),
    (b"GARBAGE", 400),
    (b"GET /x HTTP/1.1\r\nno colon here", 400),
    (b"GET /x HTTP/1.1\r\nContent-Length: 5", 413),
    (b"GET /x HTTP/1.1\r\nTransfer-Encoding: chunked", 413),
    (b"GET x HTTP/1.1", 400),
])
def test_parse_head(head: bytes, status: int | None) -> None:
    if status is None:
        r = parse_head(head)
        assert r.method == "GET" and r.parts == ["checkpoint", "1", "header"] and r.headers["host"] == "x"
    else:
        with pytest.raises(BadRequest) as e:
            parse_head(head)
        assert e.value.status == status


@pytest.mark.parametrize("query, ok", [({"a": ["12"]}, 12), ({"a": ["-1"]}, -1), ({"a": ["x"]}, None), ({}, None),
                                       ({"a": ["1" * 30]}, None), ({"a": ["١٢"]}, None)])
def test_int_param(query: dict, ok: int | None) -> None:
    if ok is None:
        with pytest.raises(BadRequest) as e:
            int_param(query, "a")
        assert e.value.status == 422 and "'a'" in str(e.value)
    else:
        assert int_param(query, "a") == ok


def _ask(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
            if b"\r\n\r\n" in out and b"connection: close" not in out.lower():
                return out


def test_bad_requests_get_clear_answers() -> None:
    t = HTTPTransport(bind="127.0.0.1:0", token="tok")
    try:
        auth = b"Authorization: Bearer tok\r\n"
        assert _ask(t.port, b"GET /checkpoint/1/header HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 401")
        assert _ask(t.port, b"POST /checkpoint/1/header HTTP/1.1\r\n" + auth + b"\r\n").startswith(b"HTTP/1.1 405")
        assert _ask(t.port, b"GET /checkpoint/x/header HTTP/1.1\r\n" + auth + b"\r\n").startswith(b"HTTP/1.1 422")
        assert _ask(t.port, b"GET /etc/passwd HTTP/1.1\r\n" + auth + b"\r\n").startswith(b"HTTP/1.1 404")
        assert _ask(t.port, b"GET / HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431")
        t.send_checkpoint([1], 3, {"w": torch.ones(10)}, TEN)
        bad_range = b"GET /checkpoint/3/data?start=0&end=999999 HTTP/1.1\r\n" + auth + b"\r\n"
        assert _ask(t.port, bad_range).startswith(b"HTTP/1.1 416")
        no_end = b"GET /checkpoint/3/data?start=0 HTTP/1.1\r\n" + auth + b"\r\n"
        assert _ask(t.port, no_end).startswith(b"HTTP/1.1 422")
        # After all that, a legal receiver gets the state.
        r = HTTPTransport(bind="127.0.0.1:0", token="tok")
        try:
            assert torch.equal(r.recv_checkpoint(0, t.metadata(), 3, TEN)["w"], torch.ones(10))
        finally:
            r.shutdown()
    finally:
        t.shutdown()


def test_silent_and_slow_clients_are_dropped() -> None:
    t = Quick(bind="127.0.0.1:0")
    try:
        t.send_checkpoint([1], 1, {"w": torch.arange(100.0)}, TEN)
        silent = socket.create_connection(("127.0.0.1", t.port), timeout=5)
        half = socket.create_connection(("127.0.0.1", t.port), timeout=5)
        half.sendall(b"GET /checkpoint/1/header HTTP/1.1\r\nHost: x\r\n")  # never finished
        t0 = time.monotonic()
        assert silent.recv(1) == b"" and half.recv(1) == b"", "both were closed by the server"
        assert time.monotonic() - t0 < 3.0
        silent.close()
        half.close()
    finally:
        t.shutdown()


@pytest.mark.parametrize("conns, victim", [
    ([], None),
    ([(1.0, True), (0.5, True)], None),  # every slot proven: the newcomer is refused
    ([(1.0, False)], 0),
    ([(3.0, False), (1.0, True), (2.0, False)], 2),  # the oldest unproven, not the oldest
    ([(0.1, True), (5.0, False), (4.0, False), (6.0, False)], 2),
])
def test_evict_for_newcomer(conns: list[tuple[float, bool]], victim: int | None) -> None:
    assert evict_for_newcomer(conns) == victim


def _held(t: HTTPTransport, n: int) -> list[socket.socket]:
    """``n`` idle connections to ``t``, once its server has registered all of them."""
    held = [socket.create_connection(("127.0.0.1", t.port), timeout=5) for _ in range(n)]
    deadline = time.monotonic() + 5
    while len(t._server._conns) < n and time.monotonic() < deadline:
        time.sleep(0.01)  # the acceptor registers them; there is no event to await
    assert len(t._server._conns) == n
    return held


def test_idle_and_refused_connections_cannot_lock_a_receiver_out() -> None:
    """An attacker without the token holds every connection slot (idle sockets, and one
    that asks with a wrong token): a receiver with the token still heals, and the slots it
    took were the attacker's oldest."""
    t = Quick(bind="127.0.0.1:0", token="tok")
    r = HTTPTransport(bind="127.0.0.1:0", token="tok", num_chunks=2)
    try:
        state = {"w": torch.arange(4096.0), "v": torch.ones(3, 5)}
        t.send_checkpoint([1], 1, state, TEN)
        wrong = socket.create_connection(("127.0.0.1", t.port), timeout=5)
        wrong.sendall(b"GET /checkpoint/1/header HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n")
        answer = read_response(wrong)
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
        assert closed_by_server(wrong), "a refused request's connection is closed"
        wrong.close()
        held = _held(t, Quick.MAX_CONNECTIONS)
        got = r.recv_checkpoint(0, t.metadata(), 1, TEN)
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["v"], state["v"])
        # The receiver's connections (header, ranges, done) replaced the oldest idle ones.
        assert closed_by_server(held[0])
        assert all(s.fileno() >= 0 for s in held)
        for s in held:
            s.close()
    finally:
        r.shutdown()
        t.shutdown()


def test_proven_connections_keep_their_slots() -> None:
    """Connections that sent an authorized request are never closed for a newcomer: with
    every slot proven, the newcomer is closed unanswered and the others go on."""
    t = Quick(bind="127.0.0.1:0", token="tok")
    try:
        t.send_checkpoint([1], 1, {"w": torch.arange(100.0)}, TEN)
        ask = b"GET /checkpoint/1/header HTTP/1.1\r\nAuthorization: Bearer tok\r\n\r\n"
        proven = _held(t, Quick.MAX_CONNECTIONS)
        for s in proven:
            s.sendall(ask)
            assert read_response(s).startswith(b"HTTP/1.1 200")
        extra = socket.create_connection(("127.0.0.1", t.port), timeout=5)
        assert closed_by_server(extra)
        extra.close()
        for s in proven:  # still served, on the same connections
            s.sendall(ask)
            assert read_response(s).startswith(b"HTTP/1.1 200")
            s.close()
    finally:
        t.shutdown()
