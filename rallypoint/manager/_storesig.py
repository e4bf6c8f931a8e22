"""Signed values in the replica group's TCPStore.

The group's store is reachable by anyone who can reach its port, and a TCPStore has no
authentication. Two things ranks read from it decide where the job token goes or
whether a collective aborts: ``manager_addr`` (ranks 1..n dial it with the token) and
the peer-down relay's notices (each one can abort a rank's collectives). With a job token
configured, rank 0 writes those values signed and every rank refuses a value whose
signature does not check, so a forged key is ignored and the real one waited for.

The signature is an HMAC-SHA256 keyed with the job token over the *scope* (the store
prefix of this incarnation of the group, the store's port and the launcher's run id), the
key name and the value, so a genuine value cannot be replayed under another key, in
another incarnation or against another store. Without a token values are written and
read as they are (the data plane is then open, as torchft's is).

Pure functions (no I/O), table-tested in ``tests/test_attacks_store.py``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

#: Marks a signed value: ``rpsig1:<64 hex digits>:<value>``.
MAGIC = b"rpsig1:"
_HEX = 64


def _mac(token: str, scope: str, key: str, value: bytes) -> bytes:
    # Length-prefixed fields: no (scope, key, value) split of one byte string matches another's.
    s, k = scope.encode("utf-8"), key.encode("utf-8")
    msg = b"rallypoint-store-v1\n%d:%s%d:%s%d:" % (len(s), s, len(k), k, len(value)) + value
    return hmac.new(token.encode("utf-8"), msg, hashlib.sha256).hexdigest().encode("ascii")


def store_scope(prefix: str, store_port: int, environ: Mapping[str, str]) -> str:
    """What a signature is bound to besides its key: the incarnation's key prefix, the
    store's port (a new store per run of ``rallypoint run``) and ``TORCHELASTIC_RUN_ID``
    when the launcher sets one."""
    return f"{prefix}@{int(store_port)}#{environ.get('TORCHELASTIC_RUN_ID', '')}"


def sign(token: str | None, scope: str, key: str, value: bytes) -> bytes:
    """The bytes to store under ``key``: ``value`` signed with ``token``, or ``value``
    itself without a token."""
    if token is None:
        return value
    return MAGIC + _mac(token, scope, key, value) + b":" + value


def verify(token: str | None, scope: str, key: str, stored: bytes) -> bytes | None:
    """The value ``stored`` under ``key`` carries, or None when it is not signed with
    ``token`` for this ``scope`` and ``key`` (forged, replayed from another key or
    incarnation, or unsigned). Without a token, ``stored`` as it is."""
    if token is None:
        return stored
    head = len(MAGIC)
    if not stored.startswith(MAGIC) or len(stored) < head + _HEX + 1 or stored[head + _HEX:head + _HEX + 1] != b":":
        return None
    given, value = stored[head:head + _HEX], stored[head + _HEX + 1:]
    return value if hmac.compare_digest(given, _mac(token, scope, key, value)) else None


__all__ = ["MAGIC", "sign", "store_scope", "verify"]
