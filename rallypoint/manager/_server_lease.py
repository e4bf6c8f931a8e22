"""The ManagerServer's rounds answered from a quorum lease (``rallypoint/lighthouse/LEASES.md``),
and the one-rank group's fast path: a mixin of :class:`~rallypoint.manager.server.ManagerServer`,
which provides the attributes named in :class:`LeasedRounds`'s annotations.

A round of a group with several ranks is gathered on the server's event loop (every rank
must have asked) and then answered from the lease by :meth:`LeasedRounds._from_lease`.

A group of one rank has nothing to gather: its only rank is the server's own process
(group rank 0's Manager, bound to the server's key), so :meth:`LeasedRounds.leased_local_quorum`
answers its round on the calling thread, with the same lease rule, the same result
(:func:`~rallypoint.manager.recovery.compute_quorum_result`) and the same step reports as
the loop would, and without the two thread hand-offs (Manager thread to event loop and
back) that otherwise cost more than the rest of a small step. Whatever the lease does not
serve (no lease, a failed last step, a shrink, a revoke) returns None, and the round takes
the usual path to the lighthouse.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

from rallypoint._net.limits import MAX_REASON_BYTES, MAX_REPLICA_ID_BYTES
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LivenessStream, Quorum
from rallypoint.manager import rules
from rallypoint.manager._lease import LeaseHolder, ResultCache, StatsBatch, leased_quorum, leased_result
from rallypoint.manager._server_parts import QuorumRound
from rallypoint.manager.recovery import QuorumResult

log = logging.getLogger("rallypoint.manager")


class LeasedRounds:
    """Rounds answered from the lease the server holds (see the module's docstring)."""

    replica_id: str
    world_size: int
    _leasing: bool
    _lease: LeaseHolder
    _reports: StatsBatch
    _liveness: LivenessStream | None
    _on_lease_left: Callable[[str, str, int, int], None] | None
    _stopped: threading.Event
    _rounds: dict[int, QuorumRound]
    _rank_keys: dict[int, str]
    _local_key: str
    _metadata: dict[int, str]
    #: the lease's quorum, init_sync and the one-rank group's result derived from it
    _leased_results: ResultCache

    def _lease_revoked(self, msg: rpb.LeaseRevoke) -> None:
        """The lighthouse revoked leases up to ``msg.quorum_id`` (liveness thread). When a
        member left the lease, rounds of it past ``msg.after_step`` fail now (FailFast)."""
        reason = msg.reason[:MAX_REASON_BYTES]  # from the network: bounded before it is logged or relayed
        if self._lease.revoke(msg.quorum_id):
            log.info("[%s] lease of quorum %d revoked: %s", self.replica_id, msg.quorum_id, reason)
        if msg.replica_id and len(msg.replica_id) <= MAX_REPLICA_ID_BYTES and msg.replica_id != self.replica_id \
                and self._on_lease_left is not None:
            self._on_lease_left(msg.replica_id, reason, msg.quorum_id, msg.after_step)

    def _take_lease(self, step: int, commit_failures: int, shrink_only: bool) -> Quorum | None:
        """The lease's quorum as granted, when it serves the group's round at ``step``
        (the round's own is ``leased_quorum(quorum, step)``), or None (then the round asks
        the lighthouse, and the step reports gathered so far go out first)."""
        held = self._lease.held()
        quorum, why = self._lease.take_base(step, commit_failures, shrink_only)
        if quorum is None:
            if held:
                log.info("[%s] step %d asks the lighthouse instead of using lease %d: %s", self.replica_id, step,
                         held, why)
            rest = self._reports.flush()
            if rest is not None and self._liveness is not None:
                self._liveness.report(int(rest.get("step", step)), json.dumps(rest))
            return None
        log.debug("[%s] step %d starts on lease %d", self.replica_id, step, quorum.quorum_id)
        return quorum

    def _report_leased(self, step: int, ranks: list[rules.RankRequest], first_at: float) -> None:
        """The step stats of a round served by the lease go on the liveness stream (every
        ``report_every`` steps, summed in between: :class:`~rallypoint.manager._lease.StatsBatch`)."""
        if self._liveness is None:
            return
        group = rules.aggregate_requests(step, self.world_size, ranks, first_at, time.monotonic())
        for data in self._reports.add(group.data, step, self._lease.report_every):
            self._liveness.report(int(data.get("step", step)), json.dumps(data))

    def _from_lease(self, rnd: QuorumRound) -> bool:
        """Answer the gathered round ``rnd`` from the lease when the rule allows
        (``_lease.lease_refusal``); its step stats go on the liveness stream. False: the
        round asks the lighthouse. On the event loop."""
        if not self._leasing:
            return False
        commit_failures = max(r.commit_failures for r in rnd.requests.values())
        quorum = self._take_lease(rnd.step, commit_failures, any(r.shrink_only for r in rnd.requests.values()))
        if quorum is None:
            return False
        rnd.result.set_result(leased_quorum(quorum, rnd.step))
        self._report_leased(rnd.step, [rules.RankRequest(g, r.shrink_only, r.commit_failures, r.init_sync,
                                                         rnd.stats.get(g)) for g, r in rnd.requests.items()],
                            rnd.first_at)
        return True

    def leased_local_quorum(self, req: pb.ManagerQuorumRequest,
                            step_stats: dict[str, Any] | None = None) -> QuorumResult | None:
        """The round of a one-rank group answered from its lease on the calling thread (the
        group's only rank, in this process), or None when it must take the event loop's
        path: a group of several ranks, no lease held or the lease refuses the round, the
        rank not yet bound to this process (its first round binds it), a round of it still
        on the loop, or the server stopped. ``step_stats`` come from the caller's own
        Manager (the loop's path checks a remote rank's)."""
        if self.world_size != 1 or not self._leasing or req.group_rank != 0 or self._stopped.is_set() \
                or self._rounds or self._rank_keys.get(0) != self._local_key:
            return None
        base = self._take_lease(req.step, req.commit_failures, req.shrink_only)
        if base is None:
            return None
        now = time.monotonic()
        self._metadata[0] = req.checkpoint_metadata  # what a healing peer's CheckpointMetadata(0) reads
        self._report_leased(req.step, [rules.RankRequest(0, req.shrink_only, req.commit_failures, req.init_sync,
                                                         step_stats)], now)
        return leased_result(self._leased_results, 0, base, req.step, self.replica_id, 0, req.init_sync)


__all__ = ["LeasedRounds"]
