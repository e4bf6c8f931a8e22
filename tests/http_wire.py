"""Raw HTTP/1.1 on a socket, for the tests that play a client by hand (an attacker's
idle sockets, a keep-alive connection asked twice)."""

from __future__ import annotations

import socket


def read_response(s: socket.socket, timeout: float = 5.0) -> bytes:
    """One whole response on ``s`` (its head, then a content-length body); returns the head.
    Fails when the server closes the connection first."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(v for k, v in fields.items() if k.strip().lower() == b"content-length"))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection"
        body += chunk
    assert len(body) == length
    return head


def closed_by_server(s: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes ``s`` (within ``timeout``) without sending anything more."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
