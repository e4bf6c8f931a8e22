"""The torchft 0.3 / torch >= 2.14 reconfigure API: handles, their rendezvous, their store.

torchft-nightly (0.3) dropped ``configure(store_addr, rank, world_size, ...)``: a process
group now publishes a *reconfigure handle* (``get_reconfigure_handle()``), the handles of
one group rank of every participating replica group travel in the quorum (in replica
order), and ``reconfigure(ReconfigureOptions(uuid, handles, timeout))`` builds the new
communicator. Our groups speak it with torchft-nightly's semantics, so handles of theirs
and ours are interchangeable:

- a handle is JSON ``{"id": <unique per group object>, "store": "host:port",
  "global_rank": <int or null>}``; ``store`` is a TCPStore the group itself hosts;
- the rank is the position of the group's own handle (by ``id``) in ``handles``;
- every rank rendezvouses on the *first* handle's store under the prefix
  ``torchft/<uuid>`` (``uuid`` must be fresh for every reconfigure: the Manager passes
  the quorum id, which changes whenever membership does).

:func:`rendezvous_of` is the pure part (table-tested); :class:`HandleStore` hosts the
store. Security (docs/security.md, "Process-group handles"): the store listens on the
address it advertises only (``RALLYPOINT_PG_HOST``: an interface, an IP or a host name;
default the Manager's ``hostname``, else the host's name, as torchft), never every interface unless that name does not
resolve. It holds only the collectives' rendezvous keys (the data plane), nothing that
decides where the job credential goes, so there is nothing to sign; like the group's
store it has no authentication: keep it on the job's private network.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import uuid as _uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

logger = logging.getLogger("rallypoint.process_groups.reconfigure")

#: The environment variable that chooses the network the group's handle store uses.
PG_HOST_ENV = "RALLYPOINT_PG_HOST"
#: Longest handle accepted (the lighthouse limits them the same way).
MAX_HANDLE_BYTES = 4096
#: Most handles in one reconfigure (one per replica group).
MAX_HANDLES = 65536

if TYPE_CHECKING:
    # mypy sees the shim's shape; at runtime torch's class is used when it exists.
    @dataclass
    class ReconfigureOptions:
        """torch's ``ReconfigureOptions`` (torch >= 2.14) or a field-compatible shim."""

        uuid: int = 0
        handles: list[str] | set[str] = field(default_factory=list)
        timeout: timedelta | None = None
        hints: dict[str, str] = field(default_factory=dict)
else:
    try:  # torch >= 2.14: the native options, which native groups' reconfigure() requires
        from torch._C._distributed_c10d import ReconfigureOptions
    except ImportError:  # torch < 2.14: the same fields (torchft-nightly uses the same shim)

        @dataclass
        class ReconfigureOptions:
            """What ``reconfigure()`` takes: ``uuid`` (fresh per reconfigure), ``handles``
            (one per rank, a list: rank = position), ``timeout`` and backend ``hints``.
            torch >= 2.14 has it natively; this is the same shape for older torch."""

            uuid: int = 0
            handles: list[str] | set[str] = field(default_factory=list)
            timeout: timedelta | None = None
            hints: dict[str, str] = field(default_factory=dict)


def make_options(uuid: int, handles: list[str], timeout: timedelta | None) -> ReconfigureOptions:
    """``ReconfigureOptions`` filled in (torch's class has no keyword constructor)."""
    opts = ReconfigureOptions()
    opts.uuid = int(uuid)
    opts.handles = list(handles)
    if timeout is not None:
        opts.timeout = timeout
    return opts


def make_handle(handle_id: str, store: str, global_rank: int | None) -> str:
    """A handle in torchft-nightly's JSON shape."""
    return json.dumps({"id": handle_id, "store": store, "global_rank": global_rank})


def new_handle_id() -> str:
    """A fresh handle id (one per process-group object, as torchft's)."""
    return _uuid.uuid4().hex


@dataclass(frozen=True)
class Rendezvous:
    """What one reconfigure means for this group: where all ranks meet and who is who."""

    store_addr: str  # "host:port/torchft/<uuid>"
    rank: int
    world_size: int
    uuid: int
    global_ranks: tuple[int, ...] | None


def _peer(i: int, handle: object) -> tuple[str, str, int | None]:
    if not isinstance(handle, str):
        raise ValueError(f"reconfigure handle {i} is a {type(handle).__name__}, not a string")
    if len(handle.encode("utf-8")) > MAX_HANDLE_BYTES:
        raise ValueError(f"reconfigure handle {i} is {len(handle)} characters long (at most {MAX_HANDLE_BYTES})")
    if not handle:
        raise ValueError(f"reconfigure handle {i} is empty: that participant sent no handle "
                         "(a torchft 0.2 peer cannot join a reconfigure)")
    try:
        obj = json.loads(handle)
    except ValueError:
        raise ValueError(f"reconfigure handle {i} is not JSON: {handle[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"reconfigure handle {i} is not a JSON object: {handle[:80]!r}")
    hid, store, grank = obj.get("id"), obj.get("store"), obj.get("global_rank")
    if not isinstance(hid, str) or not hid:
        raise ValueError(f"reconfigure handle {i} has no string 'id': {handle[:80]!r}")
    if not isinstance(store, str) or ":" not in store or "/" in store:
        raise ValueError(f"reconfigure handle {i} has no 'store' host:port: {handle[:80]!r}")
    if grank is not None and (not isinstance(grank, int) or isinstance(grank, bool) or grank < 0):
        raise ValueError(f"reconfigure handle {i} has a bad 'global_rank' {grank!r}")
    return hid, store, grank


def rendezvous_of(uuid: int, handles: object, own_id: str) -> Rendezvous:
    """Parse ordered handles (torchft-nightly's rules; see the module docstring).

    Raises ValueError naming the bad handle: a set (no order), a handle that is not a
    torchft handle, a duplicated id, or a list without this group's own handle."""
    if not isinstance(handles, list):
        raise ValueError(f"reconfigure needs an ordered list of handles, got a {type(handles).__name__}")
    if not handles:
        raise ValueError("reconfigure got no handles")
    if len(handles) > MAX_HANDLES:
        raise ValueError(f"reconfigure got {len(handles)} handles (at most {MAX_HANDLES})")
    if isinstance(uuid, bool) or not isinstance(uuid, int) or uuid < 0:
        raise ValueError(f"reconfigure uuid {uuid!r} is not a non-negative integer")
    peers = [_peer(i, h) for i, h in enumerate(handles)]
    ids = [p[0] for p in peers]
    seen: set[str] = set()
    for i, hid in enumerate(ids):
        if hid in seen:
            raise ValueError(f"reconfigure handle {i} repeats id {hid!r}")
        seen.add(hid)
    if own_id not in seen:
        raise ValueError(f"this group's handle (id {own_id!r}) is not among the {len(handles)} handles")
    granks = [p[2] for p in peers]
    return Rendezvous(
        store_addr=f"{peers[0][1]}/torchft/{uuid}",
        rank=ids.index(own_id),
        world_size=len(peers),
        uuid=uuid,
        global_ranks=None if any(g is None for g in granks) else tuple(g for g in granks if g is not None),
    )


@dataclass(frozen=True)
class StoreAddress:
    """Where the handle store listens (``bind``; None: every interface) and what it advertises."""

    bind: str | None
    advertise: str


def store_address(value: str | None, hostname: str, interfaces: Mapping[str, str | None],
                  resolve: Callable[[str], str | None]) -> StoreAddress:
    """The handle store's address for ``RALLYPOINT_PG_HOST`` = ``value`` (pure: the
    interface table and the resolver are arguments).

    An IP: bound and advertised. An interface name: its IPv4 address. A host name (the
    default is this host's name): advertised as given, bound to what it resolves to here,
    and to every interface only when it does not resolve."""
    v = (value or "").strip()
    name = v or hostname
    try:
        ip = ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None:
        return StoreAddress(str(ip), str(ip))
    if v and v in interfaces:
        addr = interfaces[v]
        if addr is None:
            raise ValueError(f"{PG_HOST_ENV}={v}: the interface has no IPv4 address on this host")
        return StoreAddress(addr, addr)
    return StoreAddress(resolve(name), name)


def _resolve(name: str) -> str | None:
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return str(infos[0][4][0]) if infos else None


def _address_from_env(environ: Mapping[str, str], hostname: str | None) -> StoreAddress:
    from rallypoint._net.heal_host import interface_addresses

    value = environ.get(PG_HOST_ENV)
    return store_address(value, hostname or socket.gethostname(),
                         interface_addresses() if (value or "").strip() else {}, _resolve)


class HandleStore:
    """The TCPStore a group hosts for the reconfigures it leads (opened on first use).

    Listens on the advertised address only (see :func:`store_address`); closed with
    :meth:`close` (a group's ``shutdown()``)."""

    def __init__(self, environ: Mapping[str, str] | None = None, hostname: str | None = None) -> None:
        import os

        self._environ = environ if environ is not None else os.environ
        self.hostname = hostname  # the default when RALLYPOINT_PG_HOST is unset (else the host's name)
        self._store: Any = None
        self._addr: str | None = None
        self._lock = threading.Lock()

    def address(self) -> str:
        """``host:port`` of the store (``[v6]:port``), opening it the first time."""
        with self._lock:
            if self._addr is None:
                self._store, self._addr = self._open()
            return self._addr

    def _open(self) -> tuple[Any, str]:
        from torch.distributed import TCPStore

        where = _address_from_env(self._environ, self.hostname)
        if where.bind is None:
            logger.warning("%s does not resolve here: the group's handle store listens on every interface",
                           where.advertise)
            store = TCPStore(where.advertise, 0, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=300))
        else:
            family = socket.AF_INET6 if ":" in where.bind else socket.AF_INET
            listen = socket.create_server((where.bind, 0), family=family, backlog=512)
            store = TCPStore(where.bind, listen.getsockname()[1], is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=300), master_listen_fd=listen.detach())
        host = f"[{where.advertise}]" if ":" in where.advertise else where.advertise
        logger.debug("hosting the group's handle store on %s:%d", where.bind or "*", store.port)
        return store, f"{host}:{store.port}"

    def close(self) -> None:
        """Drop the store (its server closes with the last reference)."""
        with self._lock:
            self._store, self._addr = None, None


__all__ = ["HandleStore", "MAX_HANDLE_BYTES", "PG_HOST_ENV", "ReconfigureOptions", "Rendezvous", "StoreAddress",
           "make_handle", "make_options", "new_handle_id", "rendezvous_of", "store_address"]
