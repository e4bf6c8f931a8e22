"""gRPC options, size limits and error translation shared by every rallypoint server
and client (the lighthouse's and the managers')."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Awaitable, Callable

import grpc

#: The largest message a rallypoint gRPC server accepts. The largest legal request is a
#: quorum request with every field at its limit (``limits.py``: about 70 KiB); gRPC reads
#: a whole message before any handler or interceptor runs, so this also bounds what a
#: caller without the token can make a server hold.
MAX_RECEIVE_BYTES = 256 * 1024
#: The largest message a server sends: a lighthouse status or quorum of many replicas.
MAX_SEND_BYTES = 64 * 1024 * 1024


#: How long a new connection to a rallypoint gRPC server has to finish its handshake (the
#: same bound as a request head on the HTTP servers).
HANDSHAKE_TIMEOUT_MS = 10_000


def _env_ms(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, "") or default))
    except ValueError:
        return default


#: How long a connection that carries no call is kept (``grpc.max_connection_idle_ms``;
#: ``RALLYPOINT_GRPC_IDLE_MS``). The handshake bound alone let a socket that sent the HTTP/2
#: preface and SETTINGS and then nothing stay open indefinitely. A client whose connection was
#: closed for idleness reconnects at its next call (gRPC sends GOAWAY first, so nothing is lost);
#: a pending quorum call or a liveness stream is a call, so a waiting replica is never idle.
CONNECTION_IDLE_MS = _env_ms("RALLYPOINT_GRPC_IDLE_MS", 20_000)


def server_options(max_send: int = MAX_SEND_BYTES) -> list[tuple[str, int]]:
    """Options for every ``grpc.aio.server`` rallypoint starts. ``so_reuseport`` is off:
    two servers must never share a port by accident."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", max_send),
        # Clients ping an idle connection to tell a lost host from a quiet one (below): allow it.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS - 1000),
        ("grpc.http2.max_ping_strikes", 0),
        # A connection that has not finished its handshake (TLS, and the HTTP/2 preface and
        # SETTINGS) within this is closed. Without it, gRPC (1.85) held an idle socket 60 s,
        # long enough for idle sockets from anyone to exhaust the server's descriptors.
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        # A connection with no call in flight for this long is closed (GOAWAY, then close).
        ("grpc.max_connection_idle_ms", CONNECTION_IDLE_MS),
    ]


def channel_options() -> list[tuple[str, int]]:
    """Options for every channel rallypoint's clients open: they accept what a server may send."""
    return [
        ("grpc.max_receive_message_length", MAX_SEND_BYTES),
        ("grpc.max_send_message_length", MAX_RECEIVE_BYTES),
    ]


#: How often a lighthouse client pings its connection, and how long it waits for the answer:
#: a lighthouse host that is lost without a reset (powered off, partitioned) is seen within
#: about twice this, and its calls and streams fail over to the next address.
KEEPALIVE_MS = 5000


def keepalive_channel_options() -> list[tuple[str, int]]:
    """``channel_options()`` plus HTTP/2 keepalive pings (the lighthouse clients)."""
    return [
        *channel_options(),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def seconds(t: float | timedelta) -> float:
    """``timedelta`` or float seconds -> float seconds (every client accepts both)."""
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


def translate_rpc_error(e: grpc.RpcError, what: str, timeout: float, timeout_hint: str = "") -> Exception:
    """A gRPC failure as the Python exception a caller can act on, naming ``what``."""
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    # torchft's servers enforce the deadline themselves and answer CANCELLED
    # "Timeout expired", racing our own DEADLINE_EXCEEDED: both mean a timeout.
    timed_out = code == grpc.StatusCode.CANCELLED and "timeout expired" in (detail or "").lower()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or timed_out:
        return TimeoutError(f"{what} timed out after {timeout:.1f}s{timeout_hint}: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(f"{what} was rejected: {detail}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionError(f"{what} was refused: {detail}")
    return ConnectionError(f"{what} failed ({code.name if code else 'error'}): {detail}")


def unary_handler(handler: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], request_type: Any,
                  response_serializer: Callable[[Any], bytes],
                  on_invalid: Callable[[], None] | None = None) -> grpc.RpcMethodHandler:
    """A unary-unary method handler that parses its request itself, so bytes that are not
    a valid ``request_type`` (malformed, truncated, nested past protobuf's recursion
    limit) are INVALID_ARGUMENT naming the message type, not grpc's UNKNOWN. ``on_invalid``
    is told of each (metrics)."""
    name = request_type.DESCRIPTOR.full_name

    async def parse_then_handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = request_type.FromString(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError, RecursionError: all mean "not a valid request"
            if on_invalid is not None:
                on_invalid()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name}: {e}"[:500])
        return await handler(request, context)

    return grpc.unary_unary_rpc_method_handler(parse_then_handle, response_serializer=response_serializer)


__all__ = ["CONNECTION_IDLE_MS", "HANDSHAKE_TIMEOUT_MS", "MAX_RECEIVE_BYTES", "MAX_SEND_BYTES", "channel_options", "seconds", "server_options",
           "translate_rpc_error", "unary_handler"]
