"""The checkpoint receiver's HTTP client (``rallypoint.transports._http_client``) against
small scripted servers on loopback (port 0): keep-alive, a source that closes an idle
connection, body limits with and without an announced length, deadlines."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rallypoint.transports._http_client import Connection, error_text, read_body

Script = Callable[[socket.socket, list[bytes]], None]


def _read_request(conn: socket.socket) -> bytes:
    """The next request head; b"" at the end (the client hung up, or the test is over and
    closed this socket under the thread)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        try:
            chunk = conn.recv(4096)
        except OSError:
            return b""
        if not chunk:
            return b""
        buf += chunk
    return buf


def _reply(body: bytes, close: bool = False) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n"
    return (head + ("connection: close\r\n" if close else "") + "\r\n").encode() + body


@pytest.fixture
def server() -> Iterator[Callable[[Script], tuple[str, list[bytes], list[int]]]]:
    """``start(script)``: a listening socket on port 0 whose every accepted connection is
    handled by ``script(conn, requests)`` on its own thread; returns the base URL, the
    requests received, and a one-item list counting accepted connections."""
    socks: list[socket.socket] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()

    def start(script: Script) -> tuple[str, list[bytes], list[int]]:
        ls = socket.create_server(("127.0.0.1", 0))
        ls.settimeout(0.05)  # closing a socket does not wake accept(): poll for the end
        socks.append(ls)
        requests: list[bytes] = []
        accepted = [0]

        def loop() -> None:
            while not stop.is_set():
                try:
                    c, _ = ls.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                accepted[0] += 1
                c.settimeout(10)
                socks.append(c)
                th = threading.Thread(target=script, args=(c, requests), daemon=True)
                th.start()
                threads.append(th)

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        threads.append(th)
        _, port = ls.getsockname()  # the held, listening socket's port-0 pick
        return f"http://127.0.0.1:{port}", requests, accepted

    yield start
    stop.set()
    for s in socks:
        s.close()
    for th in threads:
        th.join(10)


def test_keep_alive_one_connection_for_many_requests(server: Callable[[Script], tuple[str, list[bytes], list[int]]]) -> None:
    def script(c: socket.socket, requests: list[bytes]) -> None:
        while req := _read_request(c):
            requests.append(req)
            c.sendall(_reply(b"x" * 1000))
        c.close()

    base, requests, accepted = server(script)
    deadline = time.monotonic() + 10
    with Connection(base + "/", None, {"authorization": "Bearer t"}) as conn:
        for i in range(5):
            reply = conn.get("/checkpoint/1/data", deadline, {"start": i, "end": i + 1})
            assert reply.status == 200
            assert read_body(conn, reply, 4096, deadline, "body") == b"x" * 1000
    assert accepted[0] == 1 and len(requests) == 5
    assert requests[2].startswith(b"GET /checkpoint/1/data?start=2&end=3 HTTP/1.1\r\n")
    assert b"\r\nauthorization: Bearer t\r\n" in requests[0]


def test_a_source_that_closed_the_idle_connection_is_asked_again_once(
    server: Callable[[Script], tuple[str, list[bytes], list[int]]],
) -> None:
    """The first connection answers one request and then closes without a word (an idle
    timeout); the next request goes out again on a new connection."""
    def script(c: socket.socket, requests: list[bytes]) -> None:
        req = _read_request(c)
        if req:
            requests.append(req)
            c.sendall(_reply(b"one" if len(requests) == 1 else b"two"))
        c.close()  # no "connection: close": the client believes it may reuse it

    base, requests, accepted = server(script)
    deadline = time.monotonic() + 10
    conn = Connection(base, None, {})
    try:
        r = conn.get("/a", deadline)
        assert read_body(conn, r, 100, deadline, "a") == b"one"
        r = conn.get("/b", deadline)
        assert read_body(conn, r, 100, deadline, "b") == b"two"
    finally:
        conn.close()
    assert accepted[0] == 2 and [q.split(b" ")[1] for q in requests] == [b"/a", b"/b"]


def test_a_new_connection_that_is_dropped_is_an_error_not_a_loop(
    server: Callable[[Script], tuple[str, list[bytes], list[int]]],
) -> None:
    def script(c: socket.socket, requests: list[bytes]) -> None:
        if _read_request(c):
            requests.append(b"")
        c.close()

    base, requests, accepted = server(script)
    with Connection(base, None, {}) as conn, pytest.raises(OSError):
        conn.get("/a", time.monotonic() + 10)
    assert accepted[0] == 1


@pytest.mark.parametrize("announced", [True, False])
def test_a_body_over_the_limit_is_refused(server: Callable[[Script], tuple[str, list[bytes], list[int]]],
                                          announced: bool) -> None:
    """Announced: refused before a byte of it is read. Unannounced (the server closes at
    the end): refused as soon as it passes the limit, without reading the rest."""
    big = b"y" * (4 << 20)
    sent = threading.Event()

    def script(c: socket.socket, requests: list[bytes]) -> None:
        if _read_request(c):
            head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(big)}\r\n\r\n" if announced else \
                "HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n"
            try:
                c.sendall(head.encode() + big)
            except OSError:
                pass  # the client hung up: what a refusal looks like from here
            sent.set()
        c.close()

    base, _, _ = server(script)
    deadline = time.monotonic() + 10
    with Connection(base, None, {}) as conn:
        reply = conn.get("/h", deadline)
        with pytest.raises(ValueError, match="limit of 1024"):
            read_body(conn, reply, 1024, deadline, "the header")


def test_error_text_quotes_the_start_of_a_large_error_body(
    server: Callable[[Script], tuple[str, list[bytes], list[int]]],
) -> None:
    def script(c: socket.socket, requests: list[bytes]) -> None:
        if _read_request(c):
            body = b"no such step " + b"z" * (1 << 20)
            try:
                c.sendall(f"HTTP/1.1 404 Not Found\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            except OSError:
                pass
        c.close()

    base, _, _ = server(script)
    deadline = time.monotonic() + 10
    with Connection(base, None, {}) as conn:
        reply = conn.get("/h", deadline)
        assert reply.status == 404
        text = error_text(conn, reply, deadline)
    assert text.startswith("no such step z") and len(text) == 500


def test_a_silent_source_times_out_at_the_deadline(
    server: Callable[[Script], tuple[str, list[bytes], list[int]]],
) -> None:
    quiet = threading.Event()

    def script(c: socket.socket, requests: list[bytes]) -> None:
        _read_request(c)
        quiet.wait(10)  # says nothing until the test ends
        c.close()

    base, _, _ = server(script)
    t0 = time.monotonic()
    try:
        with Connection(base, None, {}) as conn, pytest.raises(TimeoutError):
            conn.get("/h", t0 + 0.5)
        assert 0.4 < time.monotonic() - t0 < 3
        with pytest.raises(TimeoutError, match="deadline"):
            Connection(base, None, {}).get("/h", time.monotonic() - 1)  # already past: not even a connect
    finally:
        quiet.set()


def test_bad_addresses_are_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        Connection("ftp://h:1", None, {})
    with pytest.raises(ValueError, match="TLS context"):
        Connection("https://h:1", None, {})


def _read_with(read: Callable[[memoryview], int], n: int, step: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = read(view[got : got + step])
        assert k, f"the body ended after {got} of {n} bytes"
        got += k
    return bytes(out)


def test_the_body_reader_reads_the_socket_itself_and_keeps_the_connection(
    server: Callable[[Script], tuple[str, list[bytes], list[int]]],
) -> None:
    """A body sent with its head in one write (so http.client buffers its first bytes) is
    read whole and in order, the reply ends complete, and the next request reuses the
    connection; a stopped read returns 0."""
    bodies = [bytes(range(256)) * 4000 + bytes([i]) for i in range(3)]  # ~1 MB each

    def script(c: socket.socket, requests: list[bytes]) -> None:
        while req := _read_request(c):
            requests.append(req)
            c.sendall(_reply(bodies[len(requests) - 1]))
        c.close()

    base, requests, accepted = server(script)
    deadline = time.monotonic() + 10
    with Connection(base, None, {}) as conn:
        for i, step in enumerate((1 << 20, 4096)):
            reply = conn.get("/d", deadline)
            read = conn.body_reader(reply, deadline, "body")
            assert _read_with(read, len(bodies[i]), step) == bodies[i]
            assert read(memoryview(bytearray(10))) == 0 and reply.isclosed()
            conn.release(reply)
        stop = threading.Event()
        reply = conn.get("/d", deadline)
        read = conn.body_reader(reply, deadline, "body", stop)
        assert read(memoryview(bytearray(100))) == 100
        stop.set()
        assert read(memoryview(bytearray(100))) == 0
    assert accepted[0] == 1 and len(requests) == 3


def test_the_body_reader_stops_at_the_deadline(server: Callable[[Script], tuple[str, list[bytes], list[int]]]) -> None:
    quiet = threading.Event()

    def script(c: socket.socket, requests: list[bytes]) -> None:
        _read_request(c)
        c.sendall(_reply(b"x" * 100)[:-50])  # half the body, then nothing
        quiet.wait(10)
        c.close()

    base, _, _ = server(script)
    try:
        t0 = time.monotonic()
        with Connection(base, None, {}) as conn:
            reply = conn.get("/d", t0 + 0.5)
            read = conn.body_reader(reply, t0 + 0.5, "body")
            buf = memoryview(bytearray(100))
            assert read(buf) == 50
            with pytest.raises(TimeoutError):
                read(buf[50:])
        assert time.monotonic() - t0 < 3
    finally:
        quiet.set()
