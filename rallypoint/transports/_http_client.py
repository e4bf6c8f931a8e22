"""The checkpoint receiver's HTTP/1.1 client: keep-alive connections on the standard
library's ``http.client``, one per receiving thread.

Why not httpx (what the receiver used before): a heal is usually the first and only
receive of a freshly started process, and there importing httpx and httpcore and building
the first client cost 0.1 s (idle machine) to 0.2 s (loaded) of a 1 GB heal's ~0.7-1 s.
``http.client`` is already imported with this package. The receiver needs little: a GET
with the job's bearer token, the status, the content length, and the body read straight
into the destination tensors. ``HTTPResponse.readinto`` does that: the socket's buffered
reader hands a large view to ``recv_into`` directly (over TLS, ``SSLSocket.recv_into``
decrypts into it), after the few bytes it buffered with the headers.

Each connection is kept alive across requests (a worker's next range, the next poll for
an unpublished header), so ranges over TLS share one handshake per connection. A reused
connection that the source closed while idle is opened again once (GET is idempotent).

Proxies are not used: the heal goes to the address the source advertises (``HTTP_PROXY``
and friends are ignored), so the job's bearer token never goes to a third host.

Every call takes the receive's deadline: connecting waits at most ``CONNECT_TIMEOUT_S``
(and never past the deadline), and every read at most until the deadline.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit

#: Errors of a request or a read: the connection is closed, the request may be retried.
NET_ERRORS = (OSError, http.client.HTTPException)
CONNECT_TIMEOUT_S = 10.0
#: A read's timeout is reset only when the deadline moved this much closer: over TLS a
#: read is one 16 KiB record, and each ``settimeout`` costs system calls. A read may
#: therefore overrun the deadline by this much.
TIMEOUT_SLACK_S = 0.25
#: The most bytes of an error reply's body quoted in the error (and read at all).
ERROR_BODY_BYTES = 4096


def time_left(deadline: float, what: str) -> float:
    """Seconds until ``deadline``; :class:`TimeoutError` naming ``what`` when none are left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what}: not complete by the deadline")
    return left


class Connection:
    """One keep-alive connection to one source (``base``: ``http(s)://host:port[/prefix]``),
    used by one thread at a time. ``context``: the TLS context for an ``https`` base."""

    def __init__(self, base: str, context: ssl.SSLContext | None, headers: dict[str, str]) -> None:
        u = urlsplit(base)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base[:200]!r}")
        if u.scheme == "https" and context is None:
            raise ValueError(f"{base[:200]!r} is https: a TLS context is needed")
        self.base = base
        self._host = u.hostname
        self._port = u.port or (443 if u.scheme == "https" else 80)
        self._prefix = u.path.rstrip("/")
        self._context = context if u.scheme == "https" else None
        self._headers = dict(headers)
        self._conn: http.client.HTTPConnection | None = None
        self._used = False  # a reply came over this connection already
        self._timeout = float("inf")  # the socket's current read timeout

    def get(self, path: str, deadline: float, params: dict[str, int | str] | None = None) -> http.client.HTTPResponse:
        """Send ``GET path?params`` and return the reply with its status and headers read.

        Raises one of :data:`NET_ERRORS` (``TimeoutError`` past the deadline); the
        connection is closed then. The caller reads the body (:meth:`set_deadline` before
        long reads) and must call :meth:`release` unless it read the body to its end.
        """
        url = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        for attempt in (0, 1):
            # A connection whose last reply said "close" has no socket any more: not reused.
            reused = self._used and self._conn is not None and self._conn.sock is not None
            try:
                conn = self._open(deadline)
                conn.request("GET", url, headers=self._headers)
                reply = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if reused and attempt == 0:
                    continue  # the source closed the idle connection: once more, afresh
                raise
            except BaseException:
                self.close()
                raise
            self._used = True
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def set_deadline(self, deadline: float, what: str) -> None:
        """Let the next reads wait at most until ``deadline`` (see TIMEOUT_SLACK_S)."""
        left = time_left(deadline, what)
        if self._conn is not None and self._conn.sock is not None and self._timeout - left > TIMEOUT_SLACK_S:
            self._conn.sock.settimeout(left)
            self._timeout = left

    def body_reader(self, reply: http.client.HTTPResponse, deadline: float, what: str,
                    stop: threading.Event | None = None) -> Callable[[memoryview], int]:
        """A ``readinto`` for the body of ``reply`` (at most its announced length; 0 at its
        end, or once ``stop`` is set), bounded by ``deadline``.

        Over a plain socket, once the few bytes ``http.client`` buffered past the headers are
        used up, it calls the socket's ``recv_into`` itself: a heal reads its gigabytes 256 KiB
        at a time, and the four Python layers of ``HTTPResponse.readinto`` cost about a
        quarter of the receiver's CPU beside the kernel's copy. The reply is marked complete
        at its end, as ``HTTPResponse`` does, so the connection is kept. Over TLS (the
        ``ssl`` socket decrypts into the buffer) and for a body without a length, it reads
        through ``reply``."""
        sock = self._conn.sock if self._conn is not None else None
        if type(sock) is not socket.socket or reply.length is None or reply.chunked:
            def through(mv: memoryview) -> int:
                if stop is not None and stop.is_set():
                    return 0
                self.set_deadline(deadline, what)  # TimeoutError once past it
                return reply.readinto(mv)

            return through
        fp = reply.fp
        assert fp is not None
        # The body bytes http.client's reader already holds (read with the headers; peek
        # reads the socket once only when it holds none), to be taken from it first.
        buffered = min(len(fp.peek(1)), reply.length) if reply.length else 0
        recv_into = sock.recv_into

        def direct(mv: memoryview) -> int:
            nonlocal buffered
            left = reply.length
            if not left or (stop is not None and stop.is_set()):
                return 0
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not complete by the deadline")
            if buffered:
                k = fp.readinto(mv[: min(mv.nbytes, buffered)])
                buffered -= k
            else:
                k = recv_into(mv, min(mv.nbytes, left))  # the socket's timeout ends at the deadline
            if not k:
                return 0
            reply.length = left = left - k
            if not left:
                reply.read()  # nothing left: marks the reply complete, so the connection is kept
            return k

        return direct

    def release(self, reply: http.client.HTTPResponse) -> None:
        """Done with ``reply``: the connection stays open only if its body was read whole."""
        if not reply.isclosed():
            self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._used = False

    def _open(self, deadline: float) -> http.client.HTTPConnection:
        left = time_left(deadline, f"GET {self.base}")
        if self._conn is None:
            if self._context is not None:
                self._conn = http.client.HTTPSConnection(self._host, self._port, context=self._context)
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port)
        if self._conn.sock is None:  # new, or closed after a reply that said "close"
            self._conn.timeout = min(left, CONNECT_TIMEOUT_S)
            self._conn.connect()  # the handshake, over TLS, within the connect timeout
            left = time_left(deadline, f"GET {self.base}")
        # Each request waits until its own deadline, which may be later than the last
        # one's (a striped source's header has a shorter one than its ranges).
        sock = self._conn.sock
        if isinstance(sock, socket.socket):
            sock.settimeout(left)
            self._timeout = left
        return self._conn

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_body(conn: Connection, reply: http.client.HTTPResponse, limit: int, deadline: float, what: str) -> bytes:
    """The whole body of ``reply``, refusing (``ValueError``) one over ``limit`` bytes before
    reading it where its length is announced, and as soon as it passes the limit where not."""
    if reply.length is not None and reply.length > limit:
        conn.close()
        raise ValueError(f"{what}: {reply.length} bytes announced, over the limit of {limit}")
    buf = bytearray()
    try:
        while reply.length is None or reply.length > 0:
            conn.set_deadline(deadline, what)
            chunk = reply.read1(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > limit:
                raise ValueError(f"{what}: over the limit of {limit} bytes")
        if reply.length == 0:
            reply.read()  # nothing left: marks the reply complete (read1 does not), so the connection is kept
    except BaseException:
        conn.close()
        raise
    conn.release(reply)
    return bytes(buf)


def error_text(conn: Connection, reply: http.client.HTTPResponse, deadline: float) -> str:
    """At most ERROR_BODY_BYTES of an error reply's body, as text (never the whole of a
    large one; on a failed read, what arrived)."""
    try:
        conn.set_deadline(deadline, "an error reply")
        body = reply.read(ERROR_BODY_BYTES)
    except NET_ERRORS:
        body = b""
    conn.release(reply)
    return body[:500].decode("utf-8", "replace").strip()


__all__ = ["CONNECT_TIMEOUT_S", "Connection", "NET_ERRORS", "error_text", "read_body", "time_left"]
