"""Address spellings accepted everywhere: ``host:port``, ``http://host:port``,
``[v6]:port`` (every rallypoint server, client and store address is parsed here).
gRPC wants the bare ``host:port`` target; users paste either."""

from __future__ import annotations

import socket


def grpc_target(addr: str) -> str:
    """``http://host:port/`` or ``host:port`` -> ``host:port`` (IPv6 brackets kept)."""
    a = addr.strip()
    for prefix in ("http://", "https://", "grpc://"):
        if a.startswith(prefix):
            a = a[len(prefix) :]
            break
    a = a.rstrip("/")
    if not a:
        raise ValueError(f"empty address {addr!r}: expected host:port or http://host:port")
    host, port = split_host_port(a)
    return join_host_port(host, port)


def split_host_port(addr: str, dialable: bool = False) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port``; raises ValueError naming the address.
    Port 0 means "any port" in a bind address; ``dialable``: an address to connect
    to, where it is an error."""
    a = addr
    for prefix in ("http://", "https://", "grpc://"):
        if a.startswith(prefix):
            a = a[len(prefix) :]
    a = a.rstrip("/")
    if a.startswith("["):
        end = a.find("]")
        if end < 0 or not a[end + 1 :].startswith(":"):
            raise ValueError(f"bad address {addr!r}: expected [ipv6]:port")
        host, port_s = a[1:end], a[end + 2 :]
    else:
        host, sep, port_s = a.rpartition(":")
        if not sep or not host:
            raise ValueError(f"bad address {addr!r}: expected host:port or http://host:port")
        if ":" in host:
            raise ValueError(f"bad address {addr!r}: put IPv6 hosts in brackets, e.g. [::1]:29510")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"bad port in address {addr!r}") from None
    if not (1 if dialable else 0) <= port <= 65535:
        raise ValueError(f"port out of range in address {addr!r}" + (" (0 is not a port to connect to)" if port == 0 else ""))
    return host, port


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def is_loopback(host: str) -> bool:
    h = host.lower()
    return h in ("localhost", "::1", "[::1]", "ip6-localhost") or h.startswith("127.")


def advertised_host(bind_host: str) -> str:
    """The host others should dial for a server bound to ``bind_host``: the machine's
    hostname for a wildcard bind (as torchft does), else the bind host itself."""
    return socket.gethostname() if is_wildcard(bind_host) else bind_host
