"""The environment of each rank, as a pure function (torchrun's variables plus
rallypoint's), and the per-rank log prefix.

What a rank sees, with ``--nproc-per-node P`` on each of ``--nnodes N`` nodes, this node
being the group's node ``G`` (``GROUP_RANK``):

- torchrun's: ``LOCAL_RANK`` (0..P-1), ``RANK`` = ``ROLE_RANK`` = G*P + ``LOCAL_RANK``,
  ``WORLD_SIZE`` = ``ROLE_WORLD_SIZE`` = N*P, ``LOCAL_WORLD_SIZE`` = P, ``GROUP_RANK`` G,
  ``GROUP_WORLD_SIZE`` N, ``ROLE_NAME`` ``default``, ``TORCHELASTIC_RUN_ID`` (the
  rendezvous id, multi-node only), ``MASTER_ADDR`` / ``MASTER_PORT`` (the group's store,
  hosted by the supervisor of node 0), ``TORCHELASTIC_RESTART_COUNT`` (the incarnation: 0, 1, ...; the
  Manager's store keys are prefixed by it), ``TORCHELASTIC_MAX_RESTARTS``, and
  ``TORCHELASTIC_USE_AGENT_STORE=True`` so that ``torch.distributed.init_process_group``
  (env://) connects to that store instead of hosting one on ``MASTER_PORT``;
  ``OMP_NUM_THREADS=1`` when unset and N > 1, as torchrun does.
- rallypoint's: ``REPLICA_GROUP_ID`` (``--replica-group-id``), ``RALLYPOINT_LIGHTHOUSE``
  (``--lighthouse``; also ``TORCHFT_LIGHTHOUSE`` when that is unset, for torchft's own
  Manager), ``RALLYPOINT_SUPERVISOR_PROGRESS`` (the file the Manager writes its committed
  step to) and ``RALLYPOINT_SUPERVISOR_FD`` (the read end of the supervisor's lifeline;
  see ``_rank.py``). ``PYTHONUNBUFFERED=1`` when unset, so each rank's lines reach the
  prefixed log as they are printed.
- everything else of the supervisor's environment as it is (``RALLYPOINT_TOKEN``,
  ``RALLYPOINT_TLS_*``, ``CUDA_VISIBLE_DEVICES``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PROGRESS_ENV = "RALLYPOINT_SUPERVISOR_PROGRESS"
LIFELINE_ENV = "RALLYPOINT_SUPERVISOR_FD"
READY_ENV = "RALLYPOINT_STANDBY_READY"  # a standby creates this file once its imports are done


@dataclass(frozen=True)
class GroupSpec:
    """The fixed facts of one replica group under ``rallypoint run``."""

    nproc: int
    master_addr: str
    master_port: int
    group_id: str | None = None
    lighthouse: str | None = None
    max_restarts: int = 0
    nnodes: int = 1
    group_rank: int = 0  # this node's rank among the group's nodes
    run_id: str | None = None  # the rendezvous id (multi-node groups)


def rank_env(
    base: Mapping[str, str],
    spec: GroupSpec,
    rank: int,
    incarnation: int,
    progress_path: str | None = None,
    lifeline_fd: int | None = None,
) -> dict[str, str]:
    """The environment of ``rank`` in ``incarnation`` (see the module docstring)."""
    env = dict(base)
    n, world = str(spec.nproc), str(spec.nproc * spec.nnodes)
    g = str(spec.group_rank * spec.nproc + rank)
    env.update({
        "RANK": g, "LOCAL_RANK": str(rank), "ROLE_RANK": g,
        "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": n, "ROLE_WORLD_SIZE": world,
        "GROUP_RANK": str(spec.group_rank), "GROUP_WORLD_SIZE": str(spec.nnodes), "ROLE_NAME": "default",
        "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(incarnation),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    })  # fmt: skip
    if spec.run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = spec.run_id
    if spec.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if spec.group_id is not None:
        env["REPLICA_GROUP_ID"] = spec.group_id
    if spec.lighthouse is not None:
        env["RALLYPOINT_LIGHTHOUSE"] = spec.lighthouse
        env.setdefault("TORCHFT_LIGHTHOUSE", spec.lighthouse)
    env.pop(READY_ENV, None)
    for key, value in ((PROGRESS_ENV, progress_path), (LIFELINE_ENV, lifeline_fd)):
        if value is None:
            env.pop(key, None)  # never a stale one from an outer supervisor
        else:
            env[key] = str(value)
    return env


def log_prefix(group_id: str | None, rank: int | str) -> str:
    """``[g<ID> r<rank>] `` (``[r<rank>] `` without a group id) before each line of a rank;
    a name instead of a rank (``store``) for the supervisor's other children."""
    who = f"r{rank}" if isinstance(rank, int) else rank
    return f"[g{group_id} {who}] " if group_id is not None else f"[{who}] "


__all__ = ["LIFELINE_ENV", "PROGRESS_ENV", "READY_ENV", "GroupSpec", "log_prefix", "rank_env"]
