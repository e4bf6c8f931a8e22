"""Who gets a connection slot when a server's connection cap is reached.

Why: a server that refuses every newcomer once its cap is reached can be locked by anyone
who reaches its port: open the cap's worth of connections, send nothing, and reconnect
each time the server drops them for their silence. Every legitimate client is refused
meanwhile (measured on the checkpoint server: 64 idle sockets without a token made a heal
fail within 1 ms). So a newcomer takes the slot of the oldest connection that has not
proven itself yet (an authorized request on the checkpoint server; a whole request on the
lighthouse's HTTP endpoint), and is refused only when every slot holds a proven one. A real
client sends its request as soon as it connects, so it is proven long before an attacker's
later connections make it the oldest unproven one.

Only a request the server *accepts* proves a connection: one that carried a valid credential,
or any well-formed one where no credential is configured. A refused request (400, 401, 403, ...)
proves nothing and closes the connection: otherwise keep-alive sockets re-sending a bad token
every few seconds held every slot and locked the operator out (issue 37).
"""

from __future__ import annotations

from collections.abc import Sequence


def evict_for_newcomer(conns: Sequence[tuple[float, bool]]) -> int | None:
    """The index of the connection a newcomer replaces when every slot is taken: the
    oldest (by accept time) not yet proven; None when all are proven (the newcomer is
    refused). ``conns``: ``(accepted, proven)`` per connection."""
    best: int | None = None
    for i, (accepted, proven) in enumerate(conns):
        if not proven and (best is None or accepted < conns[best][0]):
            best = i
    return best


#: Answers after which an HTTP server closes the connection: the request was malformed or
#: refused (bad or missing credential, forbidden, too large).
CLOSING_STATUSES = frozenset({400, 401, 403, 405, 413, 414, 431})


def closes_connection(status: int) -> bool:
    """Whether a response with ``status`` ends its connection (a refused request)."""
    return status in CLOSING_STATUSES


def proves_connection(credentialed: bool, credential_configured: bool) -> bool:
    """Whether a whole request head proves its connection: it carried a valid credential
    (``credentialed``), or the server has none configured. An open route asked without a
    credential (``/healthz``) does not prove one on a secured server: such connections give
    way to newcomers. (A request that is then refused closes its connection: :func:`closes_connection`.)"""
    return credentialed or not credential_configured


__all__ = ["CLOSING_STATUSES", "closes_connection", "evict_for_newcomer", "proves_connection"]
