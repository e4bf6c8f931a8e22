"""The lighthouse core's straggler scoring and corruption events: what it does with the
step timings each round brings (a Quorum request's ``data``, or a lease's step report).
A mixin of :class:`~rallypoint.lighthouse.core.LighthouseCore` (on its loop thread), kept
apart so that ``core.py`` stays about the quorum state machine."""

from __future__ import annotations

import logging
from typing import Any, Callable

from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint.lighthouse import checkpoints as ck
from rallypoint.lighthouse import leases as ls
from rallypoint.lighthouse import quorum as q
from rallypoint.lighthouse import stragglers as sg

log = logging.getLogger("rallypoint.lighthouse")


class Scoring:
    """Needs the core's ``options``, ``store``, ``metrics``, ``goodput``, ``stragglers``,
    ``leases``, ``heartbeats``, ``pending``, ``_stats_log``, ``_wall`` and ``revoke_lease``."""

    options: q.Options
    store: Any
    metrics: Any
    goodput: Any
    stragglers: sg.StragglerTracker
    leases: ls.LeaseDesk
    heartbeats: dict[str, float]
    pending: dict[str, q.Pending]
    _stats_log: Throttle
    _wall: Callable[[], float]
    _sdc_seen: dict[tuple[int, str], None]
    checkpoints: ck.CheckpointBook

    def revoke_lease(self, revoke: ls.Revoke | None) -> None: ...

    def _score(self, member: q.Member, now: float) -> None:
        """Feed the request's step timings to the straggler scorer. Never fails the
        request: ``data`` is untrusted, and a bad report only goes unscored."""
        rid = member.replica_id
        self._checkpoint_report(rid, member.data, now)
        try:
            stats = sg.parse_step_stats(member.data)
            if stats is None:
                return
            self.goodput.round(rid, stats)
            if stats.sdc is not None:
                self._sdc_event(rid, stats)
            events = self.stragglers.observe(
                rid, stats, now, lambda: self._healthy_now(now), self.options.min_replicas
            )
        except sg.BadStepStats as e:
            left_out = self._stats_log.ready(now)
            if left_out is not None:
                log.debug("[%s] step_stats ignored for straggler scores: %s%s", rid, e, left_out_note(left_out))
            return
        except Exception:  # a scoring bug must never cost the job its quorum
            if self._stats_log.ready(now) is not None:
                log.exception("[%s] straggler scoring failed; the quorum request is served regardless", rid)
            return
        self._straggler_events(events, now)

    def _checkpoint_report(self, rid: str, data: str, now: float) -> None:
        """Keep the group's durable-checkpoint figures (``step_stats.ckpt``); a bad object
        is ignored (logged at debug, throttled), as bad step stats are."""
        try:
            report = ck.parse_ckpt(data)
        except ck.BadCkpt as e:
            left_out = self._stats_log.ready(now)
            if left_out is not None:
                log.debug("[%s] step_stats.ckpt ignored: %s%s", rid, e, left_out_note(left_out))
            return
        if report is not None:
            self.checkpoints.observe(rid, report, now)

    def _sdc_event(self, rid: str, stats: sg.StepStats) -> None:
        """A corruption check failed a round: one ``sdc`` event per step and check (every
        group of the quorum reports the same verdict), naming the groups it flagged."""
        key = (stats.step, stats.sdc or "")
        if key in self._sdc_seen:
            return
        self._sdc_seen[key] = None
        while len(self._sdc_seen) > 64:
            del self._sdc_seen[next(iter(self._sdc_seen))]
        self.store.record_event("sdc", stats.sdc_bad[0] if stats.sdc_bad else rid, step=stats.step, check=stats.sdc,
                                bad=list(stats.sdc_bad), reported_by=rid)
        log.warning("silent data corruption at step %d (%s check): %s (reported by %s)", stats.step, stats.sdc,
                    ", ".join(stats.sdc_bad) or "?", rid)

    def _healthy_now(self, now: float) -> set[str]:
        return q.healthy_replicas(now, q.View(self.heartbeats, self.pending), self.options)

    def _straggler_events(self, events: list[sg.Event], now: float) -> None:
        """Log, record and count what the scorer reported."""
        for ev in events:
            detail = dict(ev.detail)
            if ev.until is not None:
                detail["until"] = round(self._to_wall(ev.until, now), 3)
            self.store.record_event(ev.kind, ev.group, **detail)
            if ev.kind == sg.EVICTED and self.leases.holds(ev.group):
                self.revoke_lease(ls.Revoke(self.leases.holds(ev.group), "evicted", f"member {ev.group} was evicted"))
            if ev.kind in (sg.EVICTED, sg.READMITTED):
                (self.goodput.evicted if ev.kind == sg.EVICTED else self.goodput.readmitted)(ev.group)
            if ev.kind == sg.EVICTED:
                self.metrics.straggler_evicted()
                log.warning(
                    "[%s] straggler evicted: left out of quorums for %.1fs (score %s at step %s); it keeps "
                    "heartbeating and heals when readmitted", ev.group, detail["cooldown_s"], detail["score"],
                    detail["step"],
                )
            elif ev.kind == sg.STRAGGLER:
                log.warning(
                    "[%s] straggler: compute time %sx the median of its peers (%d of its last %d steps slow, "
                    "step %s; policy %s)", ev.group, detail["score"], detail["slow_votes"], detail["window"],
                    detail["step"], self.stragglers.policy.mode,
                )
            else:
                log.info("[%s] %s %s", ev.group, ev.kind.replace("_", " "),
                         " ".join(f"{k}={v}" for k, v in detail.items()))

    def _to_wall(self, monotonic: float, now: float) -> float:
        return self._wall() + (monotonic - now)

