"""Carries the lighthouse's "peer down" notices from group rank 0 to the other ranks of
a replica group.

Only group rank 0 holds the liveness stream to the lighthouse, but every rank has its own
cross-replica process group, and a collective blocked on a dead peer (NCCL never notices
one) must be aborted on every rank. Rank 0 appends each notice to a numbered sequence
of keys in the group's TCPStore; every other rank's relay thread blocks on the next key
(an event, not polling) and hands the notice to its manager. Closing a relay appends a
wake-up entry addressed to itself, so its thread ends at once.

With a job token every entry is signed (``_storesig``) over its own key, so anyone who
can reach the store cannot abort the group's collectives with a forged notice: a listener
refuses and logs an entry that does not check, and goes on to the next. A writer never
overwrites a slot someone else took first (``compare_set``); it takes the next one, so a
slot an attacker filled in advance holds no real notice back. Without a token, entries
are plain JSON, as before.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from typing import Any, Callable

from torch.distributed import DistNetworkError, TCPStore

from rallypoint.manager._storesig import sign, verify

log = logging.getLogger("rallypoint.manager")

_PREFIX = "rallypoint/peer_down"
#: One blocking wait on the store; torch logs a line when a wait times out, so keep it long.
_WAIT = timedelta(seconds=60)
#: Slots a writer skips (taken by someone else) before it gives a notice up.
_MAX_TAKEN = 64


class PeerDownRelay:
    """``publish`` on rank 0; ``start`` a listener on the other ranks.

    ``on_peer_down(replica_id, reason)`` runs on the relay's thread.
    """

    def __init__(
        self,
        host: str,
        port: int,
        group_rank: int,
        on_peer_down: Callable[[str, str], None],
        connect_timeout: timedelta,
        prefix: str = "",
        on_lease_left: Callable[[str, str, int, int], None] | None = None,
        token: str | None = None,
        scope: str = "",
    ) -> None:
        """``token``: the job token that signs and checks every entry (None: plain
        entries, unchecked); ``scope``: what signatures are bound to besides the key
        (``_storesig.store_scope``)."""
        self._group_rank = group_rank
        self._token = token
        self._scope = scope
        self._refused = 0
        # Keys live under the incarnation's prefix, so a restarted group never reads a
        # notice (or wake-up) of its previous incarnation in a store that outlived it.
        self._key = f"{prefix}/peer_down" if prefix else _PREFIX
        self._on_peer_down = on_peer_down
        self._on_lease_left = on_lease_left
        # Connections of their own: a TCPStore client serializes its calls, so the
        # listener's long wait must not hold up anyone else's (its own wake-up included).
        self._store = TCPStore(host, port, is_master=False, timeout=connect_timeout)
        self._writer = TCPStore(host, port, is_master=False, timeout=connect_timeout)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, replica_id: str, reason: str, lease: tuple[int, int] | None = None) -> None:
        """Append a notice for every listening rank (rank 0, on the liveness thread); with
        ``lease`` (quorum_id, after_step), that the member left that lease. A failure is
        logged, never raised: the notice's own abort must still happen."""
        try:
            self._append({"replica_id": replica_id, "reason": reason, **({"lease": list(lease)} if lease else {})})
        except Exception as e:  # noqa: BLE001
            log.warning("could not relay the loss of %s to the other group ranks: %s", replica_id, e)

    def _append(self, entry: dict[str, object]) -> None:
        raw = json.dumps(entry).encode()
        with self._lock:
            for _ in range(_MAX_TAKEN):
                n = self._writer.add(f"{self._key}/count", 1)
                key = f"{self._key}/{n}"
                value = sign(self._token, self._scope, key, raw)
                # Never overwrite a slot taken first: a listener may already have read it.
                if self._writer.compare_set(key, "", value) == value:  # type: ignore[arg-type]
                    return
                log.warning("group rank %d: store key %s was written by someone else before us; "
                            "using the next one", self._group_rank, key)
            raise RuntimeError(f"{_MAX_TAKEN} slots of {self._key} in a row were taken by someone else")

    def start(self) -> None:
        """Listen for notices published from now on (ranks other than 0)."""
        first = self._store.add(f"{self._key}/count", 0) + 1
        self._thread = threading.Thread(
            target=self._listen, args=(first,), name=f"rallypoint-peer-relay-{self._group_rank}", daemon=True
        )
        self._thread.start()

    def _listen(self, n: int) -> None:
        while not self._closed.is_set():
            key = f"{self._key}/{n}"
            try:
                self._store.wait([key], _WAIT)
                stored = self._store.get(key)
            except DistNetworkError:
                # The store's host (rank 0, or the launcher) is gone: the group is going down.
                if not self._closed.is_set():
                    log.info("group rank %d: peer-down relay lost the group store; stopping it", self._group_rank)
                return
            except RuntimeError:
                continue  # the wait timed out: nothing happened, wait again
            n += 1
            entry = self._entry(key, stored)
            if entry is None:
                continue
            if entry.get("wake") == self._group_rank:
                return
            if "replica_id" in entry:
                try:
                    lease = entry.get("lease")
                    if lease is not None:
                        if self._on_lease_left is not None:
                            self._on_lease_left(str(entry["replica_id"]), str(entry.get("reason", "")),
                                                int(lease[0]), int(lease[1]))
                        continue
                    self._on_peer_down(str(entry["replica_id"]), str(entry.get("reason", "")))
                except Exception:  # noqa: BLE001 - a handler bug must not end the relay
                    log.exception("group rank %d: peer-down handler failed", self._group_rank)

    def _entry(self, key: str, stored: bytes) -> dict[str, Any] | None:
        """The notice stored under ``key``, or None (logged) when it is not signed with
        the job token for this key, or not a JSON object."""
        value = verify(self._token, self._scope, key, stored)
        entry = None
        if value is not None:
            try:
                loaded = json.loads(value)
                entry = loaded if isinstance(loaded, dict) else None
            except ValueError:
                entry = None
        if entry is None:
            self._refused += 1
            if self._refused == 1 or self._refused % 100 == 0:
                log.warning("group rank %d: refused store key %s: %s (%d refused so far); someone who can "
                            "reach the group's store wrote it; ignoring it", self._group_rank, key,
                            "not signed with the job token" if value is None else "not a notice", self._refused)
        return entry

    @property
    def refused(self) -> int:
        """How many entries this relay refused (forged, replayed or malformed)."""
        return self._refused

    def close(self, timeout: float = 5.0) -> None:
        """Stop the listener (it wakes at once while the store is reachable)."""
        self._closed.set()
        if self._thread is not None and self._thread.is_alive():
            try:
                self._append({"wake": self._group_rank})
            except Exception:  # noqa: BLE001 - the store is gone; the thread ends by itself
                pass
            self._thread.join(timeout)


__all__ = ["PeerDownRelay"]
