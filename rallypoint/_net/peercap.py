"""A per-peer connection cap for rallypoint's gRPC servers (the lighthouse, every ManagerServer).

Why: gRPC closes a connection that has not finished its handshake (``rpc.HANDSHAKE_TIMEOUT_MS``)
or carries no call for a while (``rpc.CONNECTION_IDLE_MS``), but nothing in gRPC bounds how
many connections one peer holds at once: a peer that keeps its sockets busy (a refused call
every few seconds) could hold descriptors until the server accepts nothing else. gRPC (1.85)
has no per-peer option, so the cap sits where gRPC hands us every accepted socket: its socket
mutator hook (``grpc.socket_mutator``), a C callback reached through ctypes. For each new
connection it looks at the peer's address and, once that address holds :data:`MAX_CONNS_PER_PEER`
live connections, makes room the way the HTTP servers do (``slots.evict_for_newcomer``): the
newcomer takes the slot of the peer's oldest connection that has not carried an admitted call
yet; when every one has, the newcomer is shut down (gRPC then closes it). Other addresses are
untouched. A connection is *proven* when a call on it gets past the token check
(:class:`ProvingInterceptor`, placed after the token interceptor). The mutator must always
answer "true": a false answer makes gRPC stop accepting on the whole port.

The count is per source address, so clients behind one NAT share it; the cap is
``RALLYPOINT_MAX_CONNS_PER_PEER`` (0 turns it off).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint._net.slots import evict_for_newcomer

logger = logging.getLogger("rallypoint.net")


def _env_int(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, "") or default))
    except ValueError:
        logger.warning("%s=%r is not an integer; using %d", name, os.environ.get(name), default)
        return default


#: Connections one source address may hold on one server at once (0: no cap).
MAX_CONNS_PER_PEER = _env_int("RALLYPOINT_MAX_CONNS_PER_PEER", 128)

_FD_SERVER_CONNECTION_USAGE = 2  # grpc_fd_usage: a connection the server accepted


def peer_host(sockaddr: Any) -> str:
    """The address part of a ``getpeername()`` result, an IPv4-mapped IPv6 address as its IPv4
    form (a dual-stack socket reports IPv4 peers that way; gRPC's ``context.peer()`` does not)."""
    host = str(sockaddr[0]) if isinstance(sockaddr, tuple) else str(sockaddr)
    return host[7:] if host.lower().startswith("::ffff:") and "." in host else host


def parse_grpc_peer(peer: str) -> tuple[str, int] | None:
    """``(host, port)`` of a gRPC ``context.peer()`` string (``ipv4:1.2.3.4:5``,
    ``ipv6:[::1]:5``, ``ipv6:%5B::1%5D:5``), in :func:`peer_host`'s form; None for anything
    else (a unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    host, _, port = rest.rpartition(":")
    if not port.isdigit() or not host:
        return None
    host = host.strip("[]").split("%", 1)[0]  # a link-local scope (fe80::1%eth0): getpeername() has none
    return peer_host((host,)), int(port)


@dataclass
class _Conn:
    fd: int
    ident: tuple[int, int]  # (st_dev, st_ino) of the socket, so a reused fd number is not it
    port: int
    accepted: float
    proven: bool = False


class _Info(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("usage", ctypes.c_int)]


_MUTATE = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_int, ctypes.c_void_p)
_COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_DESTROY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_MUTATE2 = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.POINTER(_Info), ctypes.c_void_p)


class _Vtable(ctypes.Structure):  # grpc_socket_mutator_vtable (grpc/impl/grpc_types.h)
    _fields_ = [("mutate_fd", _MUTATE), ("compare", _COMPARE), ("destroy", _DESTROY), ("mutate_fd_2", _MUTATE2)]


class _Mutator(ctypes.Structure):  # grpc_socket_mutator: vtable, refcount
    _fields_ = [("vtable", ctypes.POINTER(_Vtable)), ("refcount", ctypes.c_ssize_t)]


def _ident(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class PeerCap:
    """The per-peer cap of one gRPC server (see the module docstring). Pass :meth:`options`
    to ``grpc.aio.server`` and :meth:`interceptor` last in its interceptors; keep the object
    alive as long as the server (gRPC holds a raw pointer into it). ``on_refuse()`` is told of
    each connection closed for the cap (metrics); it runs on a gRPC thread."""

    def __init__(self, cap: int | None = None, name: str = "gRPC server",
                 on_refuse: Callable[[], None] | None = None) -> None:
        self.cap = MAX_CONNS_PER_PEER if cap is None else cap
        self.name = name
        self._on_refuse = on_refuse
        self._lock = threading.Lock()
        self._peers: dict[str, list[_Conn]] = {}
        self._since_sweep = 0
        self._throttle = Throttle(10.0)
        self.refused = 0  # connections closed for the cap (newcomers and evicted ones)
        self._callbacks = (_MUTATE(lambda _fd, _m: True), _COMPARE(self._compare), _DESTROY(lambda _m: None),
                           _MUTATE2(self._mutate))
        self._vtable = _Vtable(*self._callbacks)
        # gRPC refs and unrefs the mutator; a count that never reaches 0 keeps it from ever
        # calling destroy on memory Python owns.
        self._mutator = _Mutator(ctypes.pointer(self._vtable), 1 << 40)

    def __int__(self) -> int:
        """The C address of the mutator: how grpc's Python layer passes a pointer option."""
        return ctypes.addressof(self._mutator)

    @staticmethod
    def _compare(a: int | None, b: int | None) -> int:
        return 0 if a == b else (-1 if (a or 0) < (b or 0) else 1)

    def options(self) -> list[tuple[str, Any]]:
        """The server options that install the cap (none when it is off)."""
        return [("grpc.socket_mutator", self)] if self.cap > 0 else []

    def interceptor(self) -> "ProvingInterceptor":
        """The interceptor that marks a connection proven when a call on it is admitted."""
        return ProvingInterceptor(self)

    def held(self, host: str) -> int:
        """Live connections ``host`` holds now (tests, metrics)."""
        with self._lock:
            conns = self._peers.get(host, [])
            conns[:] = [c for c in conns if _ident(c.fd) == c.ident]
            return len(conns)

    # ------------------------------------------------------------------ gRPC's thread
    def _mutate(self, info: Any, _mutator: Any) -> bool:
        try:
            if info.contents.usage == _FD_SERVER_CONNECTION_USAGE:
                self._admit(info.contents.fd)
        except Exception:  # noqa: BLE001 - never let an error reach gRPC (false stops the listener)
            logger.exception("%s: the per-peer connection cap failed on a new connection", self.name)
        return True

    def _admit(self, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        try:
            host, port = peer_host(sock.getpeername()), int(sock.getpeername()[1])
        except OSError:
            return  # gone already
        finally:
            sock.detach()  # gRPC owns the descriptor
        ident = _ident(fd)
        if ident is None:
            return
        conn = _Conn(fd, ident, port, time.monotonic())
        shut: int | None = None
        with self._lock:
            self._sweep_now_and_then()
            conns = self._peers.setdefault(host, [])
            conns[:] = [c for c in conns if _ident(c.fd) == c.ident]
            if len(conns) >= self.cap:
                pick = evict_for_newcomer([(c.accepted, c.proven) for c in conns])
                if pick is None:
                    shut = fd
                else:
                    victim = conns.pop(pick)
                    if _ident(victim.fd) == victim.ident:
                        shut = victim.fd
                    conns.append(conn)
            else:
                conns.append(conn)
            if shut is not None:
                self.refused += 1
                with contextlib.suppress(OSError):
                    _shutdown(shut)  # the descriptor is gRPC's: it sees the end and closes it
        if shut is not None:
            if self._on_refuse is not None:
                self._on_refuse()
            left_out = self._throttle.ready()
            if left_out is not None:
                logger.warning("%s: %s holds %d connections (the per-peer cap, RALLYPOINT_MAX_CONNS_PER_PEER); %s%s",
                               self.name, host, self.cap,
                               "closing the newcomer: every one carries admitted calls" if shut == fd else
                               "closing its oldest that carried no admitted call for the newcomer",
                               left_out_note(left_out, "more"))

    def _sweep_now_and_then(self) -> None:
        """Forget closed connections of every peer once in a while (amortised), so peers that
        never come back do not accumulate."""
        self._since_sweep += 1
        if self._since_sweep < max(256, len(self._peers)):
            return
        self._since_sweep = 0
        for host in list(self._peers):
            live = [c for c in self._peers[host] if _ident(c.fd) == c.ident]
            if live:
                self._peers[host] = live
            else:
                del self._peers[host]

    # ------------------------------------------------------------------ the loop's thread
    def prove(self, peer: str) -> None:
        """Mark the connection of ``context.peer()`` proven (an admitted call arrived on it)."""
        parsed = parse_grpc_peer(peer)
        if parsed is None:
            return
        host, port = parsed
        with self._lock:
            for c in self._peers.get(host, ()):
                if c.port == port:
                    c.proven = True


def _shutdown(fd: int) -> None:
    """``shutdown(fd, SHUT_RDWR)`` on a descriptor Python does not own (it stays open)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.detach()


class ProvingInterceptor(grpc.aio.ServerInterceptor):
    """Marks a connection proven in its :class:`PeerCap` when a call on it reaches the
    handler (after the token interceptor: only admitted calls do)."""

    def __init__(self, cap: PeerCap) -> None:
        self._cap = cap

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or self._cap.cap <= 0:
            return handler
        cap = self._cap
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind, None)
            if behavior is not None:
                return handler._replace(**{kind: _proving(behavior, cap)})
        return handler


def _proving(behavior: Callable[..., Any], cap: PeerCap) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            cap.prove(context.peer())
            async for item in behavior(request, context):
                yield item
        return gen
    if not inspect.iscoroutinefunction(behavior):
        return behavior  # a plain function runs on gRPC's executor: left as it is

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        cap.prove(context.peer())
        return await behavior(request, context)
    return call


__all__ = ["MAX_CONNS_PER_PEER", "PeerCap", "ProvingInterceptor", "parse_grpc_peer", "peer_host"]
