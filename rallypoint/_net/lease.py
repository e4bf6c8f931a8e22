"""Quorum leases as they travel (see ``rallypoint/lighthouse/LEASES.md``): the grant the
lighthouse adds to its answer to a Quorum call, as binary trailing metadata.

Shared by the lighthouse (which writes it) and the ManagerServer (which reads it and
checks it before use). Standard library and the generated messages only: the lighthouse
imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rallypoint._proto import rallypoint_pb2 as rpb

#: Trailing metadata key of a lease grant (lighthouse -> ManagerServer).
LEASE_KEY = "rallypoint-lease-bin"
#: A grant is one small message; anything larger is not one of ours.
MAX_GRANT_BYTES = 64


def encode_grant(quorum_id: int) -> bytes:
    """The trailing-metadata value granting quorum ``quorum_id`` as a lease."""
    return rpb.LeaseGrant(quorum_id=quorum_id).SerializeToString()


def parse_grant(trailing: Iterable[tuple[str, Any]] | None) -> int | None:
    """The leased quorum_id in an answer's trailing metadata, or None (no grant, or a
    value that is not a grant: too large, not a message, or a quorum_id below 1)."""
    raw = next((v for k, v in trailing or () if k == LEASE_KEY), None)
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_GRANT_BYTES:
        return None
    try:
        grant = rpb.LeaseGrant.FromString(bytes(raw))
    except Exception:  # noqa: BLE001 - DecodeError and friends: not a grant
        return None
    return grant.quorum_id if grant.quorum_id > 0 else None


__all__ = ["LEASE_KEY", "MAX_GRANT_BYTES", "encode_grant", "parse_grant"]
