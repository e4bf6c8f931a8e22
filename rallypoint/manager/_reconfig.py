"""The Manager's configure step: which API rebuilds the process group for a new quorum.

Three kinds of group reach a ``Manager``:

- torchft 0.2's API only (``configure(store_addr, rank, world_size, ...)``): configured
  through the replica group's store, as always;
- torchft 0.3's / torch >= 2.14's (``supports_reconfigure``, ``get_reconfigure_handle()``,
  ``reconfigure(ReconfigureOptions)``): its handle goes with every quorum request, and a
  new quorum reconfigures it from the handles of the answer (rank = position of its own
  handle, in replica order). Ours have both APIs; torchft-nightly's groups and torch's
  own groups created with ``enable_reconfigure=True`` only this one;
- neither: refused when the Manager is built (``TypeError``).

A quorum answer may lack handles: a torchft 0.2 peer sends none (``''`` in its place),
and a lighthouse or ManagerServer that predates the field returns none at all. A group
that also has ``configure()`` then falls back to it; one that has not fails the round
with an error naming the replicas without a handle. :func:`pg_kind` and :func:`plan`
are the pure decisions (table-tested in ``tests/test_pg_reconfigure_manager.py``);
:class:`Configurer` carries them out.

A native torch group lacks what the Manager reads besides its collectives (``errored()``);
:class:`NativeGroup` adds it (the backends' error state, as torchft-nightly reads it).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from rallypoint.manager.recovery import QuorumResult


@dataclass(frozen=True)
class PgKind:
    """What a process group offers the Manager."""

    reconfigure: bool  # supports_reconfigure: handles + reconfigure(opts)
    configure: bool  # torchft 0.2's configure(store_addr, ...)
    native: bool  # a torch group, not one of a fault-tolerance library (needs NativeGroup)


def pg_kind(pg: Any) -> PgKind:
    """Classify ``pg``; ``TypeError`` when it can be neither configured nor reconfigured."""
    try:
        reconf = bool(getattr(pg, "supports_reconfigure", False))
    except Exception:  # noqa: BLE001 - a torch binding may raise for a backend without it
        reconf = False
    reconf = reconf and callable(getattr(pg, "reconfigure", None)) and callable(
        getattr(pg, "get_reconfigure_handle", None))
    conf = callable(getattr(pg, "configure", None))
    if not (reconf or conf):
        raise TypeError(
            f"the Manager's process group {type(pg).__module__}.{type(pg).__qualname__} can be neither configured "
            "(torchft 0.2's configure()) nor reconfigured (supports_reconfigure is false or missing). Pass a "
            "rallypoint process group (rallypoint.process_groups.ProcessGroupGloo, ...NCCL, ...Baby*), a torchft "
            "one, or on torch >= 2.14 a torch group created with enable_reconfigure=True "
            "(dist.new_group(..., enable_reconfigure=True) / init_process_group(..., enable_reconfigure=True))")
    native = isinstance(pg, (dist.ProcessGroup, torch._C._distributed_c10d.Backend)) and not callable(
        getattr(pg, "errored", None))
    return PgKind(reconfigure=reconf, configure=conf, native=native)


@dataclass(frozen=True)
class Plan:
    """How to rebuild the group for one quorum: ``reconfigure`` from ``handles``, or ``configure``."""

    action: str  # "reconfigure" | "configure"
    handles: tuple[str, ...] = ()


def plan(kind: PgKind, handles: list[str], replica_ids: list[str], who: str) -> Plan:
    """The configure step for a quorum whose answer carries ``handles`` (one per member,
    in replica order, ``''`` for a member that sent none; possibly no list at all).

    Raises ValueError naming the replicas without a handle when the group can only be
    reconfigured and some are missing."""
    if not kind.reconfigure:
        return Plan("configure")
    if handles and len(handles) == len(replica_ids) and all(handles):
        return Plan("reconfigure", tuple(handles))
    if kind.configure:
        return Plan("configure")
    if not handles:
        missing = list(replica_ids) or ["(all)"]
        why = "the quorum answer carries no reconfigure handles (a lighthouse or ManagerServer without them)"
    elif len(handles) != len(replica_ids):
        missing = list(replica_ids)
        why = f"the quorum answer carries {len(handles)} handles for {len(replica_ids)} members"
    else:
        missing = [rid for rid, h in zip(replica_ids, handles) if not h]
        why = "they sent no reconfigure handle (torchft 0.2 peers?)"
    raise ValueError(
        f"{who}: cannot reconfigure the process group: replica(s) {', '.join(missing)}: {why}, and this group "
        "has no configure() to fall back to. Run every replica with a group that supports reconfigure "
        "(rallypoint's, torchft-nightly's) or give this one a rallypoint process group")


def quorum_accepts_handle(quorum: Callable[..., Any]) -> bool:
    """Whether a client's ``_quorum`` takes ``reconfigure_handle`` (a client without the
    field would reject it; the answer then carries no handles and ``plan`` falls back)."""
    try:
        params = inspect.signature(quorum).parameters
    except (TypeError, ValueError):
        return False
    return "reconfigure_handle" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class NativeGroup:
    """A torch process group as the Manager uses it: every attribute is the group's own,
    plus ``errored()`` (its backends' error state; None while healthy)."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    @property
    def supports_reconfigure(self) -> bool:
        return bool(self._pg.supports_reconfigure)

    @property
    def group(self) -> Any:
        """The torch group itself."""
        return self._pg

    def errored(self) -> Exception | None:
        """The first backend error state that is not SUCCESS, as an exception."""
        error_type = getattr(dist, "ErrorType", None) or getattr(torch._C._distributed_c10d, "ErrorType", None)
        if error_type is None:
            return None
        backends: list[Any] = []
        if isinstance(self._pg, dist.ProcessGroup):
            for device in getattr(self._pg, "_device_types", []):
                try:
                    backends.append(self._pg._get_backend(device))
                except RuntimeError:
                    continue
        else:
            backends.append(self._pg)
        for backend in backends:
            get_error = getattr(backend, "get_error", None)
            if get_error is None:
                continue
            try:
                err = get_error()
            except RuntimeError:
                continue
            if err != error_type.SUCCESS:
                return dist.DistBackendError(f"native process group error: {err}")
        return None

    def __repr__(self) -> str:
        return f"NativeGroup({self._pg!r})"


def adapt(pg: Any) -> tuple[Any, PgKind]:
    """``pg`` as the Manager holds it (a native torch group wrapped) and its kind."""
    kind = pg_kind(pg)
    return (NativeGroup(pg) if kind.native else pg), kind


class Configurer:
    """Sends the group's handle and rebuilds the group for each new quorum (see the module
    docstring). ``set_rank_info`` is passed on to groups that take it, once the replica id
    is known."""

    def __init__(self, pg: Any, kind: PgKind, group_rank: int, group_world_size: int, timeout: timedelta,
                 log: logging.Logger | logging.LoggerAdapter) -> None:
        self.pg, self.kind = pg, kind
        self.group_rank, self.group_world_size = group_rank, group_world_size
        self.timeout = timeout
        self.log = log
        self.replica_id = ""
        self.last_action = ""  # "configure" / "reconfigure": what the last new quorum used
        self.applied = 0  # how many times the group was rebuilt (once per new quorum id)
        #: per quorum function (a client's ``_quorum``, its ``leased_quorum``): takes a handle.
        #: Keyed by function, not one slot: a refused leased round and the quorum thread's call
        #: alternate every step, and inspecting a signature costs more than the round itself.
        self._accepts: dict[Any, bool] = {}

    def set_replica(self, replica_id: str, hostname: str | None = None) -> None:
        """This rank's replica id, passed on with ``set_rank_info`` to groups that take it;
        ``hostname`` (the Manager's) becomes the default address of a rallypoint group's
        handle store (``RALLYPOINT_PG_HOST`` still wins)."""
        self.replica_id = replica_id
        set_rank_info = getattr(self.pg, "set_rank_info", None)
        if self.kind.reconfigure and callable(set_rank_info):
            set_rank_info(replica_id, self.group_rank, self.group_world_size, None)
        set_handle_host = getattr(self.pg, "set_handle_host", None)
        if hostname and self.kind.reconfigure and callable(set_handle_host):
            set_handle_host(hostname)

    def prepare(self) -> None:
        """Make the handle now, at the Manager's start, not inside the first step: it opens
        a rallypoint group's handle store, a TCPStore server, and creating one stalled for
        5 s now and then on the 2-core test VM (about 1 in 50 under load; torch's own, a plain
        loopback socket does not), which the first quorum's timeout should not pay for. A failure
        is left for the first quorum to raise, as before."""
        if not self.kind.reconfigure:
            return
        try:
            self.handle()
        except Exception as e:  # noqa: BLE001 - the first quorum raises it where a round can fail
            self.log.debug("reconfigure handle not made at start: %s", e)

    def handle(self) -> str:
        """The handle to send with this quorum request (``''``: none)."""
        return str(self.pg.get_reconfigure_handle()) if self.kind.reconfigure else ""

    def quorum_kwargs(self, quorum: Callable[..., Any]) -> dict[str, Any]:
        """``reconfigure_handle=...`` for the quorum call, when there is one and the client takes it."""
        if not self.kind.reconfigure:
            return {}
        func = getattr(quorum, "__func__", quorum)  # inspected once per client function, not every step
        accepts = self._accepts.get(func)
        if accepts is None:
            if len(self._accepts) >= 8:  # bounded: a client rebuilt with fresh closures
                self._accepts.clear()
            accepts = self._accepts[func] = quorum_accepts_handle(quorum)
        if not accepts:
            return {}
        return {"reconfigure_handle": self.handle()}

    def apply(self, q: QuorumResult) -> str:
        """Rebuild the group for quorum ``q``; returns what was done (or raises)."""
        handles = list(getattr(q, "reconfigure_handles", None) or [])
        step = plan(self.kind, handles, list(q.replica_ids),
                    f"replica {self.replica_id} (group rank {self.group_rank}), quorum {q.quorum_id}")
        if step.action == "reconfigure":
            from rallypoint.process_groups.reconfigure import make_options

            self.log.info("reconfiguring for quorum %d from %d handles: replica rank %d/%d", q.quorum_id,
                          len(step.handles), q.replica_rank, q.replica_world_size)
            work = self.pg.reconfigure(make_options(q.quorum_id, list(step.handles), self.timeout))
            if work is not None and work.wait() is False:
                raise RuntimeError(f"reconfigure for quorum {q.quorum_id} did not complete")
        else:
            store = f"{q.store_address}/rallypoint/{q.quorum_id}/{self.group_rank}"
            self.log.info("reconfiguring for quorum %d: replica rank %d/%d, store %s, max_step %d", q.quorum_id,
                          q.replica_rank, q.replica_world_size, store, q.max_step)
            self.pg.configure(store, self.replica_id, q.replica_rank, q.replica_world_size, quorum_id=q.quorum_id,
                              group_rank=self.group_rank, group_world_size=self.group_world_size)
        self.last_action = step.action
        self.applied += 1
        return step.action


__all__ = ["Configurer", "NativeGroup", "PgKind", "Plan", "adapt", "pg_kind", "plan", "quorum_accepts_handle"]
