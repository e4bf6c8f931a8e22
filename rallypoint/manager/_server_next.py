"""The ManagerServer's side of the next round handed out with the commit vote (the why and
the rules: :mod:`rallypoint.manager._next_round`): a mixin of
:class:`~rallypoint.manager.server.ManagerServer`, which provides the attributes named in
:class:`NextRounds`'s annotations and :class:`~rallypoint.manager._server_lease.LeasedRounds`'
lease methods.

On the server's event loop, except :meth:`NextRounds.issued_local_quorum`, which group rank
0's own Manager calls on its training thread: it reads what the loop wrote at the last
decision, and the loop writes again only at the next decision, which needs that rank's vote.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import Quorum
from rallypoint.manager import rules
from rallypoint.manager._lease import ResultCache, leased_quorum, leased_result
from rallypoint.manager._next_round import encode_next, result_digest
from rallypoint.manager.recovery import QuorumResult

log = logging.getLogger("rallypoint.manager")

#: The most steps whose ranks' asks for a hand-out are kept (the lowest go first).
_KEEP_ASKS = 4


@dataclass(frozen=True)
class Issued:
    """The round handed out at the last passed vote: its step and the lease's quorum."""

    step: int
    base: Quorum


class NextRounds:
    """Handing out the next round with the vote (see the module's docstring)."""

    replica_id: str
    world_size: int
    _leasing: bool
    _hand_out: bool
    _stopped: threading.Event
    _metadata: dict[int, str]
    _issued: Issued | None = None
    _next_asks: dict[int, dict[int, bool]]  # step -> group rank -> asked for a hand-out with its vote
    _issued_stats: dict[int, dict[str, Any] | None]  # group rank -> step stats of the handed-out round
    #: group rank -> (the lease's quorum, that rank's result for a round of it): a result
    #: derived once per lease and rank (read and written on the loop and on group rank 0's
    #: training thread; a whole tuple is swapped, so a reader sees one or the other).
    _issued_results: ResultCache  # per group rank (see _lease.leased_result)

    def _take_lease(self, step: int, commit_failures: int, shrink_only: bool) -> Quorum | None: ...

    def _report_leased(self, step: int, ranks: list[rules.RankRequest], first_at: float) -> None: ...

    def _note_vote(self, rank: int, step: int, asks_next: bool, stats: dict[str, Any] | None) -> None:
        """Before ``rank``'s vote for ``step`` counts: whether it asks for the next round, and
        the step stats that ride the vote of a handed-out round."""
        asks = self._next_asks.setdefault(step, {})
        asks[rank] = asks_next
        while len(self._next_asks) > _KEEP_ASKS:  # bounded whatever steps the ranks vote for
            del self._next_asks[min(self._next_asks)]
        issued = self._issued
        if issued is not None and issued.step == step and stats is not None:
            self._issued_stats[rank] = stats

    def _decided(self, step: int, decision: bool) -> None:
        """The group decided ``step`` (CommitVotes calls this once, before any voter hears
        it): a handed-out round of that step is over (its stats go out); when the vote passed,
        every rank asked, and the lease serves the next step, that round is handed out now."""
        issued = self._issued
        if issued is not None and issued.step <= step:
            if issued.step == step:
                self._report_leased(step, [rules.RankRequest(g, False, 0, True, self._issued_stats.get(g))
                                           for g in range(self.world_size)], time.monotonic())
            self._issued, self._issued_stats = None, {}
        asks = self._next_asks.pop(step, {})
        if not decision or self.world_size < 2 or not self._leasing or not self._hand_out or self._stopped.is_set() \
                or len(asks) < self.world_size or not all(asks.values()):
            return
        base = self._take_lease(step + 1, 0, False)
        if base is not None:
            self._issued = Issued(step + 1, base)
            log.debug("[%s] round at step %d handed out with the vote on lease %d", self.replica_id, step + 1,
                      base.quorum_id)

    def _issued_result(self, rank: int, step: int) -> QuorumResult | None:
        """Group rank ``rank``'s result for the handed-out round at ``step``, if that is it."""
        issued = self._issued
        if issued is None or issued.step != step:
            return None
        return leased_result(self._issued_results, rank, issued.base, step, self.replica_id, rank, True)

    def _next_for(self, rank: int, step: int, decision: bool, asked: bool) -> str | None:
        """The :data:`~rallypoint.manager._next_round.NEXT_ROUND_KEY` value for ``rank``'s
        vote answer at ``step``, or None when no round was handed out to it."""
        if not (decision and asked):
            return None
        result = self._issued_result(rank, step + 1)
        return None if result is None else encode_next(step + 1, result_digest(result))

    def _issued_quorum(self, req: pb.ManagerQuorumRequest, stats: dict[str, Any] | None) -> Quorum | None:
        """A ``Quorum`` ask for the handed-out round gets its quorum (what every rank that
        took the hand-out uses); None for any other round. A ``shrink_only`` ask comes a
        round late: its peers have started this one."""
        issued = self._issued
        if issued is None or req.step != issued.step or req.commit_failures:
            return None
        if req.shrink_only:
            log.info("[%s] group rank %d asks shrink_only at step %d, a round handed out with the last vote: "
                     "it applies from the next round", self.replica_id, req.group_rank, req.step)
        if stats is not None:
            self._issued_stats[req.group_rank] = stats
        return leased_quorum(issued.base, issued.step)

    def issued_local_quorum(self, req: pb.ManagerQuorumRequest,
                            step_stats: dict[str, Any] | None = None) -> QuorumResult | None:
        """Group rank 0's round (this process's Manager) from the hand-out, on the calling
        thread, or None when it must go through the loop: not the handed-out round, a failed
        step, a ``shrink_only`` ask, or checkpoint metadata the server does not hold yet."""
        if self.world_size < 2 or req.commit_failures or req.shrink_only or self._stopped.is_set() \
                or self._metadata.get(req.group_rank) != req.checkpoint_metadata:
            return None
        result = self._issued_result(req.group_rank, req.step)
        if result is not None and step_stats is not None:
            self._issued_stats[req.group_rank] = step_stats
        return result


__all__ = ["Issued", "NextRounds"]
