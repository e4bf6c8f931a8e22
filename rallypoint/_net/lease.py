"""Quorum leases as they travel (see ``rallypoint/lighthouse/LEASES.md``): the grant the
lighthouse adds to its answer to a Quorum call, as binary trailing metadata.

Shared by the lighthouse (which writes it) and the ManagerServer (which reads it and
checks it before use). Standard library and the generated messages only: the lighthouse
imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rallypoint._proto import rallypoint_pb2 as rpb

#: Trailing metadata key of a lease grant (lighthouse -> ManagerServer).
LEASE_KEY = "rallypoint-lease-bin"
#: A grant is one small message; anything larger is not one of ours.
MAX_GRANT_BYTES = 64


#: Bound of a grant's ``report_every`` (a larger value is taken as this).
MAX_REPORT_EVERY = 1_000_000


@dataclass(frozen=True)
class Grant:
    """A lease grant as received: the leased quorum and how often to report step stats."""

    quorum_id: int
    report_every: int = 1


def encode_grant(quorum_id: int, report_every: int = 1) -> bytes:
    """The trailing-metadata value granting quorum ``quorum_id`` as a lease."""
    return rpb.LeaseGrant(quorum_id=quorum_id, report_every=report_every).SerializeToString()


def parse_lease(trailing: Iterable[tuple[str, Any]] | None) -> Grant | None:
    """The grant in an answer's trailing metadata, or None (no grant, or a value that is
    not a grant: too large, not a message, or a quorum_id below 1). ``report_every`` is
    clamped to ``[1, MAX_REPORT_EVERY]``."""
    raw = next((v for k, v in trailing or () if k == LEASE_KEY), None)
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_GRANT_BYTES:
        return None
    try:
        grant = rpb.LeaseGrant.FromString(bytes(raw))
    except Exception:  # noqa: BLE001 - DecodeError and friends: not a grant
        return None
    if grant.quorum_id <= 0:
        return None
    return Grant(grant.quorum_id, min(max(1, grant.report_every), MAX_REPORT_EVERY))


def parse_grant(trailing: Iterable[tuple[str, Any]] | None) -> int | None:
    """The leased quorum_id in an answer's trailing metadata, or None (see :func:`parse_lease`)."""
    grant = parse_lease(trailing)
    return grant.quorum_id if grant is not None else None


__all__ = ["LEASE_KEY", "MAX_GRANT_BYTES", "MAX_REPORT_EVERY", "Grant", "encode_grant", "parse_grant", "parse_lease"]
