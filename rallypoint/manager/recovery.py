"""Per-rank quorum results, as a pure function over plain data.

Given the quorum the lighthouse formed, :func:`compute_quorum_result` tells one rank of
one replica group where it stands: its replica rank, whether it must heal, from whom,
which healing replicas it must serve, and which TCPStore to use. No I/O, no clock:
the :class:`~rallypoint.manager.server.ManagerServer` is a thin shell around it.

The rules (docs/design.md, "The manager"), matching torchft 0.2.0's answers except where noted:

* members are ordered by ``replica_id``; ``replica_rank`` is the own index;
* ``max_step`` is the highest step; the members at ``max_step`` are the "max" set
  (``max_replica_rank`` = own index in it or ``None``; ``max_world_size`` = its size);
* the store of group rank ``g`` is that of the max-set member at ``g % len(max set)``;
* a member heals when its step is behind ``max_step``, or when ``max_step == 0``,
  ``init_sync`` is on and it is not the first member (so a fresh job starts from one
  copy). **Differs from torchft 0.2.0**, which picks that first copy per group rank
  (member ``g % n``): with groups of several ranks, group rank 0 of a replica would then
  start from one replica's initial state and group rank 1 from another's, so the ranks
  of one group would hold different models (a test found exactly that);
* ``reconfigure_handles`` (torchft 0.3): the handle of ``group_rank`` in every member, in
  replica order, ``''`` where a member sent none (as torchft-nightly's ManagerServer);
* the members that do not heal serve the healing ones in order, round-robin, starting
  at offset ``group_rank`` so that different group ranks load different sources (all
  sources are identical: they committed the same steps).
* **rallypoint's addition** (sent apart from torchft's answer, as trailing metadata that
  torchft's clients ignore: ``client.stripe_metadata``), for striped healing: a
  healing member also learns every source (``recover_src_replica_ranks`` /
  ``recover_src_manager_addresses``: its assigned source first, then the others in
  round-robin order after it), and every source learns every healing member
  (``stripe_dst_replica_ranks``), so a healer can fetch disjoint parts of the state from
  all of them at once and fall back to the others when one fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rallypoint._net.handles import handles_for_rank

if TYPE_CHECKING:  # plain data in, plain data out: no runtime dependency on the lighthouse
    from rallypoint.lighthouse.client import Member, Quorum


@dataclass(frozen=True)
class QuorumResult:
    """What one rank learns from a quorum (torchft's ``QuorumResult`` fields)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str] = field(default_factory=list)
    #: striped healing (rallypoint only): every source, the assigned one first
    recover_src_replica_ranks: list[int] = field(default_factory=list)
    recover_src_manager_addresses: list[str] = field(default_factory=list)
    #: striped healing: every healing member, for a source (it may fetch parts from us)
    stripe_dst_replica_ranks: list[int] = field(default_factory=list)
    #: fault injections for this replica group (rallypoint only; JSON, see manager/_inject.py)
    inject: bytes = b""
    #: torchft 0.3: this group rank's reconfigure handle in every member, in replica order
    #: (``''`` where a member sent none); see rallypoint/_net/handles.py
    reconfigure_handles: list[str] = field(default_factory=list)


def compute_quorum_result(quorum: Quorum, replica_id: str, group_rank: int, init_sync: bool = True) -> QuorumResult:
    """The result for ``group_rank`` of replica group ``replica_id`` in ``quorum``.

    Raises ``ValueError`` when ``replica_id`` is not a member, or the quorum is empty,
    or ``group_rank`` is negative.
    """
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank} (replica {replica_id})")
    members: list[Member] = sorted(quorum.members, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in members]
    try:
        replica_rank = ids.index(replica_id)
    except ValueError:
        raise ValueError(
            f"replica {replica_id!r} is not a member of quorum {quorum.quorum_id} (members: {ids}); "
            "the lighthouse answered a quorum without it; retry the quorum"
        ) from None

    max_step = max(m.step for m in members)
    at_max = [i for i, m in enumerate(members) if m.step == max_step]
    max_replica_rank = at_max.index(replica_rank) if replica_rank in at_max else None
    store_owner = at_max[group_rank % len(at_max)]

    force = init_sync and max_step == 0
    # The one copy a fresh job starts from: the same for every group rank.
    primary = at_max[0]
    healers = [i for i, m in enumerate(members) if m.step != max_step or (force and i != primary)]
    healer_set = set(healers)
    sources = [i for i in range(len(members)) if i not in healer_set]

    src_of: dict[int, int] = {}
    dsts_of: dict[int, list[int]] = {}
    for k, dst in enumerate(healers):
        src = sources[(k + group_rank) % len(sources)]
        src_of[dst] = src
        dsts_of.setdefault(src, []).append(dst)

    my_src = src_of.get(replica_rank)
    stripe: list[int] = []
    if my_src is not None:
        first = sources.index(my_src)
        stripe = [sources[(first + k) % len(sources)] for k in range(len(sources))]
    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(members),
        recover_src_manager_address=members[my_src].address if my_src is not None else "",
        recover_src_replica_rank=my_src,
        recover_dst_replica_ranks=list(dsts_of.get(replica_rank, [])),
        store_address=members[store_owner].store_address,
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(at_max),
        heal=my_src is not None,
        commit_failures=max(m.commit_failures for m in members),
        replica_ids=ids,
        recover_src_replica_ranks=stripe,
        recover_src_manager_addresses=[members[i].address for i in stripe],
        stripe_dst_replica_ranks=list(healers) if replica_rank in sources and healers else [],
        reconfigure_handles=handles_for_rank((m.reconfigure_handles for m in members), group_rank),
    )


__all__ = ["QuorumResult", "compute_quorum_result"]
