"""The checkpoint server as an attacker or a broken client meets it: every wait is
bounded (a client that connects and sends nothing, or half a request, is dropped within
the header timeout), requests that are not the three GET routes get a clear 4xx, the
connection count is capped, and none of it disturbs a legal receiver."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch

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


def test_silent_and_slow_clients_are_dropped_and_connections_are_capped() -> None:
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
        # Hold the cap's worth of connections open: one more is closed at once, unanswered.
        held = [socket.create_connection(("127.0.0.1", t.port), timeout=5) for _ in range(Quick.MAX_CONNECTIONS)]
        deadline = time.monotonic() + 5
        while len(t._server._conns) < Quick.MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)  # the acceptor registers them; there is no event to await
        extra = socket.create_connection(("127.0.0.1", t.port), timeout=5)
        assert extra.recv(1) == b""
        for s in held + [extra]:
            s.close()
        # Once they are gone, a legal receiver is served.
        r = HTTPTransport(bind="127.0.0.1:0")
        try:
            assert torch.equal(r.recv_checkpoint(0, t.metadata(), 1, TEN)["w"], torch.arange(100.0))
        finally:
            r.shutdown()
    finally:
        t.shutdown()
