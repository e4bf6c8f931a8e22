"""The ManagerServer's commit votes: the ``ShouldCommit`` gRPC handler and the vote socket
(:mod:`rallypoint.manager._vote_socket`) share one path (:meth:`VoteCalls._decide_vote`),
so a vote is checked, claimed and counted alike whichever way it came; its checks (the
rank's range, the step stats, the rank claim) raise :class:`_Failure`, and the ``Quorum``
handler makes them too. A mixin of
:class:`~rallypoint.manager.server.ManagerServer`, which provides the attributes named in
:class:`VoteCalls`'s annotations; on the server's event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
from collections.abc import Callable
from typing import Any

import grpc

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.manager import rules
from rallypoint.manager._inprocess import _Failure
from rallypoint.manager._next_round import NEXT_ROUND_HEADER, NEXT_ROUND_KEY
from rallypoint.manager._server_parts import header as _header
from rallypoint.manager._vote_socket import PORT_KEY, VoteRequest, VoteSocketServer, advertise
from rallypoint.manager._votes import RANK_KEY_HEADER, CommitVotes, claim_rank, confirm_rank

log = logging.getLogger("rallypoint.manager")


class VoteCalls:
    """Commit votes and the rank claims they make (see the module docstring)."""

    replica_id: str
    world_size: int
    _votes: CommitVotes
    _rank_keys: dict[int, str]
    _published_key: Callable[[int], Any] | None
    _loop: asyncio.AbstractEventLoop | None
    _pool: cf.ThreadPoolExecutor
    _vote_socket: VoteSocketServer | None

    # From NextRounds (later in ManagerServer's bases, so declared here, not defined).
    _note_vote: Callable[[int, int, bool, dict[str, Any] | None], None]
    _next_for: Callable[[int, int, bool, bool], str | None]

    async def _should_commit(self, req: pb.ShouldCommitRequest, context: grpc.aio.ServicerContext) -> pb.ShouldCommitResponse:
        """``ShouldCommit`` over gRPC; a rallypoint server names its vote socket in the answer."""
        meta = {k: _header(context, k) for k in (NEXT_ROUND_HEADER, rules.STEP_STATS_HEADER, RANK_KEY_HEADER)}
        try:
            decision, trailing = await self._decide_vote(req.group_rank, req.step, req.should_commit, meta,
                                                         context.peer())
        except _Failure as f:
            await context.abort(f.code, f.message)
        if self._vote_socket is not None and self._vote_socket.port:
            trailing.append((PORT_KEY, advertise(self._vote_socket.port, self._vote_socket.instance)))
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return pb.ShouldCommitResponse(should_commit=decision)

    async def _decide_vote(self, rank: int, step: int, vote: bool, meta: dict[str, str | None],
                           peer: str) -> tuple[bool, list[tuple[str, str]]]:
        """One rank's vote from gRPC or the vote socket (:mod:`._vote_socket`): the checks
        (each refusal a :class:`_Failure`, before anything changes), the rank claim, the
        vote round; the decision and the answer's trailing metadata (a hand-out)."""
        self._rank_in_range(rank, "should_commit")
        asks_next = meta.get(NEXT_ROUND_HEADER) == "1"
        stats = self._checked_stats(meta.get(rules.STEP_STATS_HEADER), rank, "commit vote", peer) if asks_next else None
        await self._checked_claim(meta.get(RANK_KEY_HEADER), rank, "should_commit", peer)
        decision = await self._vote(rank, step, vote, asks_next, stats)
        handed = self._next_for(rank, step, decision, asks_next)
        return decision, ([(NEXT_ROUND_KEY, handed)] if handed is not None else [])

    async def _socket_vote(self, req: VoteRequest, peer: str) -> tuple[bool, list[tuple[str, str]]]:
        """A vote that came over the vote socket."""
        return await self._decide_vote(req.rank, req.step, req.vote, dict(req.meta), peer)

    async def _vote(self, rank: int, step: int, vote: bool, asks_next: bool = False,
                    stats: dict[str, Any] | None = None) -> bool:
        """One rank's commit vote for ``step``; the group's decision (raises :class:`_Failure`).
        ``asks_next``: the rank takes its next round from the answer (``_server_next.py``);
        ``stats``: the step stats of a handed-out round, which ride its vote."""
        self._note_vote(rank, step, asks_next, stats)
        return await self._votes.vote(rank, step, vote)

    @property
    def _commits(self) -> dict:
        """The undecided should_commit rounds, by step (read-only, for tests)."""
        return self._votes.rounds

    def _superseded(self, old: int, new: int) -> Exception:
        """Why a vote still waiting for ``old`` is released once ``new`` decided."""
        return _Failure(grpc.StatusCode.ABORTED,
                        f"replica {self.replica_id}: should_commit for step {old} superseded by step {new} "
                        "before every rank voted")

    def _bind_rank(self, rank: int, key: str | None, peer: str) -> str | None:
        """Whether the caller (``key``) may speak for ``rank``; binds a first key. Why not, or None."""
        why = claim_rank(self._rank_keys, rank, key)
        if why is None and key is not None and rank not in self._rank_keys:
            self._rank_keys[rank] = key
            log.debug("[%s] group rank %d is now bound to its caller's rank key (%s)", self.replica_id, rank, peer)
        return why

    async def _claim_why(self, key: str | None, rank: int, peer: str) -> str | None:
        """Why the caller (its rank key) may not speak for ``rank``, or None; binds a first
        key the group's store confirms (when the server can read it)."""
        why = None
        if self._published_key is not None and key is not None and rank not in self._rank_keys and self._loop:
            why = confirm_rank(await self._loop.run_in_executor(self._pool, self._published_key, rank), rank, key)
        return why or self._bind_rank(rank, key, peer)

    def _rank_in_range(self, rank: int, what: str) -> None:
        """A :class:`_Failure` (INVALID_ARGUMENT) unless ``rank`` is one of this group's."""
        if not 0 <= rank < self.world_size:
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}: group_rank {rank} is out of range for replica {self.replica_id} "
                           f"(group world size {self.world_size}); check the ranks' WORLD_SIZE")

    def _checked_stats(self, text: str | None, rank: int, call: str, peer: str) -> dict[str, Any] | None:
        """The caller's step stats, checked (None when it sent none, as torchft's clients
        never do); a :class:`_Failure` (INVALID_ARGUMENT) naming the bad field, before
        anything changes. ``call`` names the refused call in the log ("quorum", "commit vote")."""
        try:
            return rules.parse_step_stats(text)
        except ValueError as e:
            log.warning("[%s] refused %s for group rank %d from %s: %s", self.replica_id, call, rank, peer, e)
            raise _Failure(grpc.StatusCode.INVALID_ARGUMENT,
                           f"replica {self.replica_id}: bad {rules.STEP_STATS_HEADER} metadata: {e}") from None

    async def _checked_claim(self, key: str | None, rank: int, what: str, peer: str) -> None:
        """A :class:`_Failure` (PERMISSION_DENIED) unless the caller (its rank key) may
        speak for ``rank`` (:meth:`_claim_why`). Nothing else changes."""
        why = await self._claim_why(key, rank, peer)
        if why is not None:
            log.warning("[%s] refused %s for group rank %d from %s: %s", self.replica_id, what, rank, peer, why)
            raise _Failure(grpc.StatusCode.PERMISSION_DENIED, f"replica {self.replica_id}: {why}")


__all__ = ["VoteCalls"]
