"""Carries the lighthouse's "peer down" notices from group rank 0 to the other ranks of
a replica group.

Only group rank 0 holds the liveness stream to the lighthouse, but every rank has its own
cross-replica process group, and a collective blocked on a dead peer (NCCL never notices
one) must be aborted on every rank. Rank 0 appends each notice to a numbered sequence
of keys in the group's TCPStore; every other rank's relay thread blocks on the next key
(an event, not polling) and hands the notice to its manager. Closing a relay appends a
wake-up entry addressed to itself, so its thread ends at once.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from typing import Callable

from torch.distributed import DistNetworkError, TCPStore

log = logging.getLogger("rallypoint.manager")

_PREFIX = "rallypoint/peer_down"
#: One blocking wait on the store; torch logs a line when a wait times out, so keep it long.
_WAIT = timedelta(seconds=60)


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
    ) -> None:
        self._group_rank = group_rank
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
        with self._lock:
            n = self._writer.add(f"{self._key}/count", 1)
            self._writer.set(f"{self._key}/{n}", json.dumps(entry))

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
                entry = json.loads(self._store.get(key))
            except DistNetworkError:
                # The store's host (rank 0, or the launcher) is gone: the group is going down.
                if not self._closed.is_set():
                    log.info("group rank %d: peer-down relay lost the group store; stopping it", self._group_rank)
                return
            except RuntimeError:
                continue  # the wait timed out: nothing happened, wait again
            n += 1
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
