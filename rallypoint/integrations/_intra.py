"""The replica group's own process group: which one the DDP wrapper averages inside a
group over, and when it initialises torch's default group itself.

Why this exists: in a replica group of several ranks, the manager only pairs group rank
``g`` with group rank ``g`` of the other groups. The ranks of one group read different
data, so unless their gradients are also averaged inside the group they drift apart
silently. Plain torch DDP over all ranks averages over every rank; the wrapper does the
same by averaging over the group's ranks (this process group) and across groups (the
manager).

The decision is a pure function (:func:`plan_group`, table-tested) of what the caller
passed, what ``torch.distributed`` holds and the launch environment;
:func:`resolve_group` is the thin shell that reads that state and, when the plan says
so, initialises the default process group.

Initialising it: with no group given, no default group initialised and a replica group
of several ranks (the manager's ``group_world_size``, else ``WORLD_SIZE``), the wrapper
calls ``init_process_group`` itself (gloo, or NCCL for CUDA parameters) in the group's
TCPStore at ``MASTER_ADDR``/``MASTER_PORT``, the store the manager already requires for
a group of several ranks (``rallypoint run`` and torchrun host it). Its keys are under
``rallypoint/<TORCHELASTIC_RESTART_COUNT>/ddp``, so a restarted group never reads the
previous incarnation's keys, and they never meet the manager's own. Call
``torch.distributed.init_process_group`` yourself first for another backend or timeout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

log = logging.getLogger("rallypoint.integrations.ddp")

#: The timeout of a default process group the wrapper initialises (rendezvous and collectives).
INIT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class GroupPlan:
    """Which process group averages inside this replica group.

    ``source``: ``"alone"`` (a group of one rank: nothing to average inside it),
    ``"given"`` (the caller's ``process_group``), ``"default"`` (torch's initialised
    default group), ``"init"`` (initialise the default group, rank ``rank`` of
    ``world_size``, in the store at ``master``) or ``"cross"`` (no group to average
    inside and no store to make one in: across replica groups only, as torchft's
    wrapper does; the ranks of the group drift unless the caller averages inside it,
    and the wrapper warns)."""

    source: Literal["alone", "given", "default", "init", "cross"]
    world_size: int = 1
    rank: int = 0
    master: str | None = None


def _int(environ: Mapping[str, str], key: str) -> int | None:
    raw = environ.get(key)
    if raw in (None, ""):
        return None
    try:
        return int(raw)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a number") from None


def plan_group(given: tuple[int, int] | None, default: tuple[int, int] | None,
               manager: tuple[int | None, int | None], environ: Mapping[str, str]) -> GroupPlan:
    """Decide the group-internal process group.

    ``given``/``default``: ``(world_size, rank)`` of the caller's process group and of
    torch's default group (None when not given / not initialised); ``manager``: its
    ``(group_world_size, group_rank)`` where it says (torchft's Manager does not);
    ``environ``: ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
    Raises ``ValueError`` for a default group that is not this replica group's ranks.
    A group of several ranks with no store to initialise one in (ranks as threads of one
    process, a Manager given its store explicitly, as torchft's own tests do) averages
    across groups only (``cross``): refusing it would break code written for torchft's
    wrapper, which never averages inside the group."""
    m_world, m_rank = manager
    if given is not None:
        world, rank = given
        return GroupPlan("alone") if world == 1 else GroupPlan("given", world, rank)
    if default is not None:
        world, rank = default
        if m_world is not None and world != m_world:
            raise ValueError(
                f"torch.distributed's default process group has {world} rank(s) but the manager's replica group "
                f"has {m_world}: the wrapper averages inside the replica group over the default group, so it must "
                "hold exactly this group's ranks (or pass process_group= the group's own process group)"
            )
        if m_rank is not None and world > 1 and rank != m_rank:
            raise ValueError(
                f"this process is rank {rank} of the default process group but group rank {m_rank} of the manager: "
                "they must be the same (both come from torchrun's RANK)"
            )
        return GroupPlan("alone") if world == 1 else GroupPlan("default", world, rank)
    world = m_world if m_world is not None else (_int(environ, "WORLD_SIZE") or 1)
    if world == 1:
        return GroupPlan("alone")
    rank = m_rank if m_rank is not None else (_int(environ, "RANK") or 0)
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not addr or not port:
        return GroupPlan("cross", world, rank)
    return GroupPlan("init", world, rank, f"{addr}:{port}")


def _backend(module: torch.nn.Module) -> str:
    return "nccl" if any(p.is_cuda for p in module.parameters()) else "gloo"


def resolve_group(process_group: Any, manager: object, module: torch.nn.Module,
                  environ: Mapping[str, str] | None = None) -> tuple[Any, GroupPlan]:
    """The process group to average inside this replica group over (None: a group of
    one rank) and the plan that chose it; initialises torch's default group when the
    plan says so (see the module docstring)."""
    env = os.environ if environ is None else environ
    given = (process_group.size(), process_group.rank()) if process_group is not None else None
    initialised = dist.is_available() and dist.is_initialized()
    default = (dist.get_world_size(), dist.get_rank()) if initialised else None
    m_world, m_rank = getattr(manager, "group_world_size", None), getattr(manager, "group_rank", None)
    plan = plan_group(given, default, (None if m_world is None else int(m_world), None if m_rank is None else int(m_rank)),
                      env)
    if plan.source == "alone":
        return None, plan
    if plan.source == "cross":
        log.warning(
            "group rank %d of a replica group of %d ranks: torch.distributed is not initialised and there is no "
            "MASTER_ADDR/MASTER_PORT to initialise it in, so gradients are averaged across replica groups only and "
            "this group's ranks will drift apart unless you average inside the group yourself. Launch the group "
            "with `rallypoint run` or torchrun, or call torch.distributed.init_process_group over the group's "
            "ranks before wrapping the model", plan.rank, plan.world_size)
        return None, plan
    if plan.source == "given":
        return process_group, plan
    if plan.source == "init":
        assert plan.master is not None
        host, _, port = plan.master.rpartition(":")
        prefix = f"rallypoint/{env.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}/ddp"
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=INIT_TIMEOUT)
        backend = _backend(module)
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=plan.rank,
                                world_size=plan.world_size, timeout=INIT_TIMEOUT)
        log.info("initialised torch.distributed (%s, rank %d of %d) in the replica group's store at %s: "
                 "gradients are averaged inside the group over it", backend, plan.rank, plan.world_size, plan.master)
    return dist.group.WORLD, plan


__all__ = ["GroupPlan", "INIT_TIMEOUT", "plan_group", "resolve_group"]
