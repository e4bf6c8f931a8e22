"""Property tests (hypothesis) for the lighthouse's pure quorum rules: every formed quorum
keeps the invariants, deciding is deterministic and pure, waiting ends without new input.
The table tests of the same rules are in ``tests/test_quorum.py``."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.lighthouse.quorum import Decision, Member, Options, Pending, Quorum, Rule, View, decide, healthy_replicas

IDS = ["a", "b", "c", "d", "e", "f", "9", "10", "x1"]
T0 = 1000.0
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

times = st.floats(min_value=0.0, max_value=200.0, allow_nan=False, allow_infinity=False)


@st.composite
def scenarios(draw) -> tuple[float, View, Options]:
    rids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=len(IDS)))
    heartbeats: dict[str, float] = {}
    pending: dict[str, Pending] = {}
    for rid in rids:
        if draw(st.booleans()):
            heartbeats[rid] = T0 - draw(times)
        if draw(st.booleans()):
            m = Member(
                replica_id=rid,
                address=f"addr-{rid}",
                shrink_only=draw(st.booleans()) and draw(st.booleans()),
                commit_failures=draw(st.sampled_from([0, 0, 0, 1, 3])),
            )
            pending[rid] = Pending(m, T0 - draw(times))
    previous = None
    quorum_id = draw(st.integers(min_value=0, max_value=50))
    if draw(st.booleans()):
        prev_ids = draw(st.lists(st.sampled_from(IDS), unique=True, min_size=1))
        previous = Quorum(quorum_id, tuple(Member(r) for r in sorted(prev_ids)))
    options = Options(
        min_replicas=draw(st.integers(min_value=1, max_value=5)),
        join_timeout=draw(st.floats(min_value=0.0, max_value=100.0, allow_nan=False)),
        heartbeat_timeout=draw(st.floats(min_value=0.01, max_value=30.0, allow_nan=False)),
    )
    return T0, View(heartbeats, pending, previous, quorum_id), options


def _shrink_restricts(view: View) -> bool:
    """Whether shrink_only is in force: someone asked it and a previous member asks."""
    prev = set(view.previous.replica_ids) if view.previous else set()
    return any(p.member.shrink_only for p in view.pending.values()) and bool(prev & set(view.pending))


@PROPS
@given(scenarios())
def test_property_formed_quorum_invariants(sc) -> None:
    now, view, options = sc
    d = decide(now, view, options)
    if d.next_check is not None:
        assert d.next_check > now, d
    if not d.formed:
        assert d.quorum_id == view.quorum_id
        return
    ids = [m.replica_id for m in d.members]
    assert ids, d
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    for m in d.members:
        assert m.replica_id in view.pending
        assert m is view.pending[m.replica_id].member
    assert len(ids) >= options.min_replicas
    assert d.quorum_id >= view.quorum_id
    prev_ids = list(view.previous.replica_ids) if view.previous else None
    if prev_ids != ids:
        assert d.quorum_id == view.quorum_id + 1
    if _shrink_restricts(view):
        assert set(ids) <= set(prev_ids or ())
    else:
        assert set(ids) == set(view.pending)
    # Never a minority of the healthy replicas unless the previous quorum re-forms.
    if d.rule != Rule.FAST_PATH:
        assert 2 * len(view.pending) > len(healthy_replicas(now, view, options))


@PROPS
@given(scenarios())
def test_property_deterministic_and_pure(sc) -> None:
    now, view, options = sc
    snapshot = copy.deepcopy((dict(view.heartbeats), dict(view.pending), view.previous, view.quorum_id))
    first = decide(now, view, options)
    assert decide(now, view, options) == first
    assert (dict(view.heartbeats), dict(view.pending), view.previous, view.quorum_id) == snapshot
    # Independent of the order in which replicas were recorded.
    shuffled = View(
        dict(reversed(list(view.heartbeats.items()))),
        dict(reversed(list(view.pending.items()))),
        view.previous,
        view.quorum_id,
    )
    assert decide(now, shuffled, options) == first


@PROPS
@given(scenarios())
def test_property_waiting_ends_without_new_input(sc) -> None:
    """Advancing the clock to each reported next_check, with no new input, ends in a
    formed quorum or in a wait only new requests can end (too few candidates)."""
    now, view, options = sc
    for _ in range(len(IDS) + 3):
        d = decide(now, view, options)
        if d.next_check is None:
            break
        assert d.next_check > now
        now = d.next_check
    else:
        pytest.fail("next_check kept moving without new input")
    assert d.formed or d.rule in (Rule.NO_PARTICIPANTS, Rule.WAIT_MIN_REPLICAS), d.reason


events = st.lists(
    st.tuples(
        st.sampled_from(["ask", "ask", "beat"]),
        st.sampled_from(IDS[:6]),
        st.booleans(),  # shrink_only (mostly false: drawn twice below)
        st.booleans(),
        st.sampled_from([0, 0, 0, 1]),  # commit_failures
        st.floats(min_value=0.0, max_value=8.0, allow_nan=False),  # time since previous event
    ),
    max_size=30,
)


@PROPS
@given(
    events,
    st.integers(min_value=1, max_value=4),
    st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    st.floats(min_value=0.5, max_value=6.0, allow_nan=False),
)
def test_property_sequence_contains_requester(evs, min_replicas, join_timeout, heartbeat_timeout) -> None:
    """Requests arrive one at a time, the lighthouse decides after each (and at every
    next_check in between); a quorum formed right after an arrival contains that
    requester unless shrink_only held it back; quorum_id never decreases."""
    options = Options(min_replicas=min_replicas, join_timeout=join_timeout, heartbeat_timeout=heartbeat_timeout)
    now = T0
    heartbeats: dict[str, float] = {}
    pending: dict[str, Pending] = {}
    previous: Quorum | None = None
    quorum_id = 0
    next_check: float | None = None

    def step(at: float) -> Decision:
        nonlocal previous, quorum_id
        view = View(dict(heartbeats), dict(pending), previous, quorum_id)
        d = decide(at, view, options)
        if d.next_check is not None:
            assert d.next_check > at
        assert d.quorum_id >= quorum_id
        if d.formed:
            assert len(d.members) >= min_replicas
            for m in d.members:
                del pending[m.replica_id]
                heartbeats[m.replica_id] = at
            previous = Quorum(d.quorum_id, d.members)
            quorum_id = d.quorum_id
        return d

    for kind, rid, s1, s2, failures, dt in evs:
        target = now + dt
        # The server re-evaluates at next_check between inputs.
        while next_check is not None and next_check <= target:
            now = next_check
            next_check = step(now).next_check
        now = target
        heartbeats[rid] = now  # a request is also a heartbeat
        if kind == "ask":
            if rid in pending:
                continue
            pending[rid] = Pending(Member(rid, shrink_only=s1 and s2, commit_failures=failures), now)
            before = View(dict(heartbeats), dict(pending), previous, quorum_id)
            d = step(now)
            if d.formed and rid not in [m.replica_id for m in d.members]:
                prev = set(before.previous.replica_ids) if before.previous else set()
                assert _shrink_restricts(before), d.reason
                assert rid not in prev, d.reason
        else:
            d = step(now)
        next_check = d.next_check
