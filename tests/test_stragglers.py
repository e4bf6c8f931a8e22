"""Straggler scores and the ``--stragglers report|evict`` policy (issue 15, part 2).

Table tests drive the pure pieces of :mod:`rallypoint.lighthouse.stragglers` (parsing,
ratios, the vote, cool-downs, the eviction choice) and the tracker with plain data;
``decide`` is driven with exclusions; one end-to-end test runs a real lighthouse with three
fake replica groups (threads with their own gRPC clients), one of them 3x slow.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.cli import format_status, main
from rallypoint.lighthouse import stragglers as sg
from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse.quorum import Member, Options, Pending, Quorum, Rule, View, decide
from rallypoint.lighthouse.stragglers import BadStepStats, Policy, StepStats, StragglerTracker

from conftest import replica_row, wait_until

GOOD = {"step": 4, "round": 9, "rank": 0, "outcome": "committed", "step_s": 0.5, "compute_s": 0.3,
        "quorum_wait_s": 0.01, "comm_s": 0.1, "heal_s": 0.0, "commit_s": 0.02}


def stats_data(**over: Any) -> str:
    return json.dumps({"loss": 1.0, "step_stats": dict(GOOD, **over)})


# ----------------------------------------------------------------------------- parsing
def test_parse_good_report() -> None:
    s = sg.parse_step_stats(stats_data())
    assert s == StepStats(step=4, outcome="committed", compute_s=0.3, round=9, rank=0, step_s=0.5,
                          quorum_wait_s=0.01, comm_s=0.1, heal_s=0.0, commit_s=0.02)
    # Only the fields scored are required; integers are seconds too.
    assert sg.parse_step_stats(json.dumps({"step_stats": {"step": 0, "outcome": "spare", "compute_s": 2}})) == \
        StepStats(step=0, outcome="spare", compute_s=2.0)


@pytest.mark.parametrize("data", ["", "{}", '{"loss": 1}', "[1, 2]", '"step_stats"', "null"],
                         ids=["empty", "empty-object", "other-keys", "list", "string", "null"])
def test_parse_absent_is_none(data: str) -> None:
    assert sg.parse_step_stats(data) is None


BAD = {
    "not-an-object": json.dumps({"step_stats": [1, 2]}),
    "step-string": stats_data(step="4"),
    "step-bool": stats_data(step=True),
    "step-float": stats_data(step=4.0),
    "step-negative": stats_data(step=-1),
    "step-huge": stats_data(step=2**70),
    "round-negative": stats_data(round=-3),
    "outcome-unknown": stats_data(outcome="great"),
    "outcome-missing": json.dumps({"step_stats": {"step": 1, "compute_s": 1.0}}),
    "compute-missing": json.dumps({"step_stats": {"step": 1, "outcome": "committed"}}),
    "compute-negative": stats_data(compute_s=-0.1),
    "compute-too-big": stats_data(compute_s=1e6 + 1),
    "compute-huge-int": stats_data(compute_s=10**400),
    "compute-string": stats_data(compute_s="0.3"),
    "compute-null": stats_data(compute_s=None),
    "compute-nan": '{"step_stats": {"step": 1, "outcome": "committed", "compute_s": NaN}}',
    "comm-infinity": '{"step_stats": {"step": 1, "outcome": "committed", "compute_s": 1, "comm_s": Infinity}}',
    "heal-bool": stats_data(heal_s=False),
    "not-json": '{"step_stats": ',
}


@pytest.mark.parametrize("data", list(BAD.values()), ids=list(BAD))
def test_parse_malformed_raises(data: str) -> None:
    with pytest.raises(BadStepStats):
        sg.parse_step_stats(data)


# ------------------------------------------------------------------------------ ratios
@pytest.mark.parametrize(
    "compute, expected",
    [
        ({}, {}),
        ({"a": 1.0}, {}),
        ({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}),
        ({"a": 3.0, "b": 1.0}, {"a": 3.0, "b": 1 / 3}),
        ({"a": 1.0, "b": 1.0, "c": 3.0}, {"a": 0.5, "b": 0.5, "c": 3.0}),
        ({"a": 1.0, "b": 2.0, "c": 3.0, "d": 9.0}, {"a": 1 / 3, "b": 2 / 3, "c": 1.5, "d": 4.5}),
        ({"a": 0.0, "b": 1.0}, {"a": 0.0}),  # b's only other is zero: no ratio for b
        ({"a": 0.0, "b": 0.0, "c": 1.0}, {"a": 0.0, "b": 0.0}),
    ],
    ids=["none", "one-group", "two-equal", "two-3x", "three-one-slow", "four", "zero-median", "zeros"],
)
def test_step_ratios(compute: dict[str, float], expected: dict[str, float]) -> None:
    got = sg.step_ratios(compute)
    assert got.keys() == expected.keys()
    for g, r in expected.items():
        assert got[g] == pytest.approx(r)


def test_step_ratios_match_the_definition() -> None:
    """The sorted-list shortcut equals 'median of the others' computed the slow way."""
    rng = random.Random(15)
    for _ in range(300):
        n = rng.randint(2, 9)
        compute = {f"g{i}": rng.choice([0.0, 1.0, 1.0, 2.5, rng.uniform(0, 5)]) for i in range(n)}
        want = {}
        for g, v in compute.items():
            med = sg.median([w for h, w in compute.items() if h != g])
            if med > 0:
                want[g] = v / med
        assert sg.step_ratios(compute) == pytest.approx(want)


@pytest.mark.parametrize(
    "ratios, score, votes, flagged",
    [
        ([], None, 0, False),
        ([3.0], 3.0, 1, False),
        ([1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1.0, 1, False),
        ([3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0], 2.0, 4, False),
        ([3.0, 3.0, 3.0, 3.0, 3.0], 3.0, 5, True),
        ([1.5, 1.5, 1.5, 1.5, 1.5, 1.0, 1.0, 1.0], 1.5, 5, True),  # at the threshold is slow
        ([1.49] * 8, 1.49, 0, False),
    ],
    ids=["empty", "one-slow", "one-slow-in-eight", "four-of-eight", "five-slow", "at-threshold", "just-under"],
)
def test_verdict(ratios: list[float], score: float | None, votes: int, flagged: bool) -> None:
    v = sg.verdict(ratios, Policy())
    assert v == sg.Verdict(score, votes, flagged)


@pytest.mark.parametrize("strikes, expected", [(0, 10.0), (1, 20.0), (2, 30.0), (3, 30.0), (10, 30.0), (500, 30.0)])
def test_cooldown_doubles_up_to_the_cap(strikes: int, expected: float) -> None:
    assert sg.cooldown_for(strikes, Policy(mode="evict")) == expected


@pytest.mark.parametrize(
    "strikes, clean_since, now, expected",
    [(3, None, 1000.0, 3), (3, 0.0, 299.0, 3), (3, 0.0, 300.0, 2), (3, 0.0, 650.0, 1), (3, 0.0, 5000.0, 0), (0, 0.0, 1.0, 0)],
)
def test_strikes_decay_while_clean(strikes: int, clean_since: float | None, now: float, expected: int) -> None:
    assert sg.decayed_strikes(strikes, clean_since, now, 300.0) == expected


@pytest.mark.parametrize(
    "flagged, live, excluded, min_replicas, expected",
    [
        ({"c": 3.0}, {"a", "b", "c"}, set(), 2, "c"),
        ({"c": 3.0}, {"a", "b", "c"}, set(), 3, None),  # never below min_replicas
        ({"b": 3.0}, {"a", "b"}, set(), 1, "b"),  # two groups
        ({"b": 3.0}, {"a", "b"}, set(), 2, None),
        ({"c": 3.0, "d": 4.0}, {"a", "b", "c", "d"}, set(), 1, "d"),  # one per decision: the worst
        ({"c": 3.0, "d": 3.0}, {"a", "b", "c", "d"}, set(), 1, "d"),  # tie: by id
        ({"c": 3.0}, {"a", "b", "c", "d"}, {"d"}, 2, "c"),
        ({"c": 3.0}, {"a", "b", "c", "d"}, {"d"}, 3, None),  # the excluded one does not count
        ({"c": 3.0}, {"a", "b"}, set(), 1, None),  # not live: nothing to leave out
        ({"c": 3.0}, {"a", "b", "c"}, {"c"}, 1, None),  # already out
    ],
)
def test_choose_eviction(flagged: dict, live: set, excluded: set, min_replicas: int, expected: str | None) -> None:
    assert sg.choose_eviction(flagged, live, excluded, min_replicas) == expected


@pytest.mark.parametrize(
    "kwargs",
    [{"mode": "kick"}, {"threshold": 1.0}, {"threshold": math.nan}, {"threshold": math.inf}, {"window": 0},
     {"votes": 0}, {"window": 4, "votes": 5}, {"cooldown_s": 0}, {"cooldown_s": 61}, {"cooldown_s": math.nan},
     {"decay_s": 0}],
)
def test_policy_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Policy(**kwargs)


# ------------------------------------------------------------------------------ tracker
def feed(
    tracker: StragglerTracker,
    compute: dict[str, float],
    step: int,
    now: float = 0.0,
    live: set[str] | None = None,
    min_replicas: int = 1,
    outcome: str = "committed",
) -> list[sg.Event]:
    """Every group reports ``step`` (as each asks for the round after it)."""
    groups = set(compute) if live is None else live
    return [e for g, c in compute.items()
            for e in tracker.observe(g, StepStats(step, outcome, c), now, lambda: groups, min_replicas)]


def run(tracker: StragglerTracker, rounds: list[dict[str, float]], first_step: int = 0, **kw: Any) -> list[tuple[int, sg.Event]]:
    out = []
    for i, compute in enumerate(rounds):
        out += [(first_step + i, e) for e in feed(tracker, compute, first_step + i, **kw)]
    return out


def kinds(events: list[tuple[int, sg.Event]], group: str | None = None) -> list[str]:
    return [e.kind for _, e in events if group is None or e.group == group]


NORMAL3 = {"a": 1.0, "b": 1.1, "c": 0.9}
SLOW3 = {"a": 1.0, "b": 1.1, "c": 3.0}


@pytest.mark.parametrize(
    "rounds",
    [
        [NORMAL3] * 5 + [SLOW3] + [NORMAL3] * 14,  # one slow step
        ([SLOW3] + [NORMAL3]) * 10,  # every other step slow: 4 of 8 at most
        [SLOW3] * 4 + [NORMAL3] * 16,
        [{"a": 1.0, "b": 1.2}] * 20,  # two groups, 20% apart
    ],
    ids=["one-slow-step", "alternating", "four-slow-then-fine", "two-groups-close"],
)
def test_never_flagged(rounds: list[dict[str, float]]) -> None:
    t = StragglerTracker(Policy(mode="evict"))
    assert run(t, rounds) == []
    assert t.flagged() == [] and t.excluded(0.0) == {}


@pytest.mark.parametrize(
    "groups",
    [
        {"a": 1.0, "slow": 3.0},
        {"a": 1.0, "b": 1.05, "slow": 3.0},
        {"a": 1.0, "b": 1.05, "c": 0.95, "d": 1.1, "e": 1.0, "slow": 3.0},
    ],
    ids=["2-groups", "3-groups", "6-groups"],
)
def test_3x_slow_group_flagged_within_10_steps(groups: dict[str, float]) -> None:
    t = StragglerTracker(Policy())
    events = run(t, [groups] * 10)
    flagged = [(step, e) for step, e in events if e.kind == sg.STRAGGLER]
    assert [e.group for _, e in flagged] == ["slow"], events
    step, e = flagged[0]
    assert step < 10
    assert e.detail["score"] == pytest.approx(3.0 if len(groups) > 2 else 3.0, rel=0.1)
    assert e.detail["slow_votes"] == 5
    assert t.flagged() == ["slow"]
    assert t.excluded(100.0) == {}  # report mode never evicts
    snap = t.snapshot("slow")
    assert snap["flagged"] and snap["slow_votes"] >= 5 and snap["excluded_until"] is None


def test_unflagged_when_the_window_drops_below_the_votes() -> None:
    t = StragglerTracker(Policy())
    events = run(t, [SLOW3] * 8 + [NORMAL3] * 8)
    assert kinds(events, "c") == [sg.STRAGGLER, sg.STRAGGLER_CLEARED]
    cleared = next(step for step, e in events if e.kind == sg.STRAGGLER_CLEARED)
    # 8 slow ratios held: cleared once 4 normal ones pushed them down to 4 of 8.
    assert cleared == 8 + 4
    assert t.flagged() == []


def test_healing_spare_and_stale_reports_are_not_scored() -> None:
    t = StragglerTracker(Policy(votes=1, window=1))
    for outcome in ("healing", "spare"):
        assert feed(t, {"a": 1.0, "b": 9.0}, 0, outcome=outcome) == []
    assert t.groups() == []
    feed(t, {"a": 1.0, "b": 1.0}, 5)
    assert kinds([(0, e) for e in feed(t, {"a": 1.0, "b": 1.0}, 6)]) == []
    # Step 3 is older than the steps already closed: too late to compare, ignored.
    assert feed(t, {"b": 9.0}, 3) == []
    assert t.snapshot("b")["window"] == 1 and t.snapshot("b")["score"] == 1.0


def test_step_counter_going_back_restarts_scoring() -> None:
    """A job restarted from a checkpoint under a running lighthouse: its steps go back;
    scores carry on instead of waiting for the old step to come round again."""
    t = StragglerTracker(Policy())
    run(t, [NORMAL3] * 10, first_step=1000)
    assert t.snapshot("c")["window"] == 8
    run(t, [SLOW3] * 6, first_step=100)
    assert t.flagged() == ["c"]


def test_open_steps_are_bounded() -> None:
    t = StragglerTracker(Policy())
    for step in range(100):  # one group only reports: no ratios, but nothing piles up
        feed(t, {"a": 1.0}, step * 2)
    assert len(t._open) <= sg.MAX_OPEN_STEPS


def test_evict_then_readmit_clears_the_window() -> None:
    t = StragglerTracker(Policy(mode="evict"))
    events = run(t, [SLOW3] * 10, now=50.0)
    assert kinds(events, "c") == [sg.STRAGGLER, sg.EVICTED]  # at most one eviction: it is out now
    ev = next(e for _, e in events if e.kind == sg.EVICTED)
    assert ev.until == 60.0 and ev.detail["cooldown_s"] == 10.0
    assert t.excluded(50.0) == {"c": 60.0} and t.next_readmission() == 60.0
    assert t.snapshot("c")["excluded_until"] == 60.0
    assert t.evictions == 1
    # While out, its reports are not scored (it is judged afresh once back).
    feed(t, SLOW3, 10, now=55.0)
    assert t.due(59.9) == []
    back = t.due(60.0)
    assert [(e.kind, e.group) for e in back] == [(sg.READMITTED, "c")]
    assert back[0].detail["excluded_s"] == 10.0
    assert t.excluded(60.0) == {} and t.next_readmission() is None
    assert t.snapshot("c") == {"score": None, "slow_votes": 0, "window": 0, "flagged": False, "excluded_until": None}
    # Hysteresis: still slow, but it takes `votes` fresh slow steps to evict it again.
    again = run(t, [SLOW3] * 10, first_step=11, now=61.0)
    first_evict = next(step for step, e in again if e.kind == sg.EVICTED)
    assert first_evict - 11 >= 5
    assert next(e for _, e in again if e.kind == sg.EVICTED).detail["cooldown_s"] == 20.0  # doubled


def test_cooldown_doubles_on_repeats_and_decays_when_clean() -> None:
    policy = Policy(mode="evict", cooldown_s=10.0, max_cooldown_s=60.0)
    t = StragglerTracker(policy)
    step, now, cooldowns = 0, 0.0, []
    for _ in range(5):
        while True:
            events = feed(t, SLOW3, step, now=now)
            step += 1
            evicted = [e for e in events if e.kind == sg.EVICTED]
            if evicted:
                break
        cooldowns.append(evicted[0].detail["cooldown_s"])
        now = evicted[0].until or 0.0
        assert [e.kind for e in t.due(now)] == [sg.READMITTED]
    assert cooldowns == [10.0, 20.0, 40.0, 60.0, 60.0]
    # Strikes stop counting at the cap (3 for 10 s -> 60 s); clean for two decay periods
    # (10 min), two doublings are forgotten: 3 strikes -> 1 -> 20 s.
    assert sg.max_strikes(policy) == 3
    now += 600.0
    while not (evicted := [e for e in feed(t, SLOW3, step, now=now) if e.kind == sg.EVICTED]):
        step += 1
    assert evicted[0].detail["cooldown_s"] == 20.0


@pytest.mark.parametrize(
    "groups, min_replicas, evicted",
    [(SLOW3, 2, "c"), (SLOW3, 3, None), ({"a": 1.0, "c": 3.0}, 1, "c"), ({"a": 1.0, "c": 3.0}, 2, None)],
    ids=["3-groups-min-2", "3-groups-min-3", "2-groups-min-1", "2-groups-min-2"],
)
def test_never_below_min_replicas(groups: dict[str, float], min_replicas: int, evicted: str | None) -> None:
    t = StragglerTracker(Policy(mode="evict"))
    events = run(t, [groups] * 20, min_replicas=min_replicas)
    assert [e.group for _, e in events if e.kind == sg.EVICTED] == ([evicted] if evicted else [])
    assert t.flagged() == ["c"]  # flagged either way


def test_at_most_one_eviction_per_decision() -> None:
    t = StragglerTracker(Policy(mode="evict"))
    groups = {"a": 1.0, "b": 1.0, "c": 1.0, "s1": 3.0, "s2": 4.0}
    decisions = [feed(t, groups, step) for step in range(12)]
    evictions = [[e.group for e in d if e.kind == sg.EVICTED] for d in decisions]
    assert all(len(e) <= 1 for e in evictions)
    assert [g for e in evictions for g in e] == ["s2", "s1"]  # the worst first, the next one a step later


def test_report_mode_never_excludes_and_forget_drops_a_group() -> None:
    t = StragglerTracker(Policy(mode="report"))
    run(t, [SLOW3] * 20)
    assert t.flagged() == ["c"] and t.excluded(0.0) == {} and t.evictions == 0
    t.forget("c")
    assert "c" not in t.groups() and t.flagged() == []
    assert t.snapshot("c")["score"] is None


# ------------------------------------------------------------------- quorum exclusion
NOW = 100.0


def view(*, heartbeats: dict[str, float] | None = None, pending: dict[str, float] | None = None,
         previous: list[str] | None = None, quorum_id: int = 3, excluded: dict[str, float] | None = None) -> View:
    pend = {rid: Pending(Member(rid, address=f"http://{rid}:1"), joined) for rid, joined in (pending or {}).items()}
    prev = Quorum(quorum_id, tuple(Member(r) for r in sorted(previous))) if previous is not None else None
    return View(dict(heartbeats or {}), pend, prev, quorum_id, dict(excluded or {}))


EXCLUSION = [
    # (id, view kwargs, min_replicas, rule, members, quorum_id, next_check, reason text)
    ("fast-path-without-the-excluded-one",
     dict(pending={"a": 99.0, "b": 99.0, "c": 99.0}, previous=["a", "b", "c"], excluded={"c": 110.0}),
     2, Rule.FAST_PATH, ["a", "b"], 4, 110.0, "1 excluded (c)"),
    ("fast-path-after-eviction-same-members",
     dict(pending={"a": 99.0, "b": 99.0, "c": 99.0}, previous=["a", "b"], excluded={"c": 110.0}),
     2, Rule.FAST_PATH, ["a", "b"], 3, 110.0, None),
    ("not-waited-for",  # c heartbeats but is out: no join-timeout wait for it
     dict(heartbeats={"c": 99.5}, pending={"a": 99.0, "b": 99.0}, excluded={"c": 110.0}),
     1, Rule.FORMED, ["a", "b"], 4, None, None),
    ("not-counted-for-the-majority",  # without the exclusion 1 of 2 healthy would be no majority
     dict(heartbeats={"c": 99.5}, pending={"a": 99.0}, excluded={"c": 110.0}),
     1, Rule.FORMED, ["a"], 4, None, None),
    ("only-the-excluded-one-asks",
     dict(heartbeats={"a": 99.0, "b": 99.0}, pending={"c": 99.0}, previous=["a", "b"], excluded={"c": 110.0}),
     2, Rule.NO_PARTICIPANTS, None, 3, 110.0, None),
    ("waived-below-min-replicas",
     dict(pending={"a": 99.0, "b": 99.0, "c": 99.0}, previous=["a", "b", "c"], excluded={"c": 110.0}),
     3, Rule.FAST_PATH, ["a", "b", "c"], 3, None, "waived"),
    ("waived-when-a-peer-died",  # b is gone: a alone is below min_replicas=2, so c is back at once
     dict(heartbeats={"b": 90.0}, pending={"a": 99.0, "c": 99.0}, previous=["a", "b"], excluded={"c": 110.0}),
     2, Rule.FORMED, ["a", "c"], 4, None, "waived"),
    ("expired-exclusion-is-none",
     dict(pending={"a": 99.0, "b": 99.0, "c": 99.0}, previous=["a", "b", "c"], excluded={"c": NOW}),
     2, Rule.FAST_PATH, ["a", "b", "c"], 3, None, None),
    ("readmitted-waits-for-the-others",  # at the cool-down's end: a participant again, others not asking yet
     dict(heartbeats={"a": 99.0, "b": 99.0}, pending={"c": 99.0}, previous=["a", "b"], excluded={"c": NOW}),
     2, Rule.WAIT_MIN_REPLICAS, None, 3, 104.0, None),
    ("readmitted-joins-the-fast-path",
     dict(pending={"a": 99.9, "b": 99.9, "c": 95.0}, previous=["a", "b"], excluded={"c": 99.0}),
     2, Rule.FAST_PATH, ["a", "b", "c"], 4, None, None),
    ("excluded-and-silent-is-ignored",
     dict(heartbeats={"c": 80.0}, pending={"a": 99.0}, previous=["a"], excluded={"c": 110.0}),
     1, Rule.FAST_PATH, ["a"], 3, None, None),
]


@pytest.mark.parametrize("row", [pytest.param(r[1:], id=r[0]) for r in EXCLUSION])
def test_decide_with_exclusion(row: tuple) -> None:
    kw, min_replicas, rule, members, qid, next_check, reason = row
    d = decide(NOW, view(**kw), Options(min_replicas=min_replicas, join_timeout=60.0, heartbeat_timeout=5.0))
    assert d.rule == rule, d.reason
    assert (None if d.members is None else [m.replica_id for m in d.members]) == members, d.reason
    assert d.quorum_id == qid, d.reason
    assert d.next_check == next_check, d.reason
    if reason:
        assert reason in d.reason


IDS = ["a", "b", "c", "d", "e"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.sampled_from(IDS), st.floats(80.0, 100.0)),  # heartbeats
    st.dictionaries(st.sampled_from(IDS), st.floats(80.0, 100.0)),  # pending: joined
    st.one_of(st.none(), st.lists(st.sampled_from(IDS), min_size=1, unique=True)),
    st.dictionaries(st.sampled_from(IDS), st.floats(90.0, 120.0)),  # excluded: until
    st.integers(1, 4),
    st.floats(0.0, 30.0),
)
def test_property_exclusion(heartbeats, pending, previous, excluded, min_replicas, join_timeout) -> None:
    """An excluded replica is never in a quorum unless its exclusion was waived (too few
    healthy replicas without it); quorums keep min_replicas; waiting always ends."""
    v = view(heartbeats=heartbeats, pending=pending, previous=previous, excluded=excluded)
    options = Options(min_replicas=min_replicas, join_timeout=join_timeout, heartbeat_timeout=5.0)
    now = NOW
    for _ in range(20):
        d = decide(now, v, options)
        if d.next_check is not None:
            assert d.next_check > now
        if d.formed:
            assert d.members is not None and len(d.members) >= min_replicas
            out = {r for r, until in excluded.items() if until > now}
            if out & {m.replica_id for m in d.members}:
                assert "waived" in d.reason, d.reason
        if d.next_check is None or d.formed:
            break
        now = d.next_check
    else:
        pytest.fail("next_check kept moving without new input")


# ------------------------------------------------------------------------ metrics, CLI
def test_metrics_series_follow_the_scored_groups() -> None:
    m = LighthouseMetrics()
    m.set_stragglers({"a": 1.0, "c": 3.25, "new": None}, flagged=1, excluded=1)
    m.straggler_evicted()
    text = m.render().decode()
    assert 'rallypoint_straggler_score{replica_id="c"} 3.25' in text
    assert 'replica_id="new"' not in text
    assert "rallypoint_straggler_evictions_total 1.0" in text
    assert "rallypoint_straggler_excluded 1.0" in text and "rallypoint_stragglers 1.0" in text
    m.set_stragglers({"a": 1.0}, flagged=0, excluded=0)
    assert 'replica_id="c"' not in m.render().decode()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--straggler-votes", "9"], "votes must be between 1 and the window (8)"),
        (["--straggler-threshold", "0.9"], "threshold must be a finite ratio > 1"),
        (["--straggler-cooldown-s", "120"], "at most 30 s"),
        (["--straggler-window", "0", "--straggler-votes", "1"], "window must be between 1"),
    ],
)
def test_cli_rejects_bad_straggler_options(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["lighthouse", "--min-replicas", "1", "--state", ":memory:", "--bind", "127.0.0.1:0", "--http-bind", "off",
              "--stragglers", "evict", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "rallypoint lighthouse: error:" in err and message in err


def test_status_table_shows_scores() -> None:
    status = {
        "quorum_id": 2, "options": {"min_replicas": 1},
        "quorum": {"quorum_id": 2, "created": time.time(), "members": [{"replica_id": "a"}]},
        "stragglers": {"policy": "evict", "threshold": 1.5, "window": 8, "votes": 5, "excluded": ["c"],
                       "evictions_total": 1},
        "replicas": [
            {"replica_id": "a", "straggler": {"score": 1.0, "flagged": False, "excluded_until": None}},
            {"replica_id": "b", "straggler": {"score": 2.51, "flagged": True, "excluded_until": None}},
            {"replica_id": "c", "straggler": {"score": 3.0, "flagged": True, "excluded_until": time.time() + 9.6}},
            {"replica_id": "d", "straggler": {"score": None}},
        ],
    }
    lines = format_status(status).splitlines()
    assert "STRAGGLER" in next(line for line in lines if line.startswith("REPLICA"))
    row = {line.split()[0]: line for line in lines if line[:2] in ("a ", "b ", "c ", "d ")}
    assert "1.00" in row["a"] and "2.51 slow" in row["b"] and "3.00 excluded 10s" in row["c"]
    assert any("stragglers: evict" in line and "1 excluded" in line for line in lines)


# -------------------------------------------------------------------------- end to end
def test_malformed_step_stats_never_fail_the_request(lighthouse, client) -> None:
    lh = lighthouse(min_replicas=1)
    c = client(lh)
    for data in (stats_data(compute_s=-1), stats_data(outcome=7), '{"step_stats": null}', "[1]"):
        assert list(c.quorum("a", timeout=5.0, data=data).replica_ids) == ["a"]
    assert replica_row(lh.status(), "a")["straggler"]["window"] == 0


class Group(threading.Thread):
    """A fake replica group: asks for a quorum each step, reporting its previous round's
    timings with ``factor`` times the others' compute time; heals (catches up) when behind."""

    def __init__(self, lh_address: str, rid: str, factor: float, stop: threading.Event, log: list, cond: threading.Condition) -> None:
        super().__init__(name=f"group-{rid}", daemon=True)
        self.client = LighthouseClient(lh_address, connect_timeout=5.0)
        self.rid, self.factor, self.stop, self.log, self.cond = rid, factor, stop, log, cond
        self.error: BaseException | None = None

    def run(self) -> None:
        step, rnd, stats = 0, 0, None
        try:
            while not self.stop.is_set():
                data = json.dumps({"step_stats": stats} if stats else {})
                q = self.client.quorum(self.rid, timeout=10.0, step=step, data=data)
                with self.cond:
                    self.log.append((self.rid, time.monotonic(), q.quorum_id, q.replica_ids))
                    self.cond.notify_all()
                top = max(m.step for m in q.members)
                outcome = "committed" if step == top else "healing"
                compute = 0.01 * self.factor
                stats = {"step": top, "round": rnd, "rank": 0, "outcome": outcome, "step_s": compute + 0.002,
                         "compute_s": compute, "quorum_wait_s": 0.0, "comm_s": 0.001, "heal_s": 0.0, "commit_s": 0.0}
                step, rnd = top + 1, rnd + 1
                self.stop.wait(0.002)  # the step's own work
        except Exception as e:  # noqa: BLE001 - the lighthouse going away at teardown ends the loop
            if not self.stop.is_set():
                self.error = e
        finally:
            self.client.close()


def test_end_to_end_flag_evict_and_readmit(lighthouse) -> None:
    lh = lighthouse(min_replicas=2, http_bind="127.0.0.1:0",
                    stragglers=Policy(mode="evict", cooldown_s=0.5))
    http = lh.http_address()
    stop, cond, log = threading.Event(), threading.Condition(), []
    groups = [Group(lh.local_address(), rid, factor, stop, log, cond) for rid, factor in (("a", 1.0), ("b", 1.0), ("c", 3.0))]
    try:
        for g in groups:
            g.start()

        def excluded_status() -> dict | None:
            doc = httpx.get(f"{http}/status", timeout=5.0).json()
            row = replica_row(doc, "c")
            return doc if row and row["straggler"]["excluded_until"] is not None else None

        doc = wait_until(excluded_status, timeout=15.0, interval=0.01, what="c excluded in /status")
        t_out = time.monotonic()
        c_row = replica_row(doc, "c")["straggler"]
        assert c_row["flagged"] and c_row["score"] == pytest.approx(3.0, rel=0.2) and c_row["slow_votes"] >= 5
        assert c_row["excluded_until"] > time.time() - 1.0
        for rid in ("a", "b"):
            s = replica_row(doc, rid)["straggler"]
            assert not s["flagged"] and s["excluded_until"] is None
        assert doc["stragglers"]["policy"] == "evict" and doc["stragglers"]["excluded"] == ["c"]
        assert doc["stragglers"]["evictions_total"] >= 1

        with cond:
            # The next quorums form without it...
            assert cond.wait_for(lambda: any(r == "a" and t > t_out and ids == ("a", "b") for r, t, _, ids in log), 10.0)
            # ...and it is readmitted after the cool-down (its waiting call answered with everyone).
            assert cond.wait_for(lambda: any(r == "c" and t > t_out and "a" in ids for r, t, _, ids in log), 10.0)
            t_back = next(t for r, t, _, ids in log if r == "c" and t > t_out)
        assert t_back - t_out < 5.0

        events = httpx.get(f"{http}/events", params={"replica_id": "c", "limit": 100}, timeout=5.0).json()
        seen = [e["kind"] for e in events if e["kind"] in (sg.STRAGGLER, sg.EVICTED, sg.READMITTED)]
        assert seen[:3] == [sg.STRAGGLER, sg.EVICTED, sg.READMITTED], events
        evicted = next(e for e in events if e["kind"] == sg.EVICTED)
        assert evicted["detail"]["cooldown_s"] == 0.5 and evicted["detail"]["until"] > evicted["time"]
        assert not [e for e in httpx.get(f"{http}/events", timeout=5.0).json()
                    if e["kind"] == sg.EVICTED and e["replica_id"] != "c"]

        metrics = httpx.get(f"{http}/metrics", timeout=5.0).text
        assert 'rallypoint_straggler_score{replica_id="c"}' in metrics
        assert "rallypoint_straggler_evictions_total" in metrics
    finally:
        stop.set()
        lh.shutdown()  # answers (with an error) any call still waiting, so every thread ends
        for g in groups:
            g.join(10.0)
    assert not any(g.is_alive() for g in groups)
    assert [g.error for g in groups] == [None, None, None]
