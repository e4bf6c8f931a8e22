"""Store addresses and per-configure store prefixes.

A reconfigurable group rendezvouses through the replica group's TCPStore. Each
configure must use keys no earlier configure used, or a rank could read a stale
address of a dead peer and hang. The prefix therefore contains the quorum id, the
group rank and an *attempt number drawn from the store itself* (an atomic counter
per rank): unlike an in-process counter it stays consistent when a process
restarts and rejoins, and two configures of one instance for the same quorum
never share keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistNetworkError, PrefixStore, Store, TCPStore

from rallypoint._net.addr import split_host_port

logger = logging.getLogger("rallypoint.process_groups.store")


@dataclass(frozen=True)
class StoreAddr:
    """A parsed ``host:port/prefix`` (``[v6]:port/prefix`` for IPv6)."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.prefix}" if self.prefix else f"{host}:{self.port}"


def parse_store_addr(addr: str) -> StoreAddr:
    """Parse ``host:port[/prefix]``; IPv6 hosts must be bracketed (``[::1]:29500/p``).

    Raises ValueError naming the address, so a bad manager answer is obvious.
    """
    a = addr.strip()
    # The prefix follows the first "/" after the port (an IPv6 host is bracketed).
    start = a.find("]") + 1 if a.startswith("[") else 0
    slash = a.find("/", start)
    hostport, prefix = (a, "") if slash < 0 else (a[:slash], a[slash + 1 :])
    try:
        host, port = split_host_port(hostport, dialable=True)
    except ValueError as e:
        raise ValueError(f"bad store address {addr!r} (expected host:port/prefix): {e}") from None
    return StoreAddr(host, port, prefix.strip("/"))


def connect_store(addr: StoreAddr, timeout: timedelta) -> Store:
    """A TCPStore client for ``addr`` (not the server: the replica group owns that)."""
    return TCPStore(
        host_name=addr.host,
        port=addr.port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )


class StoreClients:
    """One TCPStore client connection per store server, reused across configures.

    Why: opening a fresh client at every configure costs a connect + handshake and,
    under churn, torch's client occasionally stalls seconds in connect; the server
    (the replica group's store) outlives quorums, so one connection is enough. A
    failed configure calls :meth:`drop` so a restarted server is reconnected, and
    ``fresh_prefix_store`` reconnects at once when the cached connection is dead.
    """

    def __init__(self) -> None:
        self._clients: dict[tuple[str, int], Store] = {}

    def get(self, addr: StoreAddr, timeout: timedelta) -> Store:
        key = (addr.host, addr.port)
        store = self._clients.get(key)
        if store is None:
            store = connect_store(addr, timeout)
            self._clients[key] = store
        else:
            store.set_timeout(timeout)
        return store

    def drop(self) -> None:
        self._clients.clear()


def configure_prefix(base: str, quorum_id: int | None, group_rank: int | None) -> str:
    """The per-(quorum, group rank) part of the key space, before the attempt number."""
    q = "none" if quorum_id is None else str(quorum_id)
    g = "none" if group_rank is None else str(group_rank)
    return f"{base}/rallypoint_pg/q{q}/g{g}" if base else f"rallypoint_pg/q{q}/g{g}"


def fresh_prefix_store(
    store_addr: str,
    *,
    rank: int,
    quorum_id: int | None,
    group_rank: int | None,
    timeout: timedelta,
    clients: StoreClients | None = None,
    exact: bool = False,
) -> tuple[Store, str]:
    """Connect to the store and return ``(PrefixStore, prefix)`` for one configure.

    ``exact``: use the address's prefix as it is (a ``reconfigure()``, whose prefix
    ``torchft/<uuid>`` is already fresh and must match torchft-nightly's groups').

    The attempt number is ``store.add(<prefix>/attempt/r<rank>, 1)``: the n-th
    configure of rank r for this (quorum, group rank) meets the n-th configure of
    the other ranks, and no key is ever read twice across configures.
    """
    parsed = parse_store_addr(store_addr)
    raw = clients.get(parsed, timeout) if clients is not None else connect_store(parsed, timeout)
    if exact:
        if not parsed.prefix:
            raise ValueError(f"store address {store_addr!r} has no prefix")
        return PrefixStore(parsed.prefix, raw), parsed.prefix
    base = configure_prefix(parsed.prefix, quorum_id, group_rank)
    try:
        attempt = raw.add(f"{base}/attempt/r{rank}", 1)
    except DistNetworkError:
        if clients is None:
            raise
        # A cached connection to a server that has restarted since (``rallypoint run``
        # gives each incarnation of a group a fresh store at the same address): once more
        # on a new connection (the dead one cannot have reached the new server).
        clients.drop()
        raw = clients.get(parsed, timeout)
        attempt = raw.add(f"{base}/attempt/r{rank}", 1)
    prefix = f"{base}/a{attempt}"
    logger.debug("store %s:%d prefix %s", parsed.host, parsed.port, prefix)
    return PrefixStore(prefix, raw), prefix
