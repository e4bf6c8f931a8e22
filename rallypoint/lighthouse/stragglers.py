"""Straggler scores: which replica group is persistently slower than its peers, and what the
lighthouse does about it (``--stragglers report|evict``).

Why here: the lighthouse is the one place that hears from every replica group every step.
Each group's Quorum request carries, in ``requester.data``, a ``"step_stats"`` object that
describes the group's previous round (docs/design.md, "Guards"); the one number scored is
``compute_s``, the time the group's slowest rank spent before its first cross-replica
collective. No peer can slow that part down (a fast group that waits for a slow one shows
the wait in ``comm_s``), so comparing it across groups names the slow group, not its
victims.

Everything here is deterministic and does no I/O: ``now`` (monotonic seconds) is always
an argument, and what happened comes back as :class:`Event` values that the caller
(:mod:`rallypoint.lighthouse.core`) logs, records and counts. The rules:

* **Ratio per step.** A step's reports are gathered from every group; a group's ratio is its
  ``compute_s`` over the median ``compute_s`` of the *other* groups that reported the same
  step (:func:`step_ratios`). Only ``committed`` and ``failed`` rounds count (a healing or
  spare group did not compute like the others); it takes at least two groups, and a zero
  median gives no ratio.
* **When a step is complete.** A group reports step ``s`` when it asks for the round after
  ``s``; a round forms only once all its members asked. So when any group reports a step
  later than ``s``, every member of the round after ``s`` has already reported ``s``: the
  step is closed then (and at most :data:`MAX_OPEN_STEPS` steps are held open, so reports
  that never complete cannot pile up). Reports of a closed step are too late and ignored,
  unless they are so far behind (:data:`STEP_RESET_GAP`) that the step counter went back.
* **Vote over a window.** Each group keeps its last ``window`` ratios; a ratio >=
  ``threshold`` is a slow vote, and a group with >= ``votes`` slow votes in its window is a
  straggler (:func:`verdict`). One slow step therefore never counts, and a group 3x slower
  than its peers is flagged after ``votes`` steps (5 by default: within 10 steps). Its score
  is the median ratio of its window. A flagged group whose window drops below ``votes`` slow
  votes is no longer a straggler.
* **Policy.** ``report`` only flags. ``evict`` also excludes a flagged group from the next
  quorums for a cool-down (``cooldown_s``, doubling with each repeated eviction of the same
  group up to ``max_cooldown_s``, and stepping back down one doubling per ``decay_s`` the group
  stays clean after its readmission), never when fewer than ``min_replicas`` healthy groups
  would remain, and at most one group per decision (:func:`choose_eviction`). An excluded
  group keeps heartbeating and its Quorum call just waits; when the cool-down ends it is
  readmitted (and heals, being behind) with an empty window, so it takes fresh evidence to
  evict it again: hysteresis, it never flaps in and out.

The cool-down is capped because the excluded group's Quorum call waits through it: it must
stay well below the managers' quorum timeout (60 s by default), or the evicted group's call
times out and it retries (harmless, but noisy). Keep ``max_cooldown_s`` below that timeout
when a job shortens it.

The state (:class:`StragglerTracker`) lives in memory only: after a lighthouse restart the
scores start again from empty windows, which costs at most ``votes`` steps of evidence.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``--stragglers``: ``report`` flags stragglers; ``evict`` also leaves them out of quorums.
POLICIES: tuple[str, ...] = ("report", "evict")
#: Outcomes a group may report for a round, and those whose compute time is scored.
OUTCOMES: frozenset[str] = frozenset({"committed", "failed", "healing", "spare"})
COUNTED_OUTCOMES: frozenset[str] = frozenset({"committed", "failed"})
#: Timings of a round, seconds; each must be finite and within [0, MAX_SECONDS].
TIMING_FIELDS: tuple[str, ...] = (
    "step_s", "compute_s", "quorum_wait_s", "comm_s", "heal_s", "commit_s", "configure_s",
)
#: Why a failed round failed (the manager's ``rules.STEP_CAUSES``, kept local so this module
#: imports nothing but the standard library); another string is kept as ``"other"``.
CAUSES: frozenset[str] = frozenset({"peer_down", "comm", "quorum", "vote", "participants", "injected", "sdc", "error"})
MAX_SECONDS = 1e6
#: Steps and counters beyond this are garbage (validate.MAX_COUNTER; kept local so this
#: module imports nothing but the standard library).
MAX_COUNTER = 2**62
#: Steps whose reports are held open at once (normally one or two).
MAX_OPEN_STEPS = 4
#: A counted report this many steps behind the last closed step means the step counter
#: went back (the job restarted from a checkpoint under a lighthouse that kept running):
#: scoring restarts from that step instead of ignoring every report until it catches up.
STEP_RESET_GAP = 16
#: The largest window a policy may ask for: the state stays small per group.
MAX_WINDOW = 1000
#: The key in a Quorum request's ``data`` that carries the round's timings.
STATS_KEY = "step_stats"

#: Event kinds returned to the core (and recorded in the lighthouse's event log).
STRAGGLER = "straggler"
STRAGGLER_CLEARED = "straggler_cleared"
EVICTED = "evicted"
READMITTED = "readmitted"


class BadStepStats(ValueError):
    """``step_stats`` is present but malformed; the message says which field. Ignored for
    scoring: the Quorum request itself was valid and is served."""


@dataclass(frozen=True)
class Policy:
    """What ``--stragglers`` and its options ask for (seconds; ratios are unitless)."""

    mode: str = "report"
    threshold: float = 1.5
    window: int = 8
    votes: int = 5
    cooldown_s: float = 10.0
    max_cooldown_s: float = 30.0
    decay_s: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"straggler policy must be one of {', '.join(POLICIES)}, got {self.mode!r}")
        if not (math.isfinite(self.threshold) and self.threshold > 1):
            raise ValueError(
                f"straggler threshold must be a finite ratio > 1 (1.5 = 50% slower than the median), got {self.threshold}"
            )
        if not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"straggler window must be between 1 and {MAX_WINDOW} steps, got {self.window}")
        if not 1 <= self.votes <= self.window:
            raise ValueError(
                f"straggler votes must be between 1 and the window ({self.window}), got {self.votes}"
            )
        if not (math.isfinite(self.max_cooldown_s) and 0 < self.cooldown_s <= self.max_cooldown_s):
            raise ValueError(
                f"straggler cool-down must be > 0 and at most {self.max_cooldown_s:g} s (it must stay below the "
                f"managers' quorum timeout), got {self.cooldown_s}"
            )
        if not (math.isfinite(self.decay_s) and self.decay_s > 0):
            raise ValueError(f"straggler decay_s must be > 0, got {self.decay_s}")

    def describe(self) -> str:
        """One line for logs: ``evict (threshold 1.5, 5 of 8 steps, cool-down 10-30s)``."""
        cool = f", cool-down {self.cooldown_s:g}-{self.max_cooldown_s:g}s" if self.mode == "evict" else ""
        return f"{self.mode} (threshold {self.threshold:g}, {self.votes} of {self.window} steps{cool})"

    def as_dict(self) -> dict[str, Any]:
        """The policy as ``/status`` shows it."""
        return {
            "policy": self.mode,
            "threshold": self.threshold,
            "window": self.window,
            "votes": self.votes,
            "cooldown_s": self.cooldown_s,
            "max_cooldown_s": self.max_cooldown_s,
        }


@dataclass(frozen=True)
class StepStats:
    """One round of one group, as its manager reported it (see the module docstring)."""

    step: int
    outcome: str
    compute_s: float
    round: int = 0
    rank: int = 0
    step_s: float = 0.0
    quorum_wait_s: float = 0.0
    comm_s: float = 0.0
    heal_s: float = 0.0
    commit_s: float = 0.0
    configure_s: float = 0.0
    cause: str | None = None  # failed rounds only (the goodput ledger's buckets)
    sdc: str | None = None  # cause "sdc": the check that failed ("grad" or "param")
    sdc_bad: tuple[str, ...] = ()  # and the replica groups it named
    rounds: int = 1  # rounds summed in the timings (a paced report on a lease: manager/_lease.py)


@dataclass(frozen=True)
class Verdict:
    """A group's window judged: ``score`` (median ratio, None for an empty window), its slow
    votes, and whether that makes it a straggler."""

    score: float | None
    slow_votes: int
    flagged: bool


@dataclass(frozen=True)
class Event:
    """Something the caller should log and record. ``until`` (monotonic) is set for
    ``evicted``; ``detail`` holds plain JSON values."""

    kind: str
    group: str
    detail: dict[str, Any] = field(default_factory=dict)
    until: float | None = None


# ----------------------------------------------------------------------------- parsing
def _reject_constant(name: str) -> Any:
    raise BadStepStats(f"step_stats contains {name}")


def _int(raw: Mapping[str, Any], key: str, required: bool) -> int:
    value = raw.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadStepStats(f"step_stats.{key} must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_COUNTER:
        raise BadStepStats(f"step_stats.{key} is out of range: {str(value)[:40]}")
    return value


def _seconds(raw: Mapping[str, Any], key: str, required: bool) -> float:
    value = raw.get(key)
    if value is None and not required:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadStepStats(f"step_stats.{key} must be a number of seconds, got {type(value).__name__}")
    # An int beyond float range raises OverflowError in float(): out of range either way.
    if isinstance(value, int) and value > MAX_SECONDS:
        raise BadStepStats(f"step_stats.{key} is out of range: {str(value)[:40]}")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_SECONDS):
        raise BadStepStats(f"step_stats.{key} must be finite and within [0, {MAX_SECONDS:g}], got {seconds}")
    return seconds


def parse_step_stats(data: str) -> StepStats | None:
    """The ``step_stats`` of a Quorum request's ``data``; None when there are none (a
    group's first round, a torchft client, ``data`` that is not a JSON object).

    Raises :class:`BadStepStats` when they are present but malformed. ``data`` has passed
    :func:`rallypoint.lighthouse.validate.data` (at most 64 KiB of JSON), but nothing else
    about it is trusted: types, ranges and finiteness are all checked here.
    """
    if not data or STATS_KEY not in data:  # cheap: most requests of torchft clients
        return None
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except BadStepStats:
        raise
    except (ValueError, RecursionError) as e:
        raise BadStepStats(f"data is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or STATS_KEY not in doc:
        return None
    raw = doc[STATS_KEY]
    if not isinstance(raw, dict):
        raise BadStepStats(f"step_stats must be a JSON object, got a JSON {type(raw).__name__}")
    outcome = raw.get("outcome")
    if not isinstance(outcome, str) or outcome not in OUTCOMES:
        shown = outcome[:40] if isinstance(outcome, str) else type(outcome).__name__
        raise BadStepStats(f"step_stats.outcome must be one of {', '.join(sorted(OUTCOMES))}, got {shown!r}")
    timings = {key: _seconds(raw, key, key == "compute_s") for key in TIMING_FIELDS}
    cause = raw.get("cause")
    if cause is not None and not isinstance(cause, str):
        raise BadStepStats(f"step_stats.cause must be a string, got {type(cause).__name__}")
    sdc, bad = raw.get("sdc"), raw.get("sdc_bad", [])
    if sdc is not None and sdc not in ("grad", "param"):
        raise BadStepStats("step_stats.sdc must be 'grad' or 'param'")
    if not isinstance(bad, list) or len(bad) > 8 or not all(isinstance(n, str) and 0 < len(n) <= 256 for n in bad):
        raise BadStepStats("step_stats.sdc_bad must be a list of at most 8 replica ids")
    return StepStats(
        sdc=sdc if outcome == "failed" else None,
        sdc_bad=tuple(bad) if outcome == "failed" else (),
        step=_int(raw, "step", True),
        outcome=outcome,
        round=_int(raw, "round", False),
        rank=_int(raw, "rank", False),
        cause=None if cause is None or outcome != "failed" else (cause if cause in CAUSES else "other"),
        rounds=max(1, _int(raw, "rounds", False)),
        **timings,
    )


# ------------------------------------------------------------------------------- rules
def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence (the mean of the middle two for an even count)."""
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def step_ratios(compute: Mapping[str, float]) -> dict[str, float]:
    """Each group's ``compute_s`` over the median of the *other* groups' (one step).

    Empty with fewer than two groups; a group whose others' median is zero gets no ratio.
    O(n log n): the median of the others is read off one sorted list, so a job with
    thousands of groups costs one sort per step.
    """
    n = len(compute)
    if n < 2:
        return {}
    ordered = sorted(compute.values())
    m = n - 1  # size of "the others"
    out: dict[str, float] = {}
    index: dict[float, int] = {}
    for i, v in enumerate(ordered):
        index.setdefault(v, i)  # any index holding v leaves the same multiset of others

    def others_at(k: int, skip: int) -> float:
        return ordered[k] if k < skip else ordered[k + 1]

    for group, value in compute.items():
        skip = index[value]
        if m % 2:
            med = others_at(m // 2, skip)
        else:
            med = (others_at(m // 2 - 1, skip) + others_at(m // 2, skip)) / 2
        if med > 0:
            out[group] = value / med
    return out


def verdict(ratios: Sequence[float], policy: Policy) -> Verdict:
    """Judge one group's window of ratios (oldest first)."""
    if not ratios:
        return Verdict(None, 0, False)
    votes = sum(1 for r in ratios if r >= policy.threshold)
    return Verdict(median(ratios), votes, votes >= policy.votes)


def decayed_strikes(strikes: int, clean_since: float | None, now: float, decay_s: float) -> int:
    """Past evictions still counted for the doubling: one fewer per ``decay_s`` clean."""
    if clean_since is None or strikes <= 0:
        return max(0, strikes)
    return max(0, strikes - int(max(0.0, now - clean_since) // decay_s))


def max_strikes(policy: Policy) -> int:
    """Evictions worth counting: the first count at which the cool-down reaches its cap.
    Counting further would only make a long-reformed group wait longer for the decay."""
    return max(0, math.ceil(math.log2(policy.max_cooldown_s / policy.cooldown_s)))


def cooldown_for(strikes: int, policy: Policy) -> float:
    """The cool-down of an eviction after ``strikes`` counted earlier ones: doubling, capped."""
    if strikes >= 64:  # 2**64 * anything is past any cap; keep the float finite
        return policy.max_cooldown_s
    return min(policy.cooldown_s * (2**strikes), policy.max_cooldown_s)


def choose_eviction(
    flagged: Mapping[str, float], live: Collection[str], excluded: Collection[str], min_replicas: int
) -> str | None:
    """The one flagged group to evict now, or None.

    ``flagged``: straggler -> score; ``live``: the healthy groups; ``excluded``: those
    already out. Only a live, not yet excluded group is a candidate, and only when at least
    ``min_replicas`` live groups would remain; the highest score goes (ties by id, so the
    choice is deterministic).
    """
    remaining = {g for g in live if g not in excluded}
    if len(remaining) - 1 < min_replicas:
        return None
    candidates = [g for g in flagged if g in remaining]
    if not candidates:
        return None
    return max(candidates, key=lambda g: (flagged[g], g))


# ------------------------------------------------------------------------------- state
@dataclass
class GroupState:
    """What is remembered of one group."""

    ratios: deque[float]
    flagged: bool = False
    excluded_until: float | None = None
    excluded_at: float = 0.0
    strikes: int = 0
    clean_since: float | None = None


class StragglerTracker:
    """Scores, flags and exclusions of every group, fed one report at a time.

    Deterministic and free of I/O (``now`` is an argument); the lighthouse's core holds one
    and calls it on its event-loop thread. Memory only: nothing survives a restart.
    """

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        self.evictions = 0
        self._groups: dict[str, GroupState] = {}
        self._open: dict[int, dict[str, float]] = {}  # step -> group -> compute_s
        self._closed_through = -1
        self._excluded: dict[str, float] = {}  # group -> until (monotonic)

    # --------------------------------------------------------------- input
    def observe(
        self,
        group: str,
        stats: StepStats,
        now: float,
        live: Callable[[], Collection[str]],
        min_replicas: int,
    ) -> list[Event]:
        """Take one group's report; return what changed (flags, an eviction).

        ``live`` is called only when an eviction is considered (it may cost a scan of every
        replica); ``min_replicas`` bounds evictions.
        """
        if stats.outcome not in COUNTED_OUTCOMES or group in self._excluded:
            return []  # not computed like the others, or out (judged afresh when back)
        if stats.step + STEP_RESET_GAP < self._closed_through:
            self._open.clear()  # the step counter went back: start over from here
            self._closed_through = stats.step - 1
        if stats.step <= self._closed_through:
            return []  # too late to compare
        self._open.setdefault(stats.step, {})[group] = stats.compute_s / stats.rounds  # per round
        self._groups.setdefault(group, GroupState(deque(maxlen=self.policy.window)))
        events: list[Event] = []
        closing = sorted(s for s in self._open if s < stats.step)
        for step in closing:
            events.extend(self._close(step))
        while len(self._open) > MAX_OPEN_STEPS:
            closing.append(min(self._open))
            events.extend(self._close(closing[-1]))
        # A decision point: a step was just judged.
        if closing and self.policy.mode == "evict":
            events.extend(self._maybe_evict(now, live(), min_replicas))
        return events

    def _close(self, step: int) -> list[Event]:
        reports = self._open.pop(step)
        self._closed_through = max(self._closed_through, step)
        events: list[Event] = []
        for group, ratio in step_ratios(reports).items():
            st = self._groups.get(group)
            if st is None or st.excluded_until is not None:
                continue  # forgotten meanwhile, or evicted since it reported
            st.ratios.append(ratio)
            v = verdict(st.ratios, self.policy)
            if v.flagged and not st.flagged:
                st.flagged = True
                events.append(Event(STRAGGLER, group, {"score": _round(v.score), "step": step,
                                                       "slow_votes": v.slow_votes, "window": len(st.ratios)}))
            elif st.flagged and not v.flagged:
                st.flagged = False
                events.append(Event(STRAGGLER_CLEARED, group, {"score": _round(v.score), "step": step,
                                                               "slow_votes": v.slow_votes}))
        return events

    def _maybe_evict(self, now: float, live: Collection[str], min_replicas: int) -> list[Event]:
        flagged: dict[str, float] = {}
        for g, st in self._groups.items():
            if st.flagged and st.excluded_until is None:
                score = verdict(st.ratios, self.policy).score
                flagged[g] = score if score is not None else 0.0
        if not flagged:
            return []
        group = choose_eviction(flagged, live, self._excluded, min_replicas)
        if group is None:
            return []
        st = self._groups[group]
        strikes = decayed_strikes(st.strikes, st.clean_since, now, self.policy.decay_s)
        cooldown = cooldown_for(strikes, self.policy)
        st.strikes = min(strikes + 1, max_strikes(self.policy))
        st.excluded_until = now + cooldown
        st.excluded_at = now
        self._excluded[group] = st.excluded_until
        self.evictions += 1
        return [Event(EVICTED, group, {"score": _round(flagged[group]), "step": self._closed_through,
                                       "cooldown_s": cooldown, "evictions": st.strikes}, until=st.excluded_until)]

    def due(self, now: float) -> list[Event]:
        """Readmit the groups whose cool-down has ended: exclusion lifted, window and flag
        cleared (fresh evidence needed to evict them again)."""
        events = []
        for group in [g for g, until in self._excluded.items() if until <= now]:
            del self._excluded[group]
            st = self._groups.get(group)
            if st is None:
                continue
            out_s = now - st.excluded_at
            for reports in self._open.values():
                reports.pop(group, None)  # fresh evidence only
            st.excluded_until = None
            st.flagged = False
            st.ratios.clear()
            st.clean_since = now
            events.append(Event(READMITTED, group, {"excluded_s": round(out_s, 3)}))
        return events

    def forget(self, group: str) -> None:
        """Drop everything about a group the lighthouse forgot (it left long ago)."""
        self._groups.pop(group, None)
        self._excluded.pop(group, None)
        for reports in self._open.values():
            reports.pop(group, None)

    # --------------------------------------------------------------- views
    def excluded(self, now: float) -> dict[str, float]:
        """Groups out of quorums now -> monotonic time their cool-down ends."""
        return {g: until for g, until in self._excluded.items() if until > now}

    def next_readmission(self) -> float | None:
        """When the earliest cool-down ends (monotonic), if any group is out."""
        return min(self._excluded.values(), default=None)

    def groups(self) -> Iterable[str]:
        return list(self._groups)

    def snapshot(self, group: str) -> dict[str, Any]:
        """``score``, ``slow_votes``, ``window`` (ratios held), ``flagged`` and
        ``excluded_until`` (monotonic, or None) of one group; zeros for an unknown one."""
        st = self._groups.get(group)
        if st is None:
            return {"score": None, "slow_votes": 0, "window": 0, "flagged": False, "excluded_until": None}
        v = verdict(st.ratios, self.policy)
        return {"score": _round(v.score), "slow_votes": v.slow_votes, "window": len(st.ratios),
                "flagged": st.flagged, "excluded_until": st.excluded_until}

    def flagged(self) -> list[str]:
        """The groups flagged as stragglers now (excluded ones included)."""
        return sorted(g for g, st in self._groups.items() if st.flagged)

    def scores(self) -> dict[str, float | None]:
        """Every tracked group's score (for the metrics gauge)."""
        return {g: verdict(st.ratios, self.policy).score for g, st in self._groups.items()}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


__all__ = [
    "CAUSES", "COUNTED_OUTCOMES", "EVICTED", "MAX_OPEN_STEPS", "OUTCOMES", "POLICIES", "READMITTED", "STEP_RESET_GAP", "STRAGGLER",
    "STRAGGLER_CLEARED", "BadStepStats", "Event", "GroupState", "Policy", "StepStats", "StragglerTracker",
    "Verdict", "choose_eviction", "cooldown_for", "decayed_strikes", "max_strikes", "median", "parse_step_stats",
    "step_ratios", "verdict",
]
