"""Who may speak for a replica id: the lighthouse binds each live id to the caller that
registered it, so another caller cannot take over its address or its liveness stream.

Why: the job's credential says a caller belongs to the job, not which replica it is. Any
holder of it could otherwise send a Quorum under a live replica's id (rewriting the address
peers heal from and kills go to, and its step in the quorum) or open an Attach under it
(superseding the victim's stream: the victim is declared dead and every peer gets a
PeerDown).

A caller is identified by (:class:`Caller`) a digest of its credential, the session nonce
that rallypoint's clients send with every call (:data:`SESSION_HEADER`: random per process,
kept across reconnects, to a restarted or a failed-over lighthouse too) and, for callers
without one (torchft's clients), the host it calls from. The first Quorum, Heartbeat or
Attach of an id binds it; while the id lives every later one must come from the same
caller (:func:`refusal`): the same session, or for a session-less owner the same credential
and host. The binding ends with the replica: its stream ended (a goodbye
or a crash), its heartbeat expired, or it was forgotten, after which a restarted group
(a new ``<group>:<uuid>`` id anyway) or anyone else may register the id. Bindings live in
memory only: a restarted lighthouse binds each id to its first caller again (the replicas
re-attach within milliseconds).

What it cannot tell apart: two session-less callers (torchft clients) on the same host with
the same credential.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from typing import Any, Iterable

from rallypoint._net.peercap import parse_grpc_peer

#: gRPC metadata key carrying the process's session nonce (lower case, as gRPC requires).
SESSION_HEADER = "x-rallypoint-session"
#: Longest session nonce accepted (ours are 32 hex characters).
MAX_SESSION_CHARS = 128
#: This process's session nonce: sent by every rallypoint lighthouse client of the process.
_SESSION = {"pid": os.getpid(), "nonce": secrets.token_hex(16)}


def session_nonce() -> str:
    """This process's session nonce (a forked child gets its own)."""
    if _SESSION["pid"] != os.getpid():
        _SESSION.update(pid=os.getpid(), nonce=secrets.token_hex(16))
    return str(_SESSION["nonce"])


@dataclass(frozen=True)
class Caller:
    """Who made a call: ``credential`` (a digest of its authorization header, "" for
    none), ``session`` (its session nonce, None for none) and ``host`` (its peer host)."""

    credential: str
    session: str | None
    host: str

    def describe(self) -> str:
        """For logs: never the credential, never the nonce."""
        return f"{'a session' if self.session else 'no session'} from {self.host or 'an unknown host'}"


def caller_of(metadata: Iterable[tuple[str, Any]] | None, peer: str) -> Caller:
    """The :class:`Caller` of a gRPC call, from its invocation metadata and ``context.peer()``."""
    auth: str | bytes = ""
    session: str | None = None
    for key, value in metadata or ():
        if key == "authorization":
            auth = value
        elif key == SESSION_HEADER:
            session = value if isinstance(value, str) else value.decode("utf-8", "replace")
    raw = auth.encode("utf-8", "replace") if isinstance(auth, str) else auth
    digest = hashlib.sha256(b"rallypoint-caller\n" + raw).hexdigest()[:32] if raw else ""
    if session is not None:
        session = session[:MAX_SESSION_CHARS] or None
    parsed = parse_grpc_peer(peer)
    return Caller(digest, session, parsed[0] if parsed else peer.rsplit(":", 1)[0])


def refusal(owner: Caller | None, caller: Caller, rid: str) -> str | None:
    """Why ``caller`` may not speak for live replica ``rid`` bound to ``owner`` (None: it may).

    A session names its process: the same session is the owner (its token may have been
    rotated, or its traffic moved to another interface); another session, or none where the
    owner had one (or one where it had none), is another process. Session-less callers
    (torchft's) are the owner when both credential and host match."""
    if owner is None:
        return None
    if owner.session is not None or caller.session is not None:
        if owner.session == caller.session:
            return None
        who = "another process (a different session)"
    elif owner.credential != caller.credential:
        who = "another credential"
    elif owner.host != caller.host:
        who = f"a caller on another host ({owner.host})"
    else:
        return None
    return (f"replica id {rid!r} is registered by {who} and is alive; a replica id belongs to the process that "
            "registered it until that replica leaves or dies (a restarted group gets a new <group>:<uuid> id)")


class OwnerDesk:
    """The binding of each live replica id to its :class:`Caller` (one per job core)."""

    def __init__(self) -> None:
        self._owners: dict[str, Caller] = {}

    def claim(self, rid: str, caller: Caller) -> str | None:
        """Bind ``rid`` to ``caller`` if unbound; why the caller is refused, or None."""
        owner = self._owners.get(rid)
        why = refusal(owner, caller, rid)
        if why is None and owner is None:
            self._owners[rid] = caller
        return why

    def owner(self, rid: str) -> Caller | None:
        """The caller ``rid`` is bound to, if any."""
        return self._owners.get(rid)

    def release(self, rid: str) -> None:
        """``rid``'s replica left or died: anyone may register the id again."""
        self._owners.pop(rid, None)

    def keep_only(self, known: set[str]) -> None:
        """Forget the bindings of ids the lighthouse no longer knows (bounded state)."""
        for rid in [r for r in self._owners if r not in known]:
            del self._owners[rid]

    def __len__(self) -> int:
        return len(self._owners)


__all__ = ["Caller", "OwnerDesk", "SESSION_HEADER", "caller_of", "refusal", "session_nonce"]
