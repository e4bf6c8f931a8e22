"""The goodput ledger: where each replica group's wall time went, and what would buy it back.

Why here: the lighthouse hears from every replica group every round. Each Quorum request
of a rallypoint group carries its previous round's record (``step_stats``: outcome, cause of
a failure, and the time split, parsed by :func:`rallypoint.lighthouse.stragglers.parse_step_stats`),
and the lighthouse itself sees joins, deaths, straggler evictions and quorums. Summing these
into buckets per group says how much of the job's time trained the model and how much was
lost, to what.

Everything here is deterministic and does no I/O: ``now`` (wall-clock seconds, so a ledger
saved by one lighthouse continues in its successor) is always an argument. The core
(:mod:`rallypoint.lighthouse.core`) feeds it; :mod:`rallypoint.lighthouse._ledger_store`
persists it.

**Groups.** The ledger is kept per replica *group*, not per replica id: managers append
``:<uuid>`` to ``REPLICA_GROUP_ID`` (:func:`group_of` strips it), so a restarted group is the
same group again and the gap is its down time. The id a group currently runs under is its
*incarnation*; events of an older incarnation are ignored.

**Accounting.** Each group's window runs from its first join to now. A group is ``alive``,
``excluded`` (left out of quorums as a straggler), ``down`` (died; counts down time) or
``left`` (a clean goodbye, or a death before it was ever a quorum member: its window is
closed, and reopens when it rejoins). Time is moved into buckets as events arrive:

* While alive, time is *unreported* until the group's next report: a report for round ``r``
  covers the time since the previous report and is split by that round's own time split
  (:func:`round_parts`), scaled to the time it covers (so rounds tile the group's time
  exactly, whatever the lag between a round's end and its report):

  - ``committed`` rounds: ``reconfiguration`` = ``min(configure_s, quorum_wait_s)`` (the
    configure runs on the quorum thread, so it is lost only where the training thread waited
    for it, at the end of its quorum wait); ``quorum_wait`` = the rest of ``quorum_wait_s``;
    ``healing`` = ``heal_s``; ``productive`` = ``step_s`` minus those three;
  - ``failed`` rounds: the whole round, in ``failed`` by cause (``failed_by_cause``), except
    cause ``peer_down``, which is ``detection``: time lost to learning that a peer died;
  - ``healing`` rounds: the whole round in ``healing``; ``spare`` rounds: in ``spare``.

* ``excluded``: wall time between an eviction (a straggler's cool-down; :meth:`Ledger.evicted`
  serves any other exclusion too) and the readmission. The round a
  group reports after it spans that wait too; the excluded seconds are taken out of it
  (from its quorum wait first) so nothing counts twice.
* ``down``: from an unclean death (crash, broken stream, expired heartbeat) to the next join
  of the group, counted as it passes, at most :data:`RETIRE_S` per outage (a group that never
  comes back stops counting then); from a clean goodbye to a rejoin, counted at the rejoin.
  A group that was never a quorum member is never down (a late starter is not down).
* When a group goes away its unreported time (the round in progress) is ``failed`` with cause
  ``died`` after an unclean death, or split like its last reported round after a clean
  goodbye (the last round of a finished job usually committed). A group that never reported
  (a torchft client) keeps its time in ``unreported``; one that also never was a quorum member
  (a replica that only sent heartbeats, or died starting) leaves the ledger when it goes.
  A new incarnation joining while the old one still counts as alive means the old one died
  unseen: the same as an unclean death, at the new one's join.
* A gap in the reports (a lighthouse outage, a restart from the state file) is covered by the
  next report, split like that round: during an outage rounds fail for want of a quorum, so
  that time lands in ``failed`` (cause ``quorum``).

So for every group ``sum(buckets) + unreported == wall_s`` (its window), and over the job
``sum == wall time x groups`` for groups present throughout. **Goodput** is ``productive``
over the sum of all buckets except ``unreported`` (time not yet known to be good or bad).

**Model.** :func:`modelled_goodput` is the seeds' ``(1 - (T_detect + T_restart + T_load +
tau/2)/MTBF) / (1 + delta/tau)``; :func:`model_report` evaluates it with parameters measured
in group-seconds (see its docstring), next to what-ifs (restart halved, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint.lighthouse.stragglers import StepStats

#: The buckets every group's settled time falls into, in display order.
BUCKETS: tuple[str, ...] = (
    "productive", "reconfiguration", "healing", "quorum_wait", "failed", "detection", "excluded", "spare", "down",
)
#: Time not yet covered by a report (the round in progress, or all of a torchft client's time).
UNREPORTED = "unreported"
#: Causes of failed rounds kept apart (the manager's, less ``peer_down`` which is detection;
#: ``died``: the round in progress when the group itself died; ``unknown``: none was sent).
FAILED_CAUSES: tuple[str, ...] = (
    "comm", "quorum", "vote", "participants", "injected", "sdc", "error", "died", "other", "unknown",
)
#: Cause of a failed round that counts as detection.
DETECTION_CAUSE = "peer_down"
#: Group states.
ALIVE, EXCLUDED, DOWN, LEFT = "alive", "excluded", "down", "left"
STATES: tuple[str, ...] = (ALIVE, EXCLUDED, DOWN, LEFT)
OUTCOMES: tuple[str, ...] = ("committed", "failed", "healing", "spare")
#: Down time counted per outage at most: a group gone this long is taken as retired.
RETIRE_S = 1800.0
#: Groups tracked one by one; beyond this, closed groups are folded into ``retired``.
MAX_GROUPS = 1024
#: The time series: bins of this many seconds, the newest ``SERIES_BINS`` kept (one hour).
BIN_S = 10.0
SERIES_BINS = 360

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def group_of(replica_id: str) -> str:
    """The replica group a replica id belongs to: the id less a trailing ``:<uuid>`` (what
    rallypoint's and torchft's managers append to ``REPLICA_GROUP_ID``)."""
    head, sep, tail = replica_id.rpartition(":")
    return head if sep and head and _UUID.fullmatch(tail) else replica_id


def _failed_key(cause: str | None) -> str:
    c = cause or "unknown"
    return "failed:" + (c if c in FAILED_CAUSES else "other")


def main_key(stats: StepStats) -> str:
    """The bucket a round's time goes to when it has no usable split."""
    if stats.outcome == "committed":
        return "productive"
    if stats.outcome == "failed":
        return "detection" if stats.cause == DETECTION_CAUSE else _failed_key(stats.cause)
    return "healing" if stats.outcome == "healing" else "spare"


def round_parts(stats: StepStats) -> dict[str, float]:
    """One round's ``step_s`` split into bucket keys (``failed:<cause>`` for failures); the
    values add up to ``step_s``. See the module docstring for the rules."""
    step = stats.step_s
    if step <= 0:
        return {}
    if stats.outcome != "committed":
        return {main_key(stats): step}
    reconf = min(stats.configure_s, stats.quorum_wait_s)
    lost = {"reconfiguration": reconf, "quorum_wait": stats.quorum_wait_s - reconf, "healing": stats.heal_s}
    total = sum(lost.values())
    if total > step:  # clocks of two threads: never more lost than the round lasted
        lost = {k: v * step / total for k, v in lost.items()}
        total = step
    parts = {k: v for k, v in lost.items() if v > 0}
    if step - total > 0:
        parts["productive"] = step - total
    return parts


def _minus(parts: dict[str, float], credit: float) -> dict[str, float]:
    """``parts`` less ``credit`` seconds: from the quorum wait first, then evenly."""
    if credit <= 0 or not parts:
        return parts
    out = dict(parts)
    take = min(credit, out.get("quorum_wait", 0.0))
    if take > 0:
        out["quorum_wait"] -= take
        credit -= take
    rest = sum(out.values())
    if credit > 0 and rest > 0:
        keep = max(0.0, rest - credit) / rest
        out = {k: v * keep for k, v in out.items()}
    return {k: v for k, v in out.items() if v > 1e-12}


def _scale(parts: Mapping[str, float], span: float, fallback: str) -> dict[str, float]:
    """``parts`` scaled to add up to ``span`` (all of it to ``fallback`` without parts)."""
    total = sum(parts.values())
    if total <= 0:
        return {fallback: span}
    return {k: v * span / total for k, v in parts.items()}


def column(key: str) -> str:
    """The bucket of a part key (``failed:comm`` -> ``failed``)."""
    return key.split(":", 1)[0]


# ------------------------------------------------------------------------------ the model
def modelled_goodput(mtbf_s: float, t_detect_s: float, t_restart_s: float, t_load_s: float, tau_s: float,
                     delta_s: float) -> float:
    """``(1 - (T_detect + T_restart + T_load + tau/2) / MTBF) / (1 + delta/tau)``, in [0, 1].

    Each failure costs detecting it, restarting, loading the state and, on average, half a
    checkpoint interval of work redone; checkpointing costs ``delta`` every ``tau``.
    ``mtbf_s`` may be ``inf`` (no failure seen). Raises ``ValueError`` for ``tau_s <= 0``.
    """
    if not (tau_s > 0 and math.isfinite(tau_s)):
        raise ValueError(f"tau (the checkpoint interval) must be a positive number of seconds, got {tau_s}")
    if mtbf_s <= 0 or delta_s < 0:
        raise ValueError(f"MTBF must be > 0 and delta >= 0, got {mtbf_s} and {delta_s}")
    lost = 0.0 if math.isinf(mtbf_s) else (t_detect_s + t_restart_s + t_load_s + tau_s / 2) / mtbf_s
    return min(1.0, max(0.0, 1.0 - lost) / (1.0 + delta_s / tau_s))


def model_report(buckets: Mapping[str, float], failures: int, committed_rounds: int, committed_step_s: float,
                 tau_s: float | None = None, delta_s: float | None = None) -> dict[str, Any]:
    """The model evaluated with measured parameters, and what-ifs.

    Measured in group-seconds, so the model speaks the ledger's units: ``observed_s`` is the
    settled time of all groups, ``failures`` the unclean deaths of groups that were quorum
    members, ``MTBF = observed_s / failures`` (per group), ``T_detect`` = detection time per
    failure, ``T_restart`` = down time per failure, ``T_load`` = healing time per failure.
    ``tau`` defaults to the mean committed step (with healing from a live peer a failure
    loses at most the step in flight: the "checkpoint" is the last committed step) and
    ``delta`` to 0 (nothing is saved on the step path); pass them to model periodic
    checkpoints instead. ``goodput`` is None until a committed step gives ``tau``.
    """
    observed = sum(float(buckets.get(b, 0.0)) for b in BUCKETS)
    given_tau = tau_s is not None
    tau = tau_s if tau_s is not None else (committed_step_s / committed_rounds if committed_rounds else None)
    delta = 0.0 if delta_s is None else delta_s
    per = (lambda b: float(buckets.get(b, 0.0)) / failures) if failures else (lambda b: 0.0)
    params: dict[str, Any] = {
        "observed_s": _r(observed), "failures": failures,
        "mtbf_s": _r(observed / failures) if failures else None,
        "t_detect_s": _r(per("detection")), "t_restart_s": _r(per("down")), "t_load_s": _r(per("healing")),
        "tau_s": None if tau is None else _r(tau), "delta_s": _r(delta),
        "tau_source": "given" if given_tau else "mean committed step",
    }
    out: dict[str, Any] = {"parameters": params, "goodput": None, "what_if": {}}
    if tau is None or tau <= 0 or observed <= 0:
        return out
    mtbf = observed / failures if failures else math.inf
    base = dict(mtbf_s=mtbf, t_detect_s=per("detection"), t_restart_s=per("down"), t_load_s=per("healing"),
                tau_s=tau, delta_s=delta)

    def what(**change: float) -> float:
        return round(modelled_goodput(**{**base, **change}), 4)

    out["goodput"] = what()
    out["what_if"] = {
        "restart_halved": what(t_restart_s=base["t_restart_s"] / 2),
        "detect_halved": what(t_detect_s=base["t_detect_s"] / 2),
        "load_halved": what(t_load_s=base["t_load_s"] / 2),
        "mtbf_doubled": what(mtbf_s=mtbf * 2),
        "tau_doubled": what(tau_s=tau * 2),
    }
    return out


def _r(x: float) -> float:
    return round(x, 3)


# ---------------------------------------------------------------------------- time series
class Series:
    """Settled seconds per bucket in wall-clock bins of ``bin_s``; the newest ``max_bins``
    bins are kept (a bounded ring), older ones dropped. An interval's seconds are spread
    over the bins it spans, so a long outage shows where it happened, not where it ended."""

    def __init__(self, bin_s: float = BIN_S, max_bins: int = SERIES_BINS) -> None:
        if not (bin_s > 0 and max_bins >= 1):
            raise ValueError(f"series bins must be > 0 s and at least 1, got {bin_s} and {max_bins}")
        self.bin_s = float(bin_s)
        self.max_bins = int(max_bins)
        self.bins: dict[int, dict[str, float]] = {}
        self.newest = -(2**62)

    def add(self, start: float, end: float, parts: Mapping[str, float]) -> None:
        """Spread ``parts`` (part keys -> seconds) evenly over ``[start, end]``."""
        if not parts or not math.isfinite(end):
            return
        start = min(start, end)
        last = int(end // self.bin_s)
        if last > self.newest:
            self.newest = last
            floor = last - self.max_bins + 1
            for i in [i for i in self.bins if i < floor]:
                del self.bins[i]
        floor = self.newest - self.max_bins + 1
        length = end - start
        first = max(int(start // self.bin_s), floor)
        for i in range(first, last + 1):
            if length > 0:
                share = (min(end, (i + 1) * self.bin_s) - max(start, i * self.bin_s)) / length
            else:
                share = 1.0
            if share <= 0:
                continue
            b = self.bins.setdefault(i, {})
            for key, secs in parts.items():
                col = column(key)
                b[col] = b.get(col, 0.0) + secs * share

    def document(self) -> dict[str, Any]:
        """Columns for a chart: bin start times, goodput per bin (None for an empty bin) and
        seconds per bucket (every bucket, zeros included)."""
        order = sorted(self.bins)
        cols: dict[str, list[float]] = {b: [] for b in (*BUCKETS, UNREPORTED)}
        good: list[float | None] = []
        for i in order:
            b = self.bins[i]
            for name, values in cols.items():
                values.append(_r(b.get(name, 0.0)))
            settled = sum(b.get(k, 0.0) for k in BUCKETS)
            good.append(round(b.get("productive", 0.0) / settled, 4) if settled > 0 else None)
        return {"bin_s": self.bin_s, "t": [i * self.bin_s for i in order], "goodput": good, "buckets": cols}


# ----------------------------------------------------------------------------- the ledger
@dataclass
class Totals:
    """Settled seconds and counts (one group's, or of the groups folded into ``retired``)."""

    wall: float = 0.0
    secs: dict[str, float] = field(default_factory=dict)  # part keys -> seconds
    rounds: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    step_sum: float = 0.0  # step_s of committed rounds (for tau)

    def add(self, parts: Mapping[str, float]) -> None:
        for k, v in parts.items():
            self.secs[k] = self.secs.get(k, 0.0) + v

    def merge(self, other: Totals) -> None:
        self.wall += other.wall
        self.add(other.secs)
        for k, n in other.rounds.items():
            self.rounds[k] = self.rounds.get(k, 0) + n
        self.failures += other.failures
        self.step_sum += other.step_sum

    def buckets(self, unreported: float = 0.0) -> dict[str, float]:
        out = {b: 0.0 for b in BUCKETS}
        for k, v in self.secs.items():
            col = column(k)
            if col in out:
                out[col] += v
        out[UNREPORTED] = self.secs.get(UNREPORTED, 0.0) + unreported
        return out

    def failed_by_cause(self) -> dict[str, float]:
        return {k[7:]: _r(v) for k, v in sorted(self.secs.items()) if k.startswith("failed:") and v > 0}


@dataclass
class Group:
    """One replica group's ledger (see the module docstring for the states)."""

    name: str
    rid: str  # its current incarnation
    since: float  # first join
    mark: float  # time is accounted up to here
    mode: str = ALIVE
    member: bool = False  # was once a quorum member
    reported: bool = False
    pending: float = 0.0  # alive seconds since the last report (the round in progress)
    pending_since: float = 0.0
    credit: float = 0.0  # excluded seconds the next report's round also spans
    gone_at: float | None = None  # when it went down or left
    last_parts: dict[str, float] = field(default_factory=dict)  # its last report's split
    totals: Totals = field(default_factory=Totals)


class Ledger:
    """Every group's buckets and the job's time series, fed one event at a time (the
    methods below; ``now`` is wall-clock seconds). Deterministic and free of I/O."""

    def __init__(self, *, retire_s: float = RETIRE_S, max_groups: int = MAX_GROUPS, bin_s: float = BIN_S,
                 series_bins: int = SERIES_BINS) -> None:
        self.retire_s = retire_s
        self.max_groups = max_groups
        self.groups: dict[str, Group] = {}
        self.retired = Totals()  # closed groups folded away to bound the ledger
        self.untracked = 0  # groups refused because every slot held an open group
        self.since: float | None = None
        self.first_quorum: float | None = None
        self.series = Series(bin_s, series_bins)

    # --------------------------------------------------------------- internals
    def _settle(self, g: Group, parts: Mapping[str, float], start: float, end: float) -> None:
        g.totals.add(parts)
        self.series.add(start, end, parts)

    def _advance(self, g: Group, t: float) -> None:
        """Account ``[g.mark, t]`` to the group's state; a clock that went back moves nothing."""
        d = t - g.mark
        if d <= 0:
            return
        if g.mode == ALIVE:
            g.pending += d
            g.totals.wall += d
        elif g.mode == EXCLUDED:
            g.credit += d
            g.totals.wall += d
            self._settle(g, {"excluded": d}, g.mark, t)
        elif g.mode == DOWN and g.gone_at is not None:
            end = min(t, g.gone_at + self.retire_s)
            if end > g.mark:
                g.totals.wall += end - g.mark
                self._settle(g, {"down": end - g.mark}, g.mark, end)
        g.mark = t

    def _lose(self, g: Group, t: float, clean: bool) -> None:
        """The group goes away: settle its unreported time (see the module docstring)."""
        if g.pending > 0:
            if not g.reported:
                parts = {UNREPORTED: g.pending}
            elif clean and g.last_parts:
                parts = _scale(g.last_parts, g.pending, "productive")
            else:
                parts = {"failed:died": g.pending}
            self._settle(g, parts, g.pending_since, t)
        g.pending, g.pending_since, g.credit, g.gone_at = 0.0, t, 0.0, t

    def _current(self, rid: str) -> Group | None:
        g = self.groups.get(group_of(rid))
        return g if g is not None and g.rid == rid else None

    def _make_room(self) -> bool:
        if len(self.groups) < self.max_groups:
            return True
        closed = [g for g in self.groups.values() if g.mode == LEFT or
                  (g.mode == DOWN and g.gone_at is not None and g.mark >= g.gone_at + self.retire_s)]
        if not closed:
            self.untracked += 1
            return False
        oldest = min(closed, key=lambda g: (g.gone_at or 0.0, g.name))
        self.retired.merge(oldest.totals)
        del self.groups[oldest.name]
        return True

    # --------------------------------------------------------------- events
    def join(self, rid: str, now: float) -> None:
        """A replica is alive (new to the lighthouse, or back)."""
        name = group_of(rid)
        g = self.groups.get(name)
        if g is None:
            if not self._make_room():
                return
            self.groups[name] = Group(name, rid, since=now, mark=now, pending_since=now)
            self.since = now if self.since is None else min(self.since, now)
            return
        self._advance(g, now)
        if g.mode in (ALIVE, EXCLUDED):
            if g.rid == rid:
                return  # heard from again (a restarted lighthouse, a revived heartbeat)
            self._lose(g, now, clean=False)  # a new incarnation: the old one died unseen
            g.totals.failures += int(g.member)
        elif g.mode == LEFT and g.member and g.gone_at is not None:
            gap = min(now, g.gone_at + self.retire_s) - g.gone_at
            if gap > 0:  # back after a goodbye: the gap was down time after all
                g.totals.wall += gap
                self._settle(g, {"down": gap}, g.gone_at, g.gone_at + gap)
        g.rid, g.mode, g.mark, g.gone_at = rid, ALIVE, now, None
        g.pending, g.pending_since, g.credit = 0.0, now, 0.0

    def down(self, rid: str, now: float, clean: bool) -> None:
        """The replica is gone: ``clean`` for a goodbye, else a crash or a lost heartbeat."""
        g = self._current(rid)
        if g is None or g.mode in (DOWN, LEFT):
            return
        if not (g.member or g.reported or g.totals.secs):
            del self.groups[g.name]  # it did nothing to account for (only heartbeats, or it died starting)
            return
        self._advance(g, now)
        self._lose(g, now, clean)
        unclean_member = not clean and g.member
        g.totals.failures += int(unclean_member)
        g.mode = DOWN if unclean_member else LEFT

    def evicted(self, rid: str, now: float) -> None:
        """Left out of quorums (a straggler's cool-down, an SDC eviction) from ``now``."""
        g = self._current(rid)
        if g is not None and g.mode == ALIVE:
            self._advance(g, now)
            g.mode = EXCLUDED

    def readmitted(self, rid: str, now: float) -> None:
        """Back in quorums from ``now``."""
        g = self._current(rid)
        if g is not None and g.mode == EXCLUDED:
            self._advance(g, now)
            g.mode = ALIVE

    def quorum(self, rids: Iterable[str], now: float) -> None:
        """A quorum formed with these members (they count down time from now on)."""
        if self.first_quorum is None:
            self.first_quorum = now
        for rid in rids:
            g = self._current(rid)
            if g is not None:
                g.member = True

    def round(self, rid: str, stats: StepStats, now: float) -> None:
        """A group's report of its previous round, received at ``now``."""
        g = self.groups.get(group_of(rid))
        if g is None or g.mode in (DOWN, LEFT):
            self.join(rid, now)  # the core joins first; this only covers a lost join
            g = self._current(rid)
        if g is None or g.rid != rid:
            return  # a report of an incarnation already replaced
        self._advance(g, now)
        t = g.totals
        t.rounds[stats.outcome] = t.rounds.get(stats.outcome, 0) + stats.rounds
        if stats.outcome == "committed":
            t.step_sum += stats.step_s
        parts = _minus(round_parts(stats), g.credit)
        g.credit = 0.0
        if g.pending > 0:
            self._settle(g, _scale(parts, g.pending, main_key(stats)), g.pending_since, now)
        g.pending, g.pending_since, g.reported = 0.0, now, True
        g.last_parts = parts or {main_key(stats): 1.0}

    def reconcile(self, live: Collection[str], now: float) -> None:
        """Groups the ledger holds alive whose incarnation the lighthouse no longer knows
        (restored from the state file, never heard from again) died, unseen: now."""
        for g in list(self.groups.values()):
            if g.mode in (ALIVE, EXCLUDED) and g.rid not in live:
                self.down(g.rid, now, clean=False)

    def restarted(self, now: float) -> None:
        """After a restore: a restarted lighthouse forgot every exclusion (the straggler
        tracker lives in memory), so excluded groups are back in from now."""
        for g in self.groups.values():
            if g.mode == EXCLUDED:
                self.readmitted(g.rid, now)

    # --------------------------------------------------------------- views
    def settle(self, now: float) -> None:
        """Bring every group up to ``now`` (down and excluded time is counted as it passes)."""
        for g in self.groups.values():
            self._advance(g, now)

    def document(self, now: float, tau_s: float | None = None, delta_s: float | None = None,
                 series: bool = True, listed: int | None = None) -> dict[str, Any]:
        """The ledger as ``/goodput`` serves it (``series=False``: without the time series;
        ``listed``: at most this many groups listed, open ones first, then the latest to
        close; the totals always cover every group)."""
        self.settle(now)
        total = Totals()
        total.merge(self.retired)
        for g in self.groups.values():
            total.merge(g.totals)
        shown = list(self.groups.values())
        if listed is not None and len(shown) > listed:
            shown.sort(key=lambda g: (g.mode in (ALIVE, EXCLUDED, DOWN), g.gone_at or 0.0), reverse=True)
            shown = shown[:max(0, listed)]
        groups = [_group_doc(g) for g in sorted(shown, key=lambda g: g.name)]
        buckets = total.buckets(sum(g.pending for g in self.groups.values()))
        committed = total.rounds.get("committed", 0)
        doc: dict[str, Any] = {
            "now": now, "since": self.since, "first_quorum": self.first_quorum,
            "goodput": _goodput(buckets),
            "total": {
                "groups": len(self.groups), "listed": len(groups), "wall_s": _r(total.wall), "buckets": {k: _r(v) for k, v in buckets.items()},
                "failed_by_cause": total.failed_by_cause(), "rounds": dict(sorted(total.rounds.items())),
                "failures": total.failures, "untracked": self.untracked,
                "retired": {"wall_s": _r(self.retired.wall),
                            "buckets": {k: _r(v) for k, v in self.retired.buckets().items()},
                            "failed_by_cause": self.retired.failed_by_cause()},
            },
            "groups": groups,
            "model": model_report(buckets, total.failures, committed, total.step_sum, tau_s, delta_s),
        }
        if series:
            doc["series"] = self.series.document()
        return doc


def _goodput(buckets: Mapping[str, float]) -> float | None:
    settled = sum(buckets.get(b, 0.0) for b in BUCKETS)
    return round(buckets.get("productive", 0.0) / settled, 4) if settled > 0 else None


def _group_doc(g: Group) -> dict[str, Any]:
    buckets = g.totals.buckets(g.pending)
    return {
        "group": g.name, "replica_id": g.rid, "state": g.mode, "since": g.since, "member": g.member,
        "wall_s": _r(g.totals.wall), "goodput": _goodput(buckets),
        "buckets": {k: _r(v) for k, v in buckets.items()}, "in_progress_s": _r(g.pending),
        "failed_by_cause": g.totals.failed_by_cause(), "rounds": dict(sorted(g.totals.rounds.items())),
        "failures": g.totals.failures,
    }


__all__ = [
    "ALIVE", "BIN_S", "BUCKETS", "DOWN", "EXCLUDED", "FAILED_CAUSES", "LEFT", "MAX_GROUPS", "RETIRE_S",
    "SERIES_BINS", "STATES", "UNREPORTED", "Group", "Ledger", "Series", "Totals", "group_of", "main_key",
    "model_report", "modelled_goodput", "round_parts",
]
