"""The receiving side's HTTP helpers and errors, apart from ``http.py`` (the transport).

httpx is imported only by the helpers that need it at run time (a receive), never at
import: constructing a ``Manager`` (which serves checkpoints but fetches none) must not pay
for it (~25-90 ms cold)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


class TransferError(RuntimeError):
    """A checkpoint could not be fetched from one source; retry with another."""


class TransferTimeout(TransferError, TimeoutError):
    """The checkpoint did not arrive within the timeout."""


def _plain_socket(r: httpx.Response) -> socket.socket | None:
    """The socket under a response (httpcore's documented ``network_stream`` extension),
    or None where that is unavailable. Over TLS it is the ``ssl.SSLSocket``: its
    ``recv_into`` decrypts straight into the destination, as fast as OpenSSL allows."""
    ns = r.extensions.get("network_stream")
    if ns is None or r.url.scheme not in ("http", "https"):
        return None
    try:
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
    import httpx

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
    import httpx

    left = max(0.001, deadline - time.monotonic())
    return httpx.Timeout(left, connect=min(left, 10.0))


MAX_STATE_ENV = "RALLYPOINT_MAX_STATE_BYTES"


def default_max_state_bytes() -> int:
    """The largest state a receiver accepts unless told otherwise: ``RALLYPOINT_MAX_STATE_BYTES``,
    else this machine's physical memory (a larger state cannot be a legitimate heal here,
    and its header is refused before anything is allocated)."""
    raw = os.environ.get(MAX_STATE_ENV)
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{MAX_STATE_ENV}={raw!r} is not a number of bytes") from None
        if value <= 0:
            raise ValueError(f"{MAX_STATE_ENV} must be > 0, got {value}")
        return value
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40
