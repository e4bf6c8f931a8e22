"""The ManagerServer's in-process API: group rank 0's own ``Manager`` runs its quorum
and commit-vote calls on the server's event loop directly, with the same logic as the gRPC
methods and no gRPC round trip to itself. A mixin of
:class:`~rallypoint.manager.server.ManagerServer`, which provides the attributes named in
:class:`InProcessCalls`'s annotations."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Any

import grpc

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.manager import rules
from rallypoint.manager.recovery import QuorumResult


class _Failure(Exception):
    """A lighthouse failure to fan out to every waiting rank as one gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InProcessCalls:
    """``local_quorum`` / ``local_should_commit`` for ranks in the server's process."""

    replica_id: str
    world_size: int
    _loop: asyncio.AbstractEventLoop | None
    _stopped: threading.Event
    _local_key: str
    _rank_keys: dict[int, str]

    def _join_quorum(self, req: pb.ManagerQuorumRequest, remaining: float | None,
                     stats: dict[str, Any] | None = None) -> Any: ...

    def _vote(self, rank: int, step: int, vote: bool, asks_next: bool = False,
              stats: dict[str, Any] | None = None) -> Any: ...

    def _bind_rank(self, rank: int, key: str | None, peer: str) -> str | None: ...

    def _call_local(self, coro: Any, timeout: float, what: str) -> Any:
        """Run a round coroutine on the server's loop for a rank in this process: the
        same logic as the gRPC methods without a gRPC round trip to ourselves."""
        if self._loop is None or self._stopped.is_set():
            coro.close()
            raise ConnectionError(f"{what}: the manager server of replica {self.replica_id} is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            fut.cancel()  # withdraws this rank from the round
            raise TimeoutError(f"{what} at replica {self.replica_id} timed out after {timeout:.1f}s") from None
        except _Failure as f:
            if f.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{what}: {f.message}") from None
            if f.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise ValueError(f"{what}: {f.message}") from None
            if f.code == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionError(f"{what}: {f.message}") from None
            raise ConnectionError(f"{what} failed ({f.code.name}): {f.message}") from None

    def local_quorum(self, req: pb.ManagerQuorumRequest, timeout: float,
                     step_stats: dict[str, Any] | None = None) -> QuorumResult:
        """``Quorum`` for a rank in this process (group rank 0's manager), with its step
        stats (checked as the metadata is: ``ValueError`` naming the field, nothing changes)."""
        if not 0 <= req.group_rank < self.world_size:
            raise ValueError(f"group rank {req.group_rank} is not in replica group {self.replica_id} of {self.world_size}")
        what = f"quorum for group rank {req.group_rank} at step {req.step}"
        try:
            stats = None if step_stats is None else rules.parse_step_stats(rules.encode_step_stats(step_stats))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: bad step stats: {e}") from None
        return self._call_local(self._as_local(req.group_rank, self._join_quorum(req, timeout, stats)), timeout, what)

    def local_should_commit(self, rank: int, step: int, vote: bool, timeout: float) -> bool:
        """``ShouldCommit`` for a rank in this process. A group of one rank decides on
        the calling thread: its own vote is the whole group's, and its rank is bound to this
        process, so no other caller can vote for it. In a larger group this rank always
        asks for the next round to be handed out (``_server_next.py``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"group rank {rank} is not in replica group {self.replica_id} of {self.world_size}")
        if self.world_size == 1 and self._rank_keys.get(0) == self._local_key and not self._stopped.is_set():
            return vote
        return self._call_local(self._as_local(rank, self._vote(rank, step, vote, True)), timeout,
                                f"should_commit of group rank {rank} at step {step}")

    async def _as_local(self, rank: int, coro: Any) -> Any:
        """``coro`` on behalf of ``rank`` of this process (bound to the server's own key)."""
        why = self._bind_rank(rank, self._local_key, "this process")
        if why is not None:
            coro.close()
            raise _Failure(grpc.StatusCode.PERMISSION_DENIED, f"replica {self.replica_id}: {why}")
        return await coro
