"""The lighthouse's mutable state, bound to one asyncio event loop.

All methods run on the loop thread, so no locks are needed. The decision itself is
:func:`rallypoint.lighthouse.quorum.decide`; this module only keeps the inputs up to
date, calls it whenever they change (and at the next deadline it reports), answers
waiters when a quorum forms, persists what must survive a restart and feeds metrics.

It also feeds the straggler scorer (:mod:`rallypoint.lighthouse.stragglers`) with the
step timings each Quorum request carries, and hands its exclusions (``--stragglers
evict``) to ``decide``. That state is held in memory only: a restarted lighthouse scores
from empty windows, at the cost of a few steps of evidence, and nothing a straggler did
outlives the process that judged it. The same step timings, with joins, deaths, evictions and
quorums, feed the goodput ledger (:mod:`rallypoint.lighthouse.ledger`), which is saved in the
state file and survives a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from rallypoint._net.ratelog import Throttle
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse import leases as ls
from rallypoint.lighthouse import quorum as q
from rallypoint.lighthouse import stragglers as sg
from rallypoint.lighthouse._scoring import Scoring
from rallypoint.lighthouse._ledger_store import GoodputBook
from rallypoint.lighthouse.checkpoints import CheckpointBook
from rallypoint.lighthouse.injections import InjectionDesk
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse.owners import OwnerDesk
from rallypoint.lighthouse.state import MEMORY, StateStore
from rallypoint.lighthouse.validate import member_to_pb

log = logging.getLogger("rallypoint.lighthouse")

# How often expired heartbeats are swept and reported, at most.
_SWEEP_INTERVAL = 0.5
# How long a quorum with a new quorum_id waits for the state file before it is answered.
_PERSIST_TIMEOUT = 2.0
# Malformed step_stats are logged (at debug) at most this often: every step could bring one.
_BAD_STATS_LOG_INTERVAL = 60.0


def _answer(waiters: list[asyncio.Future], payload: bytes) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(payload)


class ReplicaDead(Exception):
    """Raised into a pending Quorum request whose replica was declared dead."""


#: Pushes waiting for one replica's stream. A replica that lets this many pile up is
#: not reading: its stream is dropped rather than buffered without bound.
OUTBOX_LIMIT = 1024


@dataclass
class _Attachment:
    """One open Attach stream; ``outbox`` carries pushes to that replica; ``overflow`` is
    set when they exceeded :data:`OUTBOX_LIMIT` (the stream handler then drops it)."""

    replica_id: str
    address: str
    leases: bool = False  # its hello said it takes quorum leases
    outbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=OUTBOX_LIMIT))
    overflow: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, msg: object) -> None:
        try:
            self.outbox.put_nowait(msg)
        except asyncio.QueueFull:
            if not self.overflow.is_set():
                log.warning("[%s] liveness stream has %d unread notices: dropping it", self.replica_id, OUTBOX_LIMIT)
            self.overflow.set()


def quorum_to_pb(quorum: q.Quorum) -> pb.Quorum:
    msg = pb.Quorum(quorum_id=quorum.quorum_id, participants=[member_to_pb(m) for m in quorum.members])
    secs = int(quorum.created)
    msg.created.seconds = secs
    msg.created.nanos = int((quorum.created - secs) * 1e9)
    return msg


class LighthouseCore(Scoring):
    """Heartbeats, pending requests, the previous quorum and the attached streams."""

    def __init__(
        self,
        options: q.Options,
        store: StateStore,
        metrics: LighthouseMetrics,
        *,
        quorum_tick: float | None = None,
        forget_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        stragglers: sg.Policy | None = None,
        leases: bool = True,
    ) -> None:
        self.options = options
        self.store = store
        self.metrics = metrics
        self._tick = quorum_tick
        self._forget_after = forget_after if forget_after is not None else 10 * options.heartbeat_timeout
        self._clock = clock
        self._wall = wall
        restored = store.restore()
        self.quorum_id = restored.quorum_id
        self.previous: q.Quorum | None = restored.last_quorum
        self.heartbeats: dict[str, float] = {}
        self.pending: dict[str, q.Pending] = {}
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self._addresses: dict[str, str] = {}
        self._steps: dict[str, int] = {}
        self.checkpoints = CheckpointBook()  # each group's durable checkpoints (step_stats.ckpt)
        self._attached: dict[str, _Attachment] = {}
        # Replicas whose stream broke: stray heartbeats are ignored until they re-attach
        # or ask for a quorum, so an in-flight heartbeat cannot resurrect a crashed one.
        self._dead: dict[str, float] = {}
        self._healthy_seen: set[str] = set()
        self.last_decision: q.Decision | None = None
        self.last_decision_time = 0.0
        self._next_check: float | None = None
        self._stopping = False
        self._timer_wakes_at = float("-inf")
        self._eval_scheduled = False
        self._wakeup: asyncio.Event | None = None
        self._timer: asyncio.Task | None = None
        self._last_sweep = 0.0
        # Straggler scores and exclusions: memory only (see the module docstring).
        self.stragglers = sg.StragglerTracker(stragglers)
        self._sdc_seen: dict[tuple[int, str], None] = {}  # (step, check) of recorded sdc events
        self.leases = ls.LeaseDesk(leases)  # quorum leases (leases.py, LEASES.md)
        self.leases.restored(self.previous)
        self._expected: dict[str, float] = {}  # members of a just-revoked lease -> waited for until
        self.owners = OwnerDesk()  # who may speak for each live replica id (owners.py)
        self.injections = InjectionDesk()  # `rallypoint inject`: handed out with the next quorum answer
        # The goodput ledger (ledger.py): fed below, saved in the state file now and then.
        # Saved in the state file; kept in memory with no file (":memory:", or etcd's state).
        self.goodput = GoodputBook(None if store.path == MEMORY or "://" in store.path else store.path, wall=wall,
                                   clock=clock)
        self._stats_log = Throttle(_BAD_STATS_LOG_INTERVAL, clock)
        self.started = wall()
        if restored.quorum_id:
            log.info(
                "restored quorum_id=%d, last quorum %s from %s",
                self.quorum_id,
                list(self.previous.replica_ids) if self.previous else [],
                store.path,
            )
        store.record_event(
            "start", None, quorum_id=self.quorum_id, min_replicas=options.min_replicas, state=store.path
        )
        metrics.set_quorum(self.quorum_id, len(self.previous.members) if self.previous else 0)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._timer = asyncio.get_running_loop().create_task(self._run_timer(), name="lighthouse-timer")

    async def stop(self) -> None:
        self._stopping = True
        if self._timer is not None:
            # The flag and the wakeup end the timer too: on Python 3.11 ``asyncio.wait_for``
            # swallows a cancel that arrives as the wakeup fires (it returns the result), and
            # the timer would then sleep on with no deadline, holding up the shutdown.
            if self._wakeup is not None:
                self._wakeup.set()
            self._timer.cancel()
            try:
                await self._timer
            except asyncio.CancelledError:
                pass
        for rid, futs in list(self._waiters.items()):
            for fut in futs:
                if not fut.done():
                    fut.set_exception(ReplicaDead("the lighthouse is shutting down; retry against its replacement"))
        self._waiters.clear()
        for att in list(self._attached.values()):
            att.overflow.set()  # ends its stream now (a deposed HA leader: the replicas re-attach to the new one)
        self.pending.clear()
        await self.goodput.close()

    # ---------------------------------------------------------------- inputs
    def _alive(self, rid: str, now: float) -> None:
        """Record a sign of life; a replica new to us (or revived) is a join."""
        if not self.heartbeats and self._wakeup is not None:
            # The timer sleeps without a timeout while no replica is known; wake it so
            # the heartbeat sweep (expiry events, forgetting) runs for this one.
            self._wakeup.set()
        self.heartbeats[rid] = now
        if rid not in self._healthy_seen:
            self._healthy_seen.add(rid)
            self.store.record_event("join", rid)
            self.goodput.join(rid)
            log.info("[%s] replica is alive", rid)
            self._schedule()

    def heartbeat(self, rid: str) -> None:
        self.metrics.heartbeat()
        if rid in self._dead:
            log.debug("[%s] ignoring heartbeat from a replica declared dead (re-attach or ask for a quorum)", rid)
            return
        self._alive(rid, self._clock())

    async def request_quorum(self, member: q.Member) -> bytes:
        """Register a pending request and wait until a quorum containing it forms.

        Returns the serialized ``LighthouseQuorumResponse`` (shared by every waiter of
        that quorum). No timeout here: the caller's RPC deadline cancels the wait, and
        a cancelled wait stops being a participant at once.
        """
        rid = member.replica_id
        now = self._clock()
        self.metrics.quorum_request()
        # A member asking ends the lease (it takes part in no later round of it); anyone
        # else asking is a joiner, which the members' next round must ask to take in.
        if rid not in self.stragglers.excluded(now):  # an evicted straggler's ask joins nothing yet
            self.revoke_lease(ls.revoke_for_request(self.leases.lease, rid, member.step, member.commit_failures))
        self._expected.pop(rid, None)
        desk = self.leases
        left = ls.left_notice(desk.revoked_lease, desk.left_sent, rid, member.step, member.commit_failures)
        if left is not None and desk.revoked_lease is not None:
            desk.left_sent, desk.left = True, left
            self._push(desk.revoked_lease.replica_ids, left)
            self.metrics.lease_revoked(left.why)
            self.store.record_event("lease_revoked", rid, quorum_id=left.quorum_id, why=left.why, reason=left.reason,
                                    after_step=left.after_step)
        self._dead.pop(rid, None)
        self._alive(rid, now)
        old = self.pending.get(rid)
        self.pending[rid] = q.Pending(member, old.joined if old else now)
        if member.address:
            self._addresses[rid] = member.address
        self._steps[rid] = member.step
        self._score(member, now)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(rid, []).append(fut)
        # Decide right here rather than on a later loop pass: the request that completes
        # a quorum is answered without another trip through the event loop.
        self._evaluate()
        try:
            return await fut
        finally:
            if not fut.done() or fut.cancelled():
                self._drop_waiter(rid, fut)

    def _drop_waiter(self, rid: str, fut: asyncio.Future) -> None:
        futs = self._waiters.get(rid)
        if futs is None:
            return
        if fut in futs:
            futs.remove(fut)
        if not futs:
            del self._waiters[rid]
            if self.pending.pop(rid, None) is not None:
                # It was alive until it walked away; count that as its last heartbeat.
                if rid not in self._dead:
                    self.heartbeats[rid] = self._clock()
                log.info("[%s] quorum request withdrawn (cancelled or disconnected)", rid)
                self._schedule()

    def attach(self, rid: str, address: str, takes_leases: bool = False, held_lease: int = 0) -> _Attachment:
        """A replica opened its liveness stream (holding lease ``held_lease``, 0: none)."""
        self._dead.pop(rid, None)
        old = self._attached.get(rid)
        if old is not None:
            log.info("[%s] replaced an older liveness stream", rid)
        att = _Attachment(rid, address, takes_leases)
        self._attached[rid] = att
        if address:
            self._addresses[rid] = address
        self._alive(rid, self._clock())
        self._update_gauges()
        desk = self.leases
        if takes_leases and desk.enabled:  # after the welcome: revokes it missed, or a lease never granted here
            stale = ls.revoke_at_attach(desk.lease, rid, held_lease, self.quorum_id)
            if stale is not None:
                att.push(stale.to_pb().SerializeToString())
                # A lease holder (or last member) must not get a grant of the current id: a new one.
                member = held_lease > 0 or (self.previous is not None and rid in self.previous.replica_id_set)
                desk.fresh_id = desk.fresh_id or (member and stale.quorum_id >= self.quorum_id)
            if desk.left is not None and desk.revoked_lease is not None and rid in desk.revoked_lease.replica_id_set:
                att.push(desk.left.to_pb().SerializeToString())  # a member left while this stream was down
        return att

    def revoke_lease(self, revoke: ls.Revoke | None) -> None:
        """End the lease in force (when ``revoke`` names it) and push the revoke to every
        member's stream, serialized once (a revoke of a large quorum is one write per
        stream). A member whose stream is down hears of it when it re-attaches."""
        done = self.leases.revoke(revoke)
        if done is None:
            return
        lease_members = self.previous.replica_ids if self.previous is not None else ()
        self._push(lease_members, done)
        # Its members ask at the end of the round they are in: waited for past join_timeout.
        until = self._clock() + self.options.heartbeat_timeout
        self._expected = {rid: until for rid in lease_members if rid not in self.pending}
        self.metrics.lease_revoked(done.why)
        self.store.record_event("lease_revoked", done.replica_id or None, quorum_id=done.quorum_id, why=done.why,
                                reason=done.reason, **({"after_step": done.after_step} if done.replica_id else {}))
        log.info("lease of quorum %d revoked: %s", done.quorum_id, done.reason)

    def _push(self, replica_ids: tuple[str, ...], revoke: ls.Revoke) -> None:
        raw = revoke.to_pb().SerializeToString()
        for rid in replica_ids:
            att = self._attached.get(rid)
            if att is not None:
                att.push(raw)

    def step_report(self, rid: str, step: int, data: str) -> None:
        """A round a replica group started on a lease: its step stats, as a Quorum
        request would have carried them (``data`` passed ``validate.data``)."""
        now = self._clock()
        self.metrics.step_report()
        self._steps[rid] = step
        self._score(q.Member(rid, step=step, data=data), now)

    def detach(self, att: _Attachment, *, clean: bool, reason: str) -> None:
        """The liveness stream ended: with a goodbye (``clean``) or by breaking."""
        rid = att.replica_id
        if self._attached.get(rid) is not att:
            return  # superseded by a newer stream of the same replica
        del self._attached[rid]
        if self._stopping:
            return  # our own shutdown closed the stream: the replica did not crash
        self.declare_dead(rid, "goodbye" if clean else "stream_broken", reason)

    def declare_dead(self, rid: str, kind: str, reason: str) -> None:
        """Forget a replica now: no waiting for its heartbeat to expire."""
        if self.leases.holds(rid):  # the revoke goes out before the PeerDown below
            self.revoke_lease(ls.Revoke(self.leases.holds(rid), "member_gone", f"member {rid} is gone ({kind})"))
        if self.previous is not None and rid in self.previous.replica_id_set:
            self.leases.fresh_id = True  # a quorum after a member's death never reuses the id it had
        self._dead[rid] = self._clock()
        self.owners.release(rid)  # its id is free again
        self.heartbeats.pop(rid, None)
        self._healthy_seen.discard(rid)
        self.pending.pop(rid, None)
        for fut in self._waiters.pop(rid, []):
            if not fut.done():
                fut.set_exception(ReplicaDead(f"replica {rid} was declared dead: {reason}"))
        self.metrics.replica_down(kind)
        self.store.record_event("leave" if kind == "goodbye" else "crash", rid, reason=reason)
        self.goodput.down(rid, clean=kind == "goodbye")
        if kind == "goodbye":
            log.info("[%s] replica left cleanly: %s", rid, reason)
        else:
            log.warning("[%s] replica is gone (%s): %s", rid, kind, reason)
        notice = rpb.AttachResponse(peer_down=rpb.PeerDown(replica_id=rid, reason=f"{kind}: {reason}"))
        for other in self._attached.values():
            other.push(notice)
        self._update_gauges()
        self._schedule()

    # ---------------------------------------------------------------- evaluation
    def _schedule(self) -> None:
        """Evaluate soon, once per burst: many requests arriving in one loop
        iteration cost one evaluation."""
        if not self._eval_scheduled:
            self._eval_scheduled = True
            asyncio.get_running_loop().call_soon(self._evaluate)

    def _evaluate(self) -> None:
        self._eval_scheduled = False
        now = self._clock()
        readmitted = self.stragglers.due(now)
        if readmitted:
            self._straggler_events(readmitted, now)
        excluded = self.stragglers.excluded(now)
        lease = self.leases.lease
        if lease is not None and self.pending:  # someone waits to join (e.g. readmitted after an eviction)
            waiting = next((r for r in self.pending if r not in lease.replica_id_set and r not in excluded), None)
            if waiting is not None:
                self.revoke_lease(ls.Revoke(lease.quorum_id, "joiner", f"replica {waiting} asks to join"))
        view = q.View(self.heartbeats, self.pending, self.previous, self.quorum_id, excluded, self.leases.fresh_id,
                      self._expected)
        decision = q.decide(now, view, self.options)
        self.metrics.decision(decision.rule.value)
        prev = self.last_decision
        if prev is None or prev.rule != decision.rule:
            log.info("quorum status: %s", decision.reason)
        if decision.rule is not q.Rule.NO_PARTICIPANTS or prev is None:
            # An idle lighthouse keeps showing why the last quorum formed (or why it is
            # still waiting), which is what /status readers want to know.
            self.last_decision = decision
            self.last_decision_time = self._wall()
        if decision.formed:
            self._form(decision, now)
        # decide() reports when an excluded replica that asks gets back in; a cool-down
        # that ends while it is not asking must still be readmitted (event, window) then.
        readmit = self.stragglers.next_readmission()
        nxt = decision.next_check
        self._set_next_check(readmit if nxt is None or (readmit is not None and readmit < nxt) else nxt)

    def _form(self, decision: q.Decision, now: float) -> None:
        assert decision.members is not None
        if getattr(self.store, "strict", False) and not self.store.leads():
            return  # an HA leader whose lead lapsed forms nothing (its waiters fail when it stops)
        quorum = q.Quorum(decision.quorum_id, decision.members, self._wall())
        first_joined = min(self.pending[m.replica_id].joined for m in quorum.members)
        changed = quorum.quorum_id != self.quorum_id or self.previous is None
        self.quorum_id = quorum.quorum_id
        self.previous = quorum
        self._expected = {}
        refused = self.leases.grant(quorum, {r: a.leases for r, a in self._attached.items()})
        if refused is None:
            self.metrics.lease_granted()
            if changed:
                log.info("quorum %d granted as a lease", quorum.quorum_id)
        elif changed:
            log.debug("quorum %d not leased: %s", quorum.quorum_id, refused)
        payload = pb.LighthouseQuorumResponse(quorum=quorum_to_pb(quorum)).SerializeToString()
        waiters: list[asyncio.Future] = []
        for m in quorum.members:
            self.pending.pop(m.replica_id, None)
            waiters.extend(self._waiters.pop(m.replica_id, []))
        self.metrics.observe_quorum_latency(max(0.0, now - first_joined))
        self.metrics.set_quorum(quorum.quorum_id, len(quorum.members))
        if changed:
            log.info("quorum %d formed with %s (%s)", quorum.quorum_id, list(quorum.replica_ids), decision.reason)
            self.goodput.quorum(quorum.replica_ids)
            # Recorded before the flush below, so the event is on disk with the quorum.
            self.store.record_event(
                "quorum",
                None,
                quorum_id=quorum.quorum_id,
                members=list(quorum.replica_ids),
                rule=decision.rule.value,
                reason=decision.reason,
            )
        if changed and self.store.path != MEMORY:
            # A new quorum_id is answered only once it is on disk: a lighthouse SIGKILLed
            # right after answering must not restart from an older id and hand it out
            # again (quorum_id must never go backwards). The write stays on the state
            # writer thread; unchanged quorums (the fast path every step) never wait.
            self._persist_then_answer(quorum, waiters, payload)
        else:
            self.store.save_quorum(quorum)
            _answer(waiters, payload)

    def _persist_then_answer(self, quorum: q.Quorum, waiters: list[asyncio.Future], payload: bytes) -> None:
        self.store.save_quorum(quorum)
        flushed = asyncio.get_running_loop().run_in_executor(None, self.store.flush, _PERSIST_TIMEOUT)

        def done(f: asyncio.Future) -> None:
            confirmed = not f.cancelled() and f.exception() is None and f.result()
            if not confirmed and getattr(self.store, "strict", False):  # etcd: the compare-and-swap failed
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(ReplicaDead(f"quorum {quorum.quorum_id} was not written to {self.store.path}: "
                                                      "this lighthouse no longer leads; ask the new leader"))
                return
            if not confirmed:
                log.error(
                    "quorum %d is not confirmed on disk in %s after %.1fs; answering anyway "
                    "(a crash now could make a restarted lighthouse reuse an older quorum_id)",
                    quorum.quorum_id, self.store.path, _PERSIST_TIMEOUT,
                )
            _answer(waiters, payload)

        flushed.add_done_callback(done)

    def _set_next_check(self, when: float | None) -> None:
        self._next_check = when
        # Wake the timer only if it would otherwise sleep past this deadline.
        if when is not None and when < self._timer_wakes_at and self._wakeup is not None:
            self._wakeup.set()

    async def _run_timer(self) -> None:
        """Wake at the next deadline a decision reported (capped by --quorum-tick-ms and
        by the heartbeat sweep), never on a fixed polling tick otherwise."""
        assert self._wakeup is not None
        while not self._stopping:
            now = self._clock()
            waits = [_SWEEP_INTERVAL if self.heartbeats else None, self._tick]
            if self._next_check is not None:
                waits.append(max(0.0, self._next_check - now))
            timeout = min((w for w in waits if w is not None), default=None)
            self._timer_wakes_at = float("inf") if timeout is None else now + timeout
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass
            if self._stopping:
                return
            self._wakeup.clear()
            now = self._clock()
            if self._next_check is not None and now >= self._next_check:
                self._next_check = None
                self._evaluate()
            elif self._tick is not None:
                self._evaluate()
            if now - self._last_sweep >= _SWEEP_INTERVAL:
                self._last_sweep = now
                self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Report heartbeat expiries and forget long-silent replicas (bounded state)."""
        timeout = self.options.heartbeat_timeout
        # Same expiry test as quorum.healthy_replicas, so reports and decisions agree.
        for rid in [r for r in self._healthy_seen if r not in self.pending and self.heartbeats.get(r, -timeout) + timeout <= now]:
            self._healthy_seen.discard(rid)
            if rid not in self._attached:  # a live stream still speaks for it
                self.owners.release(rid)
            self.metrics.replica_down("heartbeat_expired")
            self.store.record_event("leave", rid, reason="heartbeat expired")
            if self.leases.holds(rid):
                self.revoke_lease(ls.Revoke(self.leases.holds(rid), "member_gone", f"member {rid}'s heartbeat expired"))
            self.goodput.down(rid, clean=False)
            log.warning("[%s] heartbeat expired (%.1fs timeout)", rid, self.options.heartbeat_timeout)
        for rid in q.forgettable(now, self.heartbeats, self.pending, self._forget_after):
            del self.heartbeats[rid]
            self._addresses.pop(rid, None)
            self._steps.pop(rid, None)
        dead_limit = now - self._forget_after
        for rid in [r for r, t in self._dead.items() if t < dead_limit]:
            del self._dead[rid]
        # Whatever else is held per replica goes with it: a replica known nowhere else
        # (every restart is a new id) must not leave its address and step behind.
        known = set(self.heartbeats) | set(self.pending) | set(self._attached) | set(self._dead)
        for held in (self._addresses, self._steps):
            for rid in [r for r in held if r not in known]:
                del held[rid]
        self.owners.keep_only(known - set(self._dead))
        self.checkpoints.keep_only(known)
        for rid in [r for r in self.stragglers.groups() if r not in known]:
            self.stragglers.forget(rid)
        for rid in [r for r in self.injections.pending() if r not in known]:
            self.injections.forget(rid)
        self.goodput.tick(set(self.heartbeats) | set(self.pending) | set(self._attached), self.options.heartbeat_timeout)
        self._update_gauges()

    def refresh_gauges(self) -> None:
        """Replica-count gauges; computed when metrics are read (and at each sweep),
        not on the per-request path."""
        self._update_gauges()
        tracker = self.stragglers
        self.metrics.set_stragglers(tracker.scores(), len(tracker.flagged()), len(tracker.excluded(self._clock())))
        self.metrics.set_goodput(self.goodput.summary())
        self.metrics.set_checkpoints(self.checkpoints.rows(self._clock()))

    def _update_gauges(self) -> None:
        self.metrics.set_replicas(
            healthy=len(q.healthy_replicas(self._clock(), q.View(self.heartbeats, self.pending), self.options)),
            participating=len(self.pending),
            attached=len(self._attached),
        )

    # ---------------------------------------------------------------- views
    def manager_address(self, rid: str) -> str | None:
        return self._addresses.get(rid)

    def welcome(self) -> rpb.AttachResponse:
        w = rpb.AttachWelcome(
            quorum_id=self.quorum_id, heartbeat_timeout_ms=int(self.options.heartbeat_timeout * 1000)
        )
        if self.previous is not None:
            w.last_quorum.CopyFrom(quorum_to_pb(self.previous))
        return rpb.AttachResponse(welcome=w)

    def status(self) -> dict:
        """The ``GET /status`` document (:func:`rallypoint.lighthouse._status.core_status`)."""
        from rallypoint.lighthouse._status import core_status

        return core_status(self)
