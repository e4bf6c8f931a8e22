"""Moving a heal's state between replicas: serving it to the healing peers and fetching it
from the assigned source. The :class:`Manager` decides *when* (on the quorum thread, or on
the training thread at a safe point); this module only does the transfer.

Why what is served is a copy: training may change the state while the healing peer reads
it (served on the training thread inside ``should_commit``, the optimizer steps right
after the vote; a synchronous quorum's sender steps on through DiLoCo's sync delay;
BatchNorm buffers change during forward). A copy taken when it is served is what the peer
receives, whatever the sender does next. Our transports copy (HTTP) or finish before
returning (process group); another transport is given a copy (:func:`materialise`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch

from rallypoint.manager.client import ManagerClient
from rallypoint.manager.recovery import QuorumResult
from rallypoint.transports.base import CheckpointTransportLike


def materialise(tree: Any) -> Any:
    """A copy of every tensor in ``tree`` (dicts, lists, tuples; other leaves as they are),
    detached from autograd. DTensors stay DTensors (their local shard is copied), so the
    receiver can rebuild them on its own mesh."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: materialise(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [materialise(v) for v in tree]
    if isinstance(tree, tuple):
        items = [materialise(v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)  # namedtuple or tuple
    return tree


class Healer:
    """Serves and fetches heals through one checkpoint transport."""

    def __init__(self, transport: CheckpointTransportLike[dict[str, Any]], group_rank: int, timeout: timedelta,
                 connect_timeout: timedelta, log: logging.LoggerAdapter) -> None:
        self._transport = transport
        self._group_rank = group_rank
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._log = log

    def serve(self, q: QuorumResult, state: dict[str, Any]) -> None:
        """Offer ``state`` as step ``q.max_step`` to the replica ranks that heal from us.
        Training may change the state before the peer has it (a synchronous quorum's
        sender steps on through DiLoCo's sync delay; BatchNorm buffers change in forward),
        so a transport that does not copy or finish on its own (``copies_state``: ours
        do) serves a copy."""
        if not getattr(self._transport, "copies_state", False):
            state = materialise(state)
        self._log.info("serving step %d to replica ranks %s", q.max_step, list(q.recover_dst_replica_ranks))
        self._transport.send_checkpoint(
            dst_ranks=list(q.recover_dst_replica_ranks), step=q.max_step, state_dict=state, timeout=self._timeout,
        )

    def fetch(self, q: QuorumResult, into: Any = None, mesh: Any = None) -> dict[str, Any]:
        """The state of step ``q.max_step`` from our assigned source. ``into``: our current
        state (received tensors are verified, then copied into its matching tensors, and
        DTensors are rebuilt on its meshes); ``mesh``: the mesh for DTensors ``into`` lacks."""
        src = q.recover_src_replica_rank
        if src is None:
            raise RuntimeError(f"quorum {q.quorum_id} says heal but names no recovery source")
        self._log.info("healing to step %d from replica rank %d (%s)", q.max_step, src, q.recover_src_manager_address)
        with ManagerClient(q.recover_src_manager_address, connect_timeout=self._connect_timeout, fail_fast=True) as peer:
            meta = peer._checkpoint_metadata(self._group_rank, timeout=self._timeout)
        extra: dict[str, Any] = {}
        if into is not None:
            extra["into"] = into
        if mesh is not None:
            extra["mesh"] = mesh
        state = self._transport.recv_checkpoint(src_rank=src, metadata=meta, step=q.max_step, timeout=self._timeout,
                                                **extra)
        self._log.info("received the state of step %d", q.max_step)
        return state


__all__ = ["Healer", "materialise"]
