"""The serving side of :mod:`rallypoint.transports.http`: the step on offer and a small
threaded HTTP/1.1 server for the checkpoint routes.

Why not a web framework: the checkpoint server answers three GET routes, and importing
FastAPI and uvicorn cost a cold ``Manager()`` about 0.4 s before anything was served.
Here, one thread per connection writes the state's memoryviews with ``sendall`` (no copy
in Python; over TLS ``SSL_write`` releases the GIL, so several ranges are encrypted on
several cores at once, where one asyncio loop encrypted them all on one). Every wait is
bounded: the TLS handshake and a request's headers must arrive within
``header_timeout`` (a client that connects and sends nothing, or half a request, is
dropped), an idle keep-alive connection within ``idle_timeout``, each piece of a body
must leave within the step's timeout, and at most ``max_connections`` connections are
served at once.

Who gets a connection slot: with ``authorize`` set (the job's bearer token), a request it
refuses gets 401 and its connection is closed, and a connection counts as proven once a
request on it was authorized (without ``authorize``: once it sent a well-formed request).
When every slot is taken, a newcomer takes the slot of the oldest connection not yet
proven, and is refused only when every slot holds a proven one
(:mod:`rallypoint._net.slots` says why).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote

from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint._net.slots import evict_for_newcomer
from rallypoint.transports import wire
from rallypoint.transports._encode import Overtaken

logger = logging.getLogger("rallypoint.transports.http")

#: Longest request head (request line + headers) accepted.
MAX_HEAD_BYTES = 16 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 410: "Gone", 413: "Payload Too Large", 416: "Range Not Satisfiable",
            422: "Unprocessable Entity", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


@dataclass
class _Served:
    """One step on offer: the encoded state and the streams reading it."""

    step: int
    enc: wire.Encoded
    timeout: float
    withdrawn: bool = False  # disallow_checkpoint began: no new stream may start
    aborted: bool = False  # streams still running after the wait must stop
    active: int = 0
    expiry: threading.Timer | None = None  # withdraws a frozen live state after the timeout

    def release(self) -> None:
        """Withdrawn and no stream left: drop the state's memory now (a live state's
        frozen copies; a copy's whole copy)."""
        release = getattr(self.enc, "release", None)
        if callable(release):
            release()
    done: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class Request:
    """A parsed request: the method, the path split at '/', the query and the headers."""

    method: str
    parts: list[str]
    query: dict[str, list[str]]
    headers: dict[str, str]


@dataclass
class Reply:
    """An answer: a small text body, or ``pieces`` streamed from ``served`` (``length`` bytes)."""

    status: int
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    served: _Served | None = None
    pieces: Iterable[memoryview] | None = None
    length: int = 0
    content_type: str = "text/plain; charset=utf-8"


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> Request:
    """A request head (without the final blank line) as a :class:`Request`; raises
    :class:`BadRequest` for anything that is not a plain HTTP/1.x request without a body."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise BadRequest(400, "the request is not text") from None
    lines = text.split("\r\n")
    fields = lines[0].split(" ")
    if len(fields) != 3 or not fields[2].startswith("HTTP/1."):
        raise BadRequest(400, "malformed request line")
    method, target, _version = fields
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        headers[name.lower()] = value.strip()
    if headers.get("transfer-encoding") or headers.get("content-length", "0") not in ("", "0"):
        raise BadRequest(413, "the checkpoint server takes no request bodies")
    path, _, query = target.partition("?")
    if not path.startswith("/"):
        raise BadRequest(400, "the request target must be a path")
    parts = [unquote(p) for p in path.strip("/").split("/")]
    try:
        parsed = parse_qs(query, keep_blank_values=True, max_num_fields=16)
    except ValueError:
        raise BadRequest(400, "too many query parameters") from None
    return Request(method, parts, parsed, headers)


def int_param(query: dict[str, list[str]], name: str) -> int:
    """A required integer query parameter; :class:`BadRequest` 422 naming it otherwise."""
    values = query.get(name)
    if not values:
        raise BadRequest(422, f"query parameter {name!r} is required")
    return to_int(values[-1], f"query parameter {name!r}")


def to_int(raw: str, what: str) -> int:
    """``raw`` as an integer; :class:`BadRequest` 422 naming ``what`` otherwise."""
    if not raw.isascii() or not raw.lstrip("-").isdigit() or len(raw) > 20:
        raise BadRequest(422, f"{what} must be an integer, got {raw[:40]!r}")
    return int(raw)


@dataclass(eq=False)
class _Conn:
    """One accepted connection: its socket (the TLS one once wrapped), when it was
    accepted, and whether a request on it was authorized."""

    sock: socket.socket
    accepted: float
    proven: bool = False


#: The answer to a request the server's ``authorize`` refuses.
UNAUTHORIZED = "missing or wrong bearer token: send 'Authorization: Bearer <token>'"


class CheckpointServer:
    """Serves ``handle(request) -> Reply`` on a bound, listening socket, one thread per
    connection. ``ssl_context``: serve TLS. ``authorize(request)``: whether a request may
    be served (401 and the connection closed otherwise; see the module docstring for what
    it decides about connection slots). Stop with :meth:`stop`."""

    def __init__(self, sock: socket.socket, handle: Callable[[Request], Reply], *,
                 ssl_context: ssl.SSLContext | None = None, name: str = "checkpoint",
                 header_timeout: float = 10.0, idle_timeout: float = 30.0, max_connections: int = 64,
                 authorize: Callable[[Request], bool] | None = None) -> None:
        self._sock = sock
        self._handle = handle
        self._authorize = authorize
        self._ssl = ssl_context
        self._header_timeout = header_timeout
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._threads: set[threading.Thread] = set()
        self._refusals = Throttle(10.0)  # a flood of connections logs a line per interval
        self._sock.setblocking(True)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"rallypoint-accept-{name}", daemon=True)
        self._name = name
        self._acceptor.start()

    # ---------------------------------------------------------------- connections

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _addr = self._sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.01)  # EMFILE and the like: let a connection end first
                continue
            conn = _Conn(sock, time.monotonic())
            victim: _Conn | None = None
            with self._lock:
                full = self._stopping.is_set()
                if not full and len(self._conns) >= self._max_connections:
                    held = list(self._conns)
                    pick = evict_for_newcomer([(c.accepted, c.proven) for c in held])
                    full = pick is None
                    if pick is not None:
                        victim = held[pick]
                        self._conns.discard(victim)
                        # Under the lock: the socket the slot holds now (its TLS wrapping swaps
                        # it under the same lock). Its thread wakes up, finds it closed, ends.
                        with contextlib.suppress(OSError):
                            victim.sock.shutdown(socket.SHUT_RDWR)
                if not full:
                    self._conns.add(conn)
                open_now = len(self._conns)
            if (victim is not None or full) and not self._stopping.is_set():
                left_out = self._refusals.ready()
                if left_out is not None:
                    logger.warning("%s server: %d connections open; %s%s", self._name, open_now,
                                   "closing a newcomer: every slot holds a proven receiver" if full else
                                   "closing the oldest that sent no authorized request for a newcomer",
                                   left_out_note(left_out, "more"))
            if full:
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            t = threading.Thread(target=self._serve_connection, args=(conn,), name=f"rallypoint-conn-{self._name}",
                                 daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _serve_connection(self, slot: _Conn) -> None:
        conn: socket.socket = slot.sock
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                conn.settimeout(self._header_timeout)
                with self._lock:  # an eviction shuts down whichever socket the slot holds
                    conn = self._ssl.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                    slot.sock = conn
                conn.do_handshake()
            buf = bytearray()
            first = True
            while not self._stopping.is_set():
                head = self._read_head(conn, buf, self._header_timeout if first else self._idle_timeout)
                if head is None:
                    return
                first = False
                try:
                    request = parse_head(head)
                    if self._authorize is not None and not self._authorize(request):
                        self._send_text(conn, Reply(401, UNAUTHORIZED, {"www-authenticate": "Bearer"}), close=True)
                        return
                    slot.proven = True
                    reply = self._handle(request) if request.method in ("GET", "HEAD") else \
                        Reply(405, "only GET is served", {"allow": "GET"})
                except BadRequest as e:
                    self._send_text(conn, Reply(e.status, str(e)), close=True)
                    return
                if not self._send(conn, request, reply):
                    return
        except (OSError, ssl.SSLError, TimeoutError) as e:
            logger.debug("%s server: connection ended: %r", self._name, e)
        except Exception as e:  # noqa: BLE001 - a failing body (e.g. a piece that cannot be read): drop it
            logger.warning("%s server: dropped a connection: %r", self._name, e)
        finally:
            with self._lock:
                self._conns.discard(slot)
                self._threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                conn.close()

    def _read_head(self, conn: socket.socket, buf: bytearray, timeout: float) -> bytes | None:
        """The next request head, or None when the client closed cleanly between requests.
        The whole head must arrive within ``timeout`` (TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout
        while True:
            end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end >= 0:
                head = bytes(buf[:end])
                del buf[: end + 4]
                return head
            if len(buf) > MAX_HEAD_BYTES:
                self._send_text(conn, Reply(431, f"the request head is over {MAX_HEAD_BYTES} bytes"), close=True)
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete request head in time")
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk

    # ---------------------------------------------------------------- answers

    @staticmethod
    def _head_bytes(status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send_text(self, conn: socket.socket, reply: Reply, close: bool = False, head_only: bool = False) -> None:
        body = reply.text.encode("utf-8")
        headers = {"content-type": reply.content_type, "content-length": str(len(body)), **reply.headers}
        if close:
            headers["connection"] = "close"
        conn.settimeout(self._header_timeout)
        conn.sendall(self._head_bytes(reply.status, headers) + (b"" if head_only else body))

    def _send(self, conn: socket.socket, request: Request, reply: Reply) -> bool:
        """Send ``reply``; whether the connection may serve another request."""
        close = request.headers.get("connection", "").lower() == "close"
        head_only = request.method == "HEAD"
        if reply.served is None or reply.pieces is None:
            self._send_text(conn, reply, close=close, head_only=head_only)
            return not close
        served = reply.served
        with served.done:
            # The step may have been withdrawn between routing and now: after
            # disallow_checkpoint returned, no byte of the state dict may be read.
            started = not served.withdrawn
            if started:
                served.active += 1
        if not started:
            self._send_text(conn, Reply(404, f"the checkpoint of step {served.step} was withdrawn"), close=close)
            return not close
        try:
            pieces = iter(reply.pieces)
            first: memoryview | None = None
            if not head_only:
                try:  # before the 200: a body that cannot start gets its status, not a dropped stream
                    first = next(pieces, None)
                except Exception as e:
                    status = getattr(e, "http_status", None)
                    if not isinstance(status, int):
                        raise
                    self._send_text(conn, Reply(status, str(e)), close=close)
                    return not close
            headers = {"content-type": "application/octet-stream", "content-length": str(reply.length),
                       **reply.headers}
            conn.settimeout(served.timeout)
            conn.sendall(self._head_bytes(200, headers))
            if head_only:
                return not close
            try:
                for piece in itertools.chain([first] if first is not None else [], pieces):
                    if served.aborted:
                        # Dropping the connection: the client sees a short body.
                        logger.warning("checkpoint of step %d withdrawn mid-transfer; dropping the stream",
                                       served.step)
                        return False
                    # A receiver that stops reading must not pin this stream (and the state
                    # dict) forever: each piece has to leave within the transport's timeout.
                    conn.sendall(piece)
            except Overtaken as e:
                logger.info("%s; dropping the stream (the receiver fetches the range again)", e)
                return False
            return not close
        finally:
            with served.done:
                served.active -= 1
                idle = served.withdrawn and served.active == 0
                served.done.notify_all()
            if idle:
                served.release()

    # ---------------------------------------------------------------- stopping

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, close every connection, join the threads (up to ``timeout``)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns, threads = [c.sock for c in self._conns], list(self._threads)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
        for t in threads:
            with contextlib.suppress(RuntimeError):  # accepted just now: not started yet
                t.join(max(0.0, deadline - time.monotonic()))
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()

    def alive(self) -> bool:
        return self._acceptor.is_alive()


__all__ = ["UNAUTHORIZED", "BadRequest", "CheckpointServer", "Reply", "Request", "_Served", "int_param", "parse_head",
           "to_int"]
