"""Binding the lighthouse's HTTP endpoint: ``host:port`` parsing (``*``, ``:port``, IPv6
brackets), dual-stack wildcard sockets, and bind errors that name the address and what to do.
(Split from ``http.py``, which re-exports ``_parse_bind``.)"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from typing import Any

from rallypoint._net import addr as addrs

logger = logging.getLogger("rallypoint.lighthouse.http")


def _parse_bind(bind: str) -> tuple[str, int]:
    """(host, port) of a bind address; ``*`` means every interface; a URL scheme is refused
    (TLS is the certificate's business, not the bind's)."""
    if bind.strip().lower().startswith("https://"):
        raise ValueError(f"bind {bind!r}: a bind address is host:port; the endpoint serves https when the "
                         "lighthouse has a TLS certificate (--tls-cert/--tls-key)")
    text = bind.strip()
    bare_port = text.startswith(":") and text[1:].isdigit()  # ":29511" = every interface
    host, port = addrs.split_host_port("*" + text if bare_port else text)
    return ("" if host == "*" else host), port


def _open_socket(family: int, sockaddr: tuple[Any, ...], dual_stack: bool) -> socket.socket:
    """A bound, listening, non-blocking TCP socket."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets created with it, and
    # without it every response waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if hasattr(socket, "SO_REUSEADDR") and not hasattr(socket, "SO_EXCLUSIVEADDRUSE"):
            # POSIX: rebind right after a restart despite TIME_WAIT. (Not on Windows,
            # where SO_REUSEADDR would let two processes share the port.)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Wildcard "[::]" serves IPv4 too; a specific v6 address only itself.
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        sock.bind(sockaddr)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_socket(bind: str, host: str, port: int) -> socket.socket:
    """Bind ``host:port``; raise OSError naming ``bind`` and what to do on failure."""
    candidates: list[tuple[int, tuple[Any, ...], bool]] = []
    if host in ("", "::"):
        # Every interface: dual-stack IPv6, or IPv4 only where the host has no IPv6.
        if socket.has_ipv6:
            candidates.append((socket.AF_INET6, ("::", port), True))
        candidates.append((socket.AF_INET, ("0.0.0.0", port), False))
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise OSError(
                errno.EADDRNOTAVAIL,
                f"cannot bind the lighthouse HTTP endpoint to {bind!r}: cannot resolve host "
                f"{host!r} ({exc.strerror}); use an IP address or a resolvable name",
            ) from exc
        seen: set[tuple[int, tuple[Any, ...]]] = set()
        for family, _type, _proto, _canon, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            addr = tuple(sockaddr)
            if (family, addr) not in seen:
                seen.add((family, addr))
                candidates.append((family, addr, False))
    last: OSError | None = None
    for fam, sockaddr, dual_stack in candidates:
        try:
            return _open_socket(fam, sockaddr, dual_stack)
        except OSError as exc:
            last = exc
            logger.debug("bind %r: %s failed: %s", bind, sockaddr, exc)
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                break  # another address family would not help (and could hide the clash)
    code = last.errno if last is not None and last.errno is not None else errno.EADDRNOTAVAIL
    why = (last.strerror or str(last)) if last is not None else "no usable address"
    hint = ""
    if code == errno.EADDRINUSE:
        hint = "; another process holds this port: stop it or choose another port"
    elif code == errno.EACCES:
        hint = "; ports below 1024 need privileges: choose a higher port"
    raise OSError(code, f"cannot bind the lighthouse HTTP endpoint to {bind!r}: {why}{hint}")
