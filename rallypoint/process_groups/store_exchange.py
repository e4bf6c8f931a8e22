"""Reconfigure a process group without a Manager: its peers swap handles through a store.

The Manager exchanges reconfigure handles through the lighthouse (each quorum carries
them); a job without one, or a test, can do the same through any TCPStore:
:func:`reconfigure_with_store` is torchft-nightly's function of that name, with its
semantics, so code written for torchft 0.3 runs unchanged:

- each rank writes its ``pg.get_reconfigure_handle()`` under ``handle/<rank>`` at the
  store address ``host:port/prefix``, and rank 0 a fresh communicator id under ``uuid``;
- every rank waits for all of them (``timeout``; a missing peer raises torch's
  ``DistStoreError`` and nothing is reconfigured), then calls
  ``pg.reconfigure(ReconfigureOptions(uuid, handles in rank order, timeout)).wait()``.

Every call needs its own prefix (``.../generation/3``): the keys of an earlier call would
otherwise answer at once. Works with any group that has ``get_reconfigure_handle`` and
``reconfigure``: rallypoint's, torchft-nightly's and torch's own (torch >= 2.14, created
with ``enable_reconfigure=True``).
"""

from __future__ import annotations

import uuid as _uuid
from datetime import timedelta
from typing import Any

from .reconfigure import make_options

#: torchft-nightly's default for the exchange and the reconfigure.
RECONFIGURE_TIMEOUT = timedelta(seconds=60)


def create_store_client(store_addr: str, timeout: timedelta) -> Any:
    """A ``PrefixStore(prefix, TCPStore client)`` for ``host:port/prefix`` (``[v6]:port/...``
    too: the port is the field after the address part's last colon)."""
    from torch.distributed import PrefixStore, TCPStore

    addr, _, prefix = store_addr.partition("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"store address {store_addr!r} is not host:port/prefix")
    store = TCPStore(host_name=host.strip("[]"), port=int(port), is_master=False, wait_for_workers=False,
                     timeout=timeout)
    return PrefixStore(prefix, store)


def reconfigure_with_store(pg: Any, store_addr: str, rank: int, world_size: int,
                           timeout: timedelta = RECONFIGURE_TIMEOUT) -> None:
    """Exchange reconfigure handles through the store at ``store_addr`` and reconfigure
    ``pg`` as rank ``rank`` of ``world_size`` (see the module docstring)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    store = create_store_client(store_addr, timeout)
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())
    if rank == 0:
        store.set("uuid", str(_uuid.uuid4().int & ((1 << 63) - 1)))
    keys = ["uuid", *(f"handle/{peer}" for peer in range(world_size))]
    store.wait(keys, timeout)
    communicator_id, *handles = store.multi_get(keys)
    opts = make_options(int(communicator_id), [h.decode("utf-8") for h in handles], timeout)
    pg.reconfigure(opts).wait()


__all__ = ["RECONFIGURE_TIMEOUT", "create_store_client", "reconfigure_with_store"]
