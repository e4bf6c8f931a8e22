"""The receiving side's HTTP helpers and errors, apart from ``http.py`` (the transport)."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx


class TransferError(RuntimeError):
    """A checkpoint could not be fetched from one source; retry with another."""


class TransferTimeout(TransferError, TimeoutError):
    """The checkpoint did not arrive within the timeout."""


def _plain_socket(r: httpx.Response) -> socket.socket | None:
    """The TCP socket under a plain-HTTP response (httpcore's documented
    ``network_stream`` extension), or None where that is unavailable or TLS."""
    ns = r.extensions.get("network_stream")
    if ns is None or r.url.scheme != "http":
        return None
    try:
        if ns.get_extra_info("ssl_object") is not None:
            return None
        sock = ns.get_extra_info("socket")
    except Exception:  # pragma: no cover - other httpcore backends
        return None
    return sock if isinstance(sock, socket.socket) else None


class SourceRefused(TransferError):
    """The source answered with an error retrying it cannot fix (401, 404, 409, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


_Fatal = SourceRefused


def _check_status(r: httpx.Response, where: str) -> None:
    """Raise :class:`SourceRefused` for a non-200 streamed response, quoting at most the
    first 4 KiB of its body (an error body is never buffered whole)."""
    if r.status_code == 200:
        return
    body = bytearray()
    with contextlib.suppress(httpx.HTTPError):
        for chunk in r.iter_raw():
            body += chunk
            if len(body) >= 4096:
                break
    text = body[:500].decode("utf-8", "replace").strip()
    raise SourceRefused(f"{where}: HTTP {r.status_code}: {text}", r.status_code)


def _timeout(deadline: float) -> httpx.Timeout:
    """Per-call timeouts that never run past the overall deadline."""
    left = max(0.001, deadline - time.monotonic())
    return httpx.Timeout(left, connect=min(left, 10.0))
