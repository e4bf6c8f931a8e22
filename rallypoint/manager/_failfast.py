"""Fail fast when a peer dies: the component of the ``Manager`` that records a step's
errors and aborts the cross-replica process group, so that collectives blocked on a dead
peer fail now instead of after the full collective timeout.

Two sources: the first collective error of a step (a work's ``wait``), and the
lighthouse's notice that a member of the current quorum died (the liveness stream on
group rank 0, relayed to the group's other ranks). The notice aborts only what can still
block on the dead peer -- this round's configure or heal (on the quorum thread or the
training thread), or a collective in flight --
so a peer that leaves after our collectives finished (a replica ending its job) does not
fail a step whose data is complete; a collective issued later in that round, or in a later
round of the same quorum (the lease's next step, or a round handed out with the vote just
before the notice), fails at once instead of hanging. A peer that says goodbye while our collectives are still in
flight gets ``goodbye_grace_s`` before the abort: a goodbye comes between the peer's
steps, so it has done its part and ours normally finish within milliseconds (aborting at
once failed the last step of a replica a moment slower than its peers at the end of a job).

Why a component with its own state: the notice arrives on another thread at any moment,
and what it may abort depends on a handful of facts about the current round (has its
quorum arrived, is the quorum thread still setting up, which collectives are in flight).
The Manager tells this object those facts as they happen (:meth:`new_round`,
:meth:`quorum_arrived`, :meth:`setup_done`, :meth:`add_work`); everything the decision
reads lives here, under one lock, so it can be tested without a Manager.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

from rallypoint.process_groups.protocols import ReconfigurableProcessGroup


GOODBYE_PREFIX = "goodbye:"  # the lighthouse's reason for a peer that left cleanly ("goodbye: <why>")


class FailFast:
    """A round's errors, its collectives in flight and the aborts (see the module docstring).

    ``on_error(e)`` is called once per round with the round's first error (the Manager
    notes it in the round's record)."""

    goodbye_grace_s = 2.0  # how long collectives in flight get to finish after a peer's clean goodbye

    def __init__(self, pg: ReconfigurableProcessGroup, log: logging.LoggerAdapter, replica_id: str,
                 timeout: timedelta, on_error: Callable[[Exception, str | None], None] | None = None) -> None:
        self.pg = pg
        self.log = log
        self.replica_id = replica_id
        self.timeout = timeout  # a work's wait bound (ManagedWork reads it)
        self._on_error = on_error
        self._lock = threading.Lock()
        self._errored: Exception | None = None
        self._aborted_quorum: int | None = None
        self.quorum_id = -1  # the quorum the process group is configured for
        self._members: Sequence[str] = ()  # the replica ids of the last quorum that arrived
        self._round = 0
        self._step = 0
        self._arrived = False  # this round's quorum has arrived
        self._setup_busy = False  # the quorum thread is still working on this round
        self.heal_busy = False  # a heal is being served or fetched on the training thread
        self._works: list[Any] = []
        # (round, why): a quorum member died this round. Not derivable from _left: a notice
        # landing after the round's quorum arrived but before quorum_id moved to it (the
        # quorum thread sets quorum_id just after quorum_arrived) files its _left entry under
        # the previous quorum id; this still refuses the round's collectives.
        self._lost_peer: tuple[int, Exception] | None = None
        # (quorum_id, replica_id, after_step, why): that member takes part in no round of that
        # quorum past after_step (it left a lease, or died while a round was being answered).
        self._left: dict[tuple[int, str], tuple[int, Exception]] = {}

    # ------------------------------------------------------------------ round facts
    def new_round(self, rnd: int, step: int) -> None:
        """A round begins (``start_quorum``): no error, no collective, the quorum pending."""
        with self._lock:
            self._errored = None
            self._works = []
            self._round, self._step = rnd, step
            self._arrived = False
            self._setup_busy = True

    def quorum_arrived(self, replica_ids: Sequence[str]) -> None:
        with self._lock:
            self._members = tuple(replica_ids)
            self._arrived = True

    def setup_done(self) -> None:
        """The quorum thread finished this round's part (quorum, configure, heal)."""
        with self._lock:
            self._setup_busy = False

    def add_work(self, post: Callable[[], Any]) -> Any:
        """Post a collective with ``post()`` and track it, unless a quorum member already
        died this round (then the step fails now: the collective could never finish).
        Returns the work, or None when nothing was posted (the failure is recorded)."""
        # One lock hold from the check to the append: a notice is handled either before
        # (the post is refused) or after (it sees the work in flight and aborts it).
        err: Exception | None = None
        work = None
        with self._lock:
            lost = self._lost_peer
            left = self._left_error()
            if left is not None:
                err = left  # a member left this round's lease: this collective cannot finish
            elif lost is not None and lost[0] == self._round:
                err = lost[1]  # a quorum member is gone: this collective cannot finish
            else:
                try:
                    work = post()
                except Exception as e:  # noqa: BLE001
                    err = e
                else:
                    self._works.append(work)
        if err is not None:
            self.comm_failed(err)
        return work

    def works(self) -> list[Any]:
        with self._lock:
            return list(self._works)

    # ------------------------------------------------------------------ errors
    def report_error(self, e: Exception, cause: str | None = None) -> None:
        """Mark this step failed (it will not commit); the next quorum recovers. ``cause``:
        why, when the caller knows (``comm``, ``peer_down``; see ``_record.cause_of``)."""
        with self._lock:
            if self._errored is not None:
                return
            self._errored = e
            step = self._step
        self.log.warning("step %d error: %s", step, e)
        if self._on_error is not None:
            self._on_error(e, cause)

    def errored(self) -> Exception | None:
        with self._lock:
            return self._errored

    def peer_down(self, replica_id: str, reason: str) -> None:
        """The lighthouse says ``replica_id`` died. Runs on the liveness thread (rank 0) or
        the relay thread (other ranks). Aborts only when the dead peer is in our quorum
        and something of this round can still block on it."""
        with self._lock:
            if self._setup_busy and not self._arrived:
                # This step's quorum is still being formed: the lighthouse leaves the dead peer out.
                # A quorum answered from a lease just before its revoke still has it: then
                # this round's collectives (same quorum id) fail at once instead of hanging.
                if replica_id in self._members and replica_id != self.replica_id:
                    self._note_left(self.quorum_id, replica_id, -1,
                                    ConnectionError(f"peer replica {replica_id} went down ({reason})"))
                self.log.info("peer %s is down (%s) while a quorum forms; not aborting", replica_id, reason)
                return
            if replica_id not in self._members or replica_id == self.replica_id:
                return
            err = ConnectionError(f"peer replica {replica_id} went down ({reason})")
            self._lost_peer = (self._round, err)
            # A later round of this quorum (the lease's next step, or a round handed out
            # with this round's vote before the notice) still has the dead peer: its
            # collectives fail at once instead of waiting out the timeout.
            self._note_left(self.quorum_id, replica_id, -1, err)
            setup_busy = self._setup_busy or self.heal_busy
            works_busy = any(not w.finished() for w in self._works)
            rnd, quorum_id = self._round, self.quorum_id
        if works_busy and not setup_busy and reason.startswith(GOODBYE_PREFIX):
            # A clean goodbye comes between a peer's steps: it finished the collectives it
            # started, so its share of ours is sent and they are about to finish (a replica
            # ending its job a moment before a slower one). Abort only if they do not.
            timer = threading.Timer(self.goodbye_grace_s, self._abort_if_busy, args=(rnd, err))
            timer.daemon = True
            timer.start()
            self.log.info("%s during this step's collectives; aborting if they have not finished in %gs",
                          err, self.goodbye_grace_s)
            return
        if setup_busy or works_busy:
            self.abort(err, "peer_down")
        else:
            self.log.info("%s after this step's collectives finished; a later collective of quorum %d (in this "
                          "round or a later one) fails fast", err, quorum_id)

    def _left_error(self) -> Exception | None:
        """The error of a member that left this round's lease (see :meth:`left_lease`), or
        None. Called with the lock held."""
        if not self._left or not self._arrived:
            return None
        for (quorum_id, replica_id), (after_step, err) in self._left.items():
            if quorum_id == self.quorum_id and self._step > after_step and replica_id in self._members:
                return err
        return None

    def _note_left(self, quorum_id: int, replica_id: str, after_step: int, err: Exception) -> None:
        """Remember that ``replica_id`` is in no round of ``quorum_id`` past ``after_step``
        (lock held). Only the last few quorums matter: a later quorum has a new id."""
        self._left[(quorum_id, replica_id)] = (after_step, err)
        while len(self._left) > 16:
            del self._left[next(iter(self._left))]

    def left_lease(self, replica_id: str, reason: str, quorum_id: int, after_step: int) -> None:
        """The lighthouse says ``replica_id`` takes part in no round of the lease of
        ``quorum_id`` past step ``after_step`` (it asked for a quorum itself). A round of
        that lease past that step can never finish its collectives: one in flight is
        aborted, one not yet posted fails when it is (whichever order the notice and the
        round's quorum arrive in)."""
        err = ConnectionError(f"peer replica {replica_id} left the lease of quorum {quorum_id} after step "
                              f"{after_step} ({reason})")
        with self._lock:
            self._note_left(quorum_id, replica_id, after_step, err)
            now = self._left_error()
            busy = now is not None and any(not w.finished() for w in self._works)
        if busy:
            self.abort(err, "peer_down")
        elif now is not None:
            self.log.info("%s; this round's collectives fail when posted", err)

    def abort(self, e: Exception, cause: str | None = None) -> None:
        """Record ``e`` and abort the process group once per quorum, so that every
        collective blocked on it (ours and, through the closed connections, our peers')
        fails now. The next quorum has a new id (this step reports a commit failure), so
        the group is rebuilt before it is used again."""
        self.report_error(e, cause)
        with self._lock:
            if self._aborted_quorum == self.quorum_id:
                return
            self._aborted_quorum = quorum_id = self.quorum_id
        self.log.warning("aborting the process group of quorum %d: %s", quorum_id, e)
        try:
            self.pg.abort()
        except Exception as ae:  # noqa: BLE001
            self.log.warning("process group abort failed: %s", ae)

    def _abort_if_busy(self, rnd: int, err: Exception) -> None:
        """After a goodbye's grace: abort if this round's collectives still have not finished
        (the peer left mid-step after all, e.g. from an exception handler)."""
        with self._lock:
            busy = self._round == rnd and any(not w.finished() for w in self._works)
        if busy:
            self.abort(err, "peer_down")

    def comm_failed(self, e: Exception) -> None:
        """A collective failed or timed out (called from a work's ``wait``)."""
        self.abort(e, "peer_down" if isinstance(e, ConnectionError) and "went down" in str(e) else "comm")


__all__ = ["GOODBYE_PREFIX", "FailFast"]
