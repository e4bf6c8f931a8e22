"""Fault injection at the lighthouse: operators ask for a fault (``rallypoint inject``, the
gRPC ``Inject`` call or ``POST /inject``, all behind the job token; off unless the lighthouse
was started with ``--allow-inject``, see :func:`inject_refusal`), the lighthouse checks
the request, records it in the event log and hands it to the replica group with its next
quorum answer (``rallypoint._net.inject``; the group's manager carries it out at a step
boundary). ``lighthouse-restart`` is carried out by the lighthouse itself, and only where
it can restart (a lighthouse started by ``rallypoint lighthouse``).

Why through the lighthouse: it already knows every replica group and is the one place an
operator's credential is checked for the whole job; a drill script needs nothing but its
address and the token. Why with the quorum answer: it is a step boundary by construction,
it reaches every rank of the group (the ManagerServer passes it on), and it needs no new
connection to the managers.

:class:`InjectionDesk` is plain bookkeeping (no I/O, no clock); :func:`resolve` and
:func:`check_request` are pure.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from typing import Any

from rallypoint._net.auth import bearer_matches
from rallypoint._net.inject import ALLOW_INJECT_ENV, KINDS, MAX_INJECT_BYTES, MAX_INJECTIONS, Injection, check_injection

#: The request body of ``POST /inject`` / the gRPC ``Inject`` call, at most.
MAX_REQUEST_BYTES = 2048
#: Kinds carried out by the lighthouse, not handed to a group.
LIGHTHOUSE_KINDS = ("lighthouse-restart",)
#: Why an injection was refused (:func:`inject_refusal`), as the lighthouse counts it.
INJECT_OFF = "injection is off"
INJECT_NEEDS_OPERATOR = "needs the operator token"
INJECT_NEEDS_TOKEN = "needs a token"
INJECT_HINT_OFF = (f"fault injection is off on this lighthouse: start it with --allow-inject (or "
                   f"{ALLOW_INJECT_ENV}=1), and the replica groups' managers with {ALLOW_INJECT_ENV}=1, for a drill")


def inject_refusal(kind: str, job: str, authorization: str | bytes | None, allowed: bool,
                   operator_token: str | None, job_token: str | None, secured: bool) -> str | None:
    """None when an (already admitted) caller may inject a ``kind`` fault into ``job``; else
    why not (:data:`INJECT_OFF`, :data:`INJECT_NEEDS_OPERATOR`, :data:`INJECT_NEEDS_TOKEN`).

    - off unless the lighthouse was started with ``--allow-inject``;
    - on a lighthouse without any credential (``secured`` false) everyone is anonymous and
      the operator turned injection on knowingly: allowed;
    - ``lighthouse-restart`` costs every job a recovery: only the operator's token (the
      lighthouse's ``--token``);
    - any other kind: the job's own token or the operator's. Never an open job's anonymity:
      being admitted to an open job (which needs no credential) is not enough.
    ``job`` is only named in the reason; tokens compare in constant time."""
    del job
    if not allowed:
        return INJECT_OFF
    if not secured:
        return None
    accepted = (operator_token,) if kind in LIGHTHOUSE_KINDS else (job_token, operator_token)
    if any(t is not None and bearer_matches(authorization, t) for t in accepted):
        return None
    return INJECT_NEEDS_OPERATOR if kind in LIGHTHOUSE_KINDS else INJECT_NEEDS_TOKEN


def refusal_detail(why: str, kind: str, job: str) -> str:
    """What a refused injector is told (never which tokens exist)."""
    if why == INJECT_OFF:
        return INJECT_HINT_OFF
    if why == INJECT_NEEDS_OPERATOR:
        return (f"a {kind} injection needs the operator's token (the lighthouse's --token), sent as "
                "'Authorization: Bearer <token>'")
    return (f"a {kind} injection into job {job!r} needs the job's token or the operator's (an open job's "
            "anonymous callers may not inject), sent as 'Authorization: Bearer <token>'")


class UnknownReplica(KeyError):
    """No replica, or more than one, matches the name given."""

    def __str__(self) -> str:
        return str(self.args[0])


def resolve(name: str, known: Collection[str]) -> str:
    """The replica an operator means by ``name``: an exact replica id, or the one known id
    that starts with ``name:`` (managers append ``:<unique suffix>`` to ``REPLICA_GROUP_ID``,
    so an operator may say ``replica_1``). Raises :class:`UnknownReplica` naming the known
    ids (at most 10) when none or several match."""
    if name in known:
        return name
    matches = sorted(r for r in known if r.startswith(name + ":"))
    if len(matches) == 1:
        return matches[0]
    shown = ", ".join(sorted(known)[:10]) or "none"
    if matches:
        raise UnknownReplica(f"replica name {name!r} matches {len(matches)} replicas ({', '.join(matches[:10])}); "
                             "give the full replica id")
    raise UnknownReplica(f"unknown replica {name!r}; known replicas: {shown}")


def check_request(raw: bytes | str) -> tuple[str, Injection]:
    """``(replica name, injection)`` from a request body: a JSON object with ``kind``,
    ``replica`` (required unless the kind is the lighthouse's own) and the injection's
    optional fields. ``ValueError`` names what is wrong; nothing is recorded then."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"inject request is {len(raw)} bytes; the limit is {MAX_REQUEST_BYTES}")
    try:
        value = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # deep nesting: RecursionError
        raise ValueError('inject request must be JSON like {"kind": "slow", "replica": "replica_1", "factor": 3}') \
            from None
    if not isinstance(value, dict):
        raise ValueError("inject request must be a JSON object")
    replica = value.pop("replica", None)
    value["id"] = secrets.token_hex(4)  # the lighthouse names each injection (events, logs)
    inj = check_injection(value)
    if inj.kind in LIGHTHOUSE_KINDS:
        return "", inj
    if not isinstance(replica, str) or not replica.strip():
        raise ValueError(f"a {inj.kind} injection needs the replica to inject into (\"replica\"); kinds: "
                         f"{', '.join(KINDS)}")
    return replica.strip(), inj


class InjectionDesk:
    """Injections waiting for their group's next quorum answer (used on the loop thread)."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Injection]] = {}

    def add(self, replica_id: str, inj: Injection) -> None:
        queue = self._pending.setdefault(replica_id, [])
        if len(queue) >= MAX_INJECTIONS:
            raise ValueError(f"replica {replica_id} already has {len(queue)} injections waiting for its next quorum")
        queue.append(inj)

    def take(self, replica_id: str) -> list[Injection]:
        """The injections to hand out with this answer (at most what fits the limit)."""
        return self._pending.pop(replica_id, [])

    def forget(self, replica_id: str) -> None:
        self._pending.pop(replica_id, None)

    def pending(self) -> dict[str, list[dict[str, Any]]]:
        return {rid: [i.to_json() for i in q] for rid, q in sorted(self._pending.items()) if q}


assert MAX_INJECTIONS * 200 < MAX_INJECT_BYTES  # a full queue always fits the wire limit

__all__ = ["INJECT_NEEDS_OPERATOR", "INJECT_NEEDS_TOKEN", "INJECT_OFF", "LIGHTHOUSE_KINDS", "MAX_REQUEST_BYTES",
           "InjectionDesk", "UnknownReplica", "check_request", "inject_refusal", "refusal_detail", "resolve"]
