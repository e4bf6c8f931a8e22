"""``LocalManagerClient``: the rank that hosts the group's ``ManagerServer`` (group rank 0)
calls the server's rounds in process instead of making a gRPC round trip to itself,
which costs a few milliseconds of every step. Same rules, same errors as the wire."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from rallypoint._net.rpc import seconds
from rallypoint.manager.client import quorum_request
from rallypoint.manager.recovery import QuorumResult
from rallypoint.manager.server import ManagerServer


class LocalManagerClient:
    """``ManagerClient``'s calls for the rank that hosts the server (group rank 0):
    the same rounds, reached through the server's event loop instead of a gRPC round
    trip to itself (which costs a few milliseconds of every step)."""

    def __init__(self, server: ManagerServer) -> None:
        self._server = server
        self.addr = server.address()
        self.taken = 0  # rounds started from a hand-out (for tests and benchmarks)

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: float | timedelta,
        commit_failures: int = 0,
        init_sync: bool = True,
        step_stats: dict[str, Any] | None = None,
        reconfigure_handle: str = "",
    ) -> QuorumResult:
        """``ManagerClient._quorum``, in process; ``step_stats`` are checked as the
        metadata is (``ValueError`` naming the field)."""
        req = quorum_request(group_rank, step, checkpoint_metadata, shrink_only, commit_failures, init_sync,
                             reconfigure_handle)
        return self._server.local_quorum(req, seconds(timeout), step_stats=step_stats)

    def leased_quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        commit_failures: int = 0,
        init_sync: bool = True,
        step_stats: dict[str, Any] | None = None,
        reconfigure_handle: str = "",
    ) -> QuorumResult | None:
        """The round answered from the group's lease on this thread, or None when it must
        go through :meth:`_quorum`: a one-rank group's lease (see
        :meth:`~rallypoint.manager.server.ManagerServer.leased_local_quorum`), or in a
        larger group the round handed out with the last vote
        (:meth:`~rallypoint.manager.server.ManagerServer.issued_local_quorum`), which keeps
        its ``step_stats`` for the report at its decision."""
        req = quorum_request(group_rank, step, checkpoint_metadata, shrink_only, commit_failures, init_sync,
                             reconfigure_handle)
        if self._server.world_size == 1:
            return self._server.leased_local_quorum(req, step_stats)
        result = self._server.issued_local_quorum(req, step_stats)
        if result is not None:
            self.taken += 1
        return result

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: float | timedelta) -> bool:
        """``ManagerClient.should_commit``, in process."""
        return self._server.local_should_commit(group_rank, step, should_commit, seconds(timeout))

    def close(self) -> None:
        """Nothing to release: the server belongs to the manager."""


__all__ = ["LocalManagerClient"]
