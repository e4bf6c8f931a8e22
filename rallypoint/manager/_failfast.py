"""Fail fast when a peer dies: the part of the ``Manager`` that records a step's errors
and aborts the cross-replica process group, so that collectives blocked on a dead peer
fail now instead of after the full collective timeout.

Two sources: the first collective error of a step (a work's ``wait``), and the
lighthouse's notice that a member of the current quorum died (the liveness stream on
group rank 0, relayed to the group's other ranks). The notice aborts only what can still
block on the dead peer -- this round's configure or heal (on the quorum thread or the
training thread), or a collective in flight --
so a peer that leaves after our collectives finished (a replica ending its job) does not
fail a step whose data is complete; a collective issued later in that round fails at
once instead of hanging. A peer that says goodbye while our collectives are still in
flight gets ``goodbye_grace_s`` before the abort: a goodbye comes between the peer's
steps, so it has done its part and ours normally finish within milliseconds (aborting at
once failed the last step of a replica a moment slower than its peers at the end of a job).

A mixin: :class:`rallypoint.manager.manager.Manager` owns the state it reads.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import Any

from rallypoint.manager.recovery import QuorumResult
from rallypoint.process_groups.protocols import ReconfigurableProcessGroup


GOODBYE_PREFIX = "goodbye:"  # the lighthouse's reason for a peer that left cleanly ("goodbye: <why>")


class FailFast:
    """Error recording and aborts of :class:`Manager` (see the module docstring)."""

    goodbye_grace_s = 2.0  # how long collectives in flight get to finish after a peer's clean goodbye

    _err_lock: threading.Lock
    _errored: Exception | None
    _aborted_quorum: int | None
    _quorum_id: int
    _step: int
    _pg: ReconfigurableProcessGroup
    _log: logging.LoggerAdapter
    _group_rank: int
    _relay: Any
    _replica_id: str
    _quorum_future: cf.Future | None
    _last_quorum: QuorumResult | None
    _quorum_round: int
    _round: int
    _works: list[Any]
    _works_lock: threading.Lock
    _lost_peer: tuple[int, Exception] | None
    _heal_busy: bool  # a heal is being served or fetched on the training thread

    def report_error(self, e: Exception) -> None:
        """Mark this step failed (it will not commit); the next quorum recovers."""
        with self._err_lock:
            if self._errored is None:
                self._log.warning("step %d error: %s", self._step, e)
                self._errored = e

    def errored(self) -> Exception | None:
        with self._err_lock:
            return self._errored

    def _on_peer_down(self, replica_id: str, reason: str) -> None:
        # Runs on the liveness thread (rank 0) or the relay thread (other ranks). Abort only
        # when the dead peer is in our quorum, so a blocked collective fails now instead of
        # after the full timeout.
        if self._group_rank == 0 and self._relay is not None:
            try:
                self._relay.publish(replica_id, reason)
            except Exception as e:  # noqa: BLE001
                self._log.warning("could not relay the loss of %s to the other group ranks: %s", replica_id, e)
        fut, q = self._quorum_future, self._last_quorum
        if fut is not None and not fut.done() and self._quorum_round != self._round:
            # This step's quorum is still being formed: the lighthouse leaves the dead peer out.
            self._log.info("peer %s is down (%s) while a quorum forms; not aborting", replica_id, reason)
            return
        if q is None or replica_id not in q.replica_ids or replica_id == self._replica_id:
            return
        err = ConnectionError(f"peer replica {replica_id} went down ({reason})")
        with self._works_lock:  # see the module docstring for what counts as busy
            self._lost_peer = (self._round, err)
            setup_busy = (fut is not None and not fut.done()) or self._heal_busy
            works_busy = any(not w.finished() for w in self._works)
        if works_busy and not setup_busy and reason.startswith(GOODBYE_PREFIX):
            # A clean goodbye comes between a peer's steps: it finished the collectives it
            # started, so its share of ours is sent and they are about to finish (a replica
            # ending its job a moment before a slower one). Abort only if they do not.
            rnd = self._round
            timer = threading.Timer(self.goodbye_grace_s, self._abort_if_busy, args=(rnd, err))
            timer.daemon = True
            timer.start()
            self._log.info("%s during this step's collectives; aborting if they have not finished in %gs",
                           err, self.goodbye_grace_s)
            return
        if setup_busy or works_busy:
            self._abort(err)
        else:
            self._log.info("%s after this step's collectives finished; a later collective of quorum %d fails fast",
                           err, self._quorum_id)

    def _abort(self, e: Exception) -> None:
        """Record ``e`` and abort the process group once per quorum, so that every
        collective blocked on it (ours and, through the closed connections, our peers')
        fails now. The next quorum has a new id (this step reports a commit failure), so
        the group is rebuilt before it is used again."""
        self.report_error(e)
        with self._err_lock:
            if self._aborted_quorum == self._quorum_id:
                return
            self._aborted_quorum = self._quorum_id
        self._log.warning("aborting the process group of quorum %d: %s", self._quorum_id, e)
        try:
            self._pg.abort()
        except Exception as ae:  # noqa: BLE001
            self._log.warning("process group abort failed: %s", ae)

    def _abort_if_busy(self, rnd: int, err: Exception) -> None:
        """After a goodbye's grace: abort if this round's collectives still have not finished
        (the peer left mid-step after all, e.g. from an exception handler)."""
        with self._works_lock:
            busy = self._round == rnd and any(not w.finished() for w in self._works)
        if busy:
            self._abort(err)

    def _comm_failed(self, e: Exception) -> None:
        """A collective failed or timed out (called from a work's ``wait``)."""
        self._abort(e)


__all__ = ["GOODBYE_PREFIX", "FailFast"]
