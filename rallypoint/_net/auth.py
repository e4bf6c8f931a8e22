"""The job credential: one bearer token that guards every socket rallypoint listens on
(the lighthouse, every ManagerServer, the checkpoint server), given as ``--token`` or
``RALLYPOINT_TOKEN`` and picked up by every server and client rallypoint builds.

Tokens are compared in constant time. An empty token is an error, never "auth off":
a job that meant to set one and got an empty string must not run open.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from typing import Any, Callable

import grpc

from rallypoint._net.ratelog import Throttle, left_out_note

log = logging.getLogger("rallypoint.auth")

TOKEN_ENV = "RALLYPOINT_TOKEN"
#: Longest token accepted (it travels in a header on every call).
MAX_TOKEN_CHARS = 4096

AUTH_HINT = (
    "missing or wrong bearer token: pass gRPC metadata 'authorization: Bearer <token>' "
    "(set RALLYPOINT_TOKEN for rallypoint clients; it must match the server's --token)"
)


def check_token(token: str, source: str = "token") -> str:
    """``token`` if usable; ValueError naming ``source`` if empty, too long or not one line."""
    if not token or not token.strip():
        raise ValueError(f"{source} is empty: an empty token would turn authentication off; unset it or give a token")
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"{source} is longer than {MAX_TOKEN_CHARS} characters")
    if any(c in token for c in "\r\n\0") or token != token.strip():
        raise ValueError(f"{source} must be one line without surrounding spaces")
    return token


def job_token(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The job's token: ``explicit`` if given, else ``RALLYPOINT_TOKEN`` if set, else None
    (no authentication). Either, when set but empty, is a ValueError."""
    if explicit is not None:
        return check_token(explicit, "the token")
    env = os.environ if environ is None else environ
    if TOKEN_ENV in env:
        return check_token(env[TOKEN_ENV], TOKEN_ENV)
    return None


def bearer_metadata(token: str | None) -> list[tuple[str, str]] | None:
    """gRPC call metadata carrying ``token`` (None without one)."""
    return [("authorization", f"Bearer {token}")] if token else None


def bearer_token(header: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive,
    surrounding spaces ignored), or None."""
    if not header:
        return None
    text = header.decode("utf-8", "replace") if isinstance(header, bytes) else header
    scheme, _, value = text.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def bearer_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (compared in constant time).
    The one check every rallypoint server (gRPC and HTTP) makes."""
    given = bearer_token(header)
    return given is not None and hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8"))


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call of a ``grpc.aio`` server that lacks ``authorization: Bearer
    <token>`` with UNAUTHENTICATED, before any handler runs. ``on_reject(method, why)``
    is told of each refusal (metrics)."""

    def __init__(self, token: str, on_reject: Callable[[str, str], None] | None = None,
                 hint: str = AUTH_HINT) -> None:
        self._token = check_token(token)
        self._on_reject = on_reject
        self._hint = hint
        # Refusals are logged at most once a second (with a count of the others), so a
        # flood of unauthenticated calls cannot flood the log too.
        self._log_throttle = Throttle(1.0)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        got: str | bytes | None = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value
        if bearer_matches(got, self._token):
            return await continuation(details)
        why = "no token" if got is None else "wrong token"
        left_out = self._log_throttle.ready()
        if left_out is not None:
            log.warning("refused %s: %s%s", details.method, why, left_out_note(left_out, "other refusals"))
        if self._on_reject is not None:
            self._on_reject(details.method, why)
        hint = self._hint

        async def deny(_requests: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, hint)

        # A streaming handler for every method, unary ones included: it never reads the
        # request, so a caller without the token cannot make the server take in (and
        # hold) a large message first. The wire framing is the same for both kinds.
        return grpc.stream_stream_rpc_method_handler(deny)


__all__ = ["AUTH_HINT", "MAX_TOKEN_CHARS", "TOKEN_ENV", "TokenInterceptor", "bearer_matches", "bearer_metadata", "bearer_token",
           "check_token", "job_token"]
