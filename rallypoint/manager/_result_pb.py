"""A quorum result and torchft's ``ManagerQuorumResponse``, both ways (the fields torchft's
wire carries; rallypoint's additions travel as trailing metadata: see ``client.py``)."""

from __future__ import annotations

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.manager.recovery import QuorumResult


def result_from_pb(resp: pb.ManagerQuorumResponse) -> QuorumResult:
    """The result one rank reads from a ``ManagerQuorumResponse``."""
    return QuorumResult(
        quorum_id=resp.quorum_id,
        replica_rank=resp.replica_rank,
        replica_world_size=resp.replica_world_size,
        recover_src_manager_address=resp.recover_src_manager_address,
        recover_src_replica_rank=resp.recover_src_replica_rank if resp.HasField("recover_src_replica_rank") else None,
        recover_dst_replica_ranks=list(resp.recover_dst_replica_ranks),
        store_address=resp.store_address,
        max_step=resp.max_step,
        max_replica_rank=resp.max_replica_rank if resp.HasField("max_replica_rank") else None,
        max_world_size=resp.max_world_size,
        heal=resp.heal,
        commit_failures=resp.commit_failures,
        replica_ids=list(resp.replica_ids),
        reconfigure_handles=list(resp.reconfigure_handles),
    )


def result_to_pb(r: QuorumResult) -> pb.ManagerQuorumResponse:
    """``r`` as torchft's ``ManagerQuorumResponse`` (its striping and injections are not in it)."""
    msg = pb.ManagerQuorumResponse(
        quorum_id=r.quorum_id,
        recover_src_manager_address=r.recover_src_manager_address,
        recover_dst_replica_ranks=r.recover_dst_replica_ranks,
        store_address=r.store_address,
        max_step=r.max_step,
        max_world_size=r.max_world_size,
        replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size,
        heal=r.heal,
        commit_failures=r.commit_failures,
        replica_ids=r.replica_ids,
        reconfigure_handles=r.reconfigure_handles,
    )
    if r.recover_src_replica_rank is not None:
        msg.recover_src_replica_rank = r.recover_src_replica_rank
    if r.max_replica_rank is not None:
        msg.max_replica_rank = r.max_replica_rank
    return msg


__all__ = ["result_from_pb", "result_to_pb"]
