"""The replica group's TCPStore: where it is, who hosts it, and the key prefix of one
incarnation of the group. Decisions are pure functions (``plan_store``,
``store_prefix``, table-tested in ``tests/test_store.py``); ``open_store`` is the thin
shell that connects or hosts.

torchft's rule, which rallypoint follows: with an address given (``store_addr`` /
``store_port`` or torchrun's ``MASTER_ADDR`` / ``MASTER_PORT``) every rank connects to a
store the caller hosts; rallypoint hosts one only when none is given, on a port the OS
picks (a group of one rank only: other ranks could not find it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistNetworkError, DistStoreError, TCPStore

from rallypoint._net.addr import is_loopback

@dataclass(frozen=True)
class StorePlan:
    """Where a rank finds its replica group's TCPStore.

    ``hosted``: no address was given, so group rank 0 hosts one on a port the OS picks
    (``port`` 0). Otherwise every rank connects to ``host:port``, which the caller hosts
    (torchrun's agent, ``rallypoint run``, or the script itself), as torchft does.
    ``advertise``: the host other replica groups reach this store at (the cross-replica
    process group rendezvouses in the store of an up-to-date member).
    """

    host: str
    port: int
    hosted: bool
    advertise: str


def plan_store(store_addr: str | None, store_port: int | str | None, hostname: str,
               environ: Mapping[str, str]) -> StorePlan:
    """Decide the group's store from the arguments and torchrun's ``MASTER_ADDR`` /
    ``MASTER_PORT`` (arguments win). A port of 0 or none means "nobody hosts one": the
    Manager hosts it. A loopback address is advertised as ``hostname``, since other
    hosts cannot reach a peer's loopback (a TCPStore listens on every interface)."""
    host = store_addr or environ.get("MASTER_ADDR") or None
    raw_port = store_port if store_port not in (None, "") else environ.get("MASTER_PORT")
    try:
        port = int(raw_port) if raw_port not in (None, "") else 0
    except ValueError:
        raise ValueError(f"store port {raw_port!r} (store_port / MASTER_PORT) is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"store port {port} (store_port / MASTER_PORT) is not in 0..65535")
    if port == 0:
        return StorePlan(host=hostname, port=0, hosted=True, advertise=hostname)
    host = host or "127.0.0.1"  # a port without an address: a store on this host
    advertise = hostname if is_loopback(host) else host
    return StorePlan(host=host, port=port, hosted=False, advertise=advertise)


def store_prefix(environ: Mapping[str, str]) -> str:
    """The key prefix of this incarnation of the replica group in its store.

    A store that outlives its ranks (torchrun's agent store, ``rallypoint run``'s) still
    holds the previous incarnation's keys, e.g. the address of a manager that is gone; a
    restarted rank must never read those. torchrun and ``rallypoint run`` number restarts
    in ``TORCHELASTIC_RESTART_COUNT``."""
    return f"rallypoint/{environ.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}"


def open_store(plan: StorePlan, group_rank: int, group_world_size: int, timeout: timedelta,
               log: logging.Logger | logging.LoggerAdapter) -> TCPStore:
    """Connect to the group's store, or host one when no address was given (only a
    group of one rank can: the others would not know where it is)."""
    seconds = timeout.total_seconds()
    if plan.hosted:
        if group_world_size > 1:
            raise ValueError(
                f"group rank {group_rank} of {group_world_size}: the ranks of a replica group share "
                "a TCPStore, and no address was given. Pass store_addr/store_port, or set MASTER_ADDR/MASTER_PORT "
                "(torchrun and `rallypoint run` set them and host the store)"
            )
        store = TCPStore(host_name=plan.host, port=0, is_master=True, wait_for_workers=False,
                         timeout=timeout)
        log.info(
            "no store address given (store_addr/store_port or MASTER_ADDR/MASTER_PORT): hosting this replica "
            "group's store on port %d", store.port,
        )
        return store
    try:
        store = TCPStore(host_name=plan.host, port=plan.port, is_master=False, wait_for_workers=False,
                         timeout=timeout)
    except (DistNetworkError, DistStoreError) as e:
        raise ConnectionError(
            f"group rank {group_rank}: cannot reach the replica group's store at {plan.host}:{plan.port} "
            f"(store_addr/store_port or MASTER_ADDR/MASTER_PORT) within {seconds:.0f}s. With an address given, "
            "rallypoint connects to a store the caller hosts (torchrun and `rallypoint run` do; a script can "
            "start a torch.distributed.TCPStore(is_master=True)); leave both unset in a group of one rank and "
            f"rallypoint hosts it. ({e})"
        ) from e
    log.info("using the replica group's store at %s:%d (hosted by the caller)", plan.host, plan.port)
    return store


__all__ = ["StorePlan", "open_store", "plan_store", "store_prefix"]
