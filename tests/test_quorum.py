"""Table-driven and property tests for the lighthouse's pure quorum rules.

Every row of the tables is plain data: heartbeats (replica -> last heartbeat time),
pending requests (replica -> join time), which pending replicas asked ``shrink_only`` or
report ``commit_failures``, the previous quorum's member ids, the last quorum_id, the
options and ``now``; and the expected rule, member ids, quorum_id and next_check.
"""

from __future__ import annotations

from typing import Any

import pytest

from rallypoint.lighthouse.quorum import (
    Decision,
    Member,
    Options,
    Pending,
    Quorum,
    Rule,
    View,
    decide,
    forgettable,
    healthy_replicas,
    next_quorum_id,
)

NOW = 100.0
HB = 5.0  # default heartbeat_timeout in the tables
JOIN = 60.0  # default join_timeout in the tables


# --------------------------------------------------------------------------- helpers
def member(rid: str, *, shrink_only: bool = False, commit_failures: int = 0) -> Member:
    return Member(
        replica_id=rid,
        address=f"http://{rid}:1",
        store_address=f"{rid}:2",
        step=7,
        world_size=2,
        shrink_only=shrink_only,
        commit_failures=commit_failures,
    )


def build_view(
    *,
    heartbeats: dict[str, float] | None = None,
    pending: dict[str, float] | None = None,
    shrink: tuple[str, ...] = (),
    failures: dict[str, int] | None = None,
    previous: list[str] | None = None,
    quorum_id: int = 0,
) -> View:
    failures = failures or {}
    pend = {
        rid: Pending(member(rid, shrink_only=rid in shrink, commit_failures=failures.get(rid, 0)), joined)
        for rid, joined in (pending or {}).items()
    }
    prev = None
    if previous is not None:
        prev = Quorum(quorum_id, tuple(member(rid) for rid in sorted(previous)), created=1.0)
    return View(heartbeats=dict(heartbeats or {}), pending=pend, previous=prev, quorum_id=quorum_id)


def case(
    id: str,
    *,
    heartbeats: dict[str, float] | None = None,
    pending: dict[str, float] | None = None,
    shrink: tuple[str, ...] = (),
    failures: dict[str, int] | None = None,
    previous: list[str] | None = None,
    quorum_id: int = 0,
    min_replicas: int = 1,
    join_timeout: float = JOIN,
    heartbeat_timeout: float = HB,
    now: float = NOW,
    rule: Rule,
    members: list[str] | None = None,
    qid: int | None = None,
    next_check: float | None = None,
    reason_has: tuple[str, ...] = (),
) -> Any:
    row = dict(
        heartbeats=heartbeats or {},
        pending=pending or {},
        shrink=shrink,
        failures=failures or {},
        previous=previous,
        quorum_id=quorum_id,
        min_replicas=min_replicas,
        join_timeout=join_timeout,
        heartbeat_timeout=heartbeat_timeout,
        now=now,
        rule=rule,
        members=members,
        qid=quorum_id if qid is None else qid,
        next_check=next_check,
        reason_has=reason_has,
    )
    return pytest.param(row, id=id)


def run_row(row: dict[str, Any]) -> Decision:
    view = build_view(
        heartbeats=row["heartbeats"],
        pending=row["pending"],
        shrink=row["shrink"],
        failures=row["failures"],
        previous=row["previous"],
        quorum_id=row["quorum_id"],
    )
    options = Options(
        min_replicas=row["min_replicas"],
        join_timeout=row["join_timeout"],
        heartbeat_timeout=row["heartbeat_timeout"],
    )
    return decide(row["now"], view, options)


def check_row(row: dict[str, Any]) -> None:
    d = run_row(row)
    assert d.rule == row["rule"], d.reason
    if row["members"] is None:
        assert d.members is None, d.reason
        assert not d.formed
    else:
        assert d.members is not None, d.reason
        assert d.formed
        assert [m.replica_id for m in d.members] == row["members"], d.reason
        # The members handed out are the requesters' own Member records.
        for m in d.members:
            assert m.address == f"http://{m.replica_id}:1"
    assert d.quorum_id == row["qid"], d.reason
    if row["next_check"] is None:
        assert d.next_check is None, d.reason
    else:
        assert d.next_check == pytest.approx(row["next_check"]), d.reason
        assert d.next_check > row["now"]
    for text in row["reason_has"]:
        assert text in d.reason, d.reason


# ----------------------------------------------------------------------------- tables
BASIC = [
    case("no-participants/empty", quorum_id=7, rule=Rule.NO_PARTICIPANTS),
    case(
        "no-participants/only-heartbeats",
        heartbeats={"a": 99.0, "b": 98.0},
        previous=["a", "b"],
        quorum_id=3,
        rule=Rule.NO_PARTICIPANTS,
    ),
    case(
        "min-replicas/1-of-2-waits",
        pending={"a": 99.0},
        min_replicas=2,
        rule=Rule.WAIT_MIN_REPLICAS,
        reason_has=("min_replicas=2",),
    ),
    case(
        "min-replicas/healthy-idle-replica-does-not-count",
        heartbeats={"b": 98.0},
        pending={"a": 99.0},
        min_replicas=2,
        rule=Rule.WAIT_MIN_REPLICAS,
        next_check=98.0 + HB,
    ),
    case(
        "min-replicas/met-exactly",
        pending={"a": 99.0, "b": 99.5},
        min_replicas=2,
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=1,
    ),
    case(
        "min-replicas/3-of-5-when-min-is-4-waits",
        heartbeats={"d": 99.0, "e": 99.0},
        pending={"a": 99.0, "b": 99.0, "c": 99.0},
        min_replicas=4,
        rule=Rule.WAIT_MIN_REPLICAS,
        next_check=99.0 + HB,
    ),
    case(
        "min-replicas/fast-path-respects-min",
        pending={"a": 99.0},
        previous=["a"],
        quorum_id=4,
        min_replicas=2,
        rule=Rule.WAIT_MIN_REPLICAS,
    ),
]

HALF_RULE = [
    case(
        "half/1-of-2-waits",
        heartbeats={"b": 99.0},
        pending={"a": 99.0},
        rule=Rule.WAIT_MAJORITY,
        next_check=99.0 + HB,
        reason_has=("split-brain",),
    ),
    case(
        "half/2-of-4-waits",
        heartbeats={"c": 98.0, "d": 99.0},
        pending={"a": 99.0, "b": 99.0},
        rule=Rule.WAIT_MAJORITY,
        next_check=98.0 + HB,  # the earliest expiry can change the outcome
    ),
    case(
        "half/2-of-4-waits-even-after-join-timeout",
        heartbeats={"c": 98.0, "d": 99.0},
        pending={"a": 1.0, "b": 2.0},
        rule=Rule.WAIT_MAJORITY,
        next_check=98.0 + HB,
    ),
    case(
        "half/3-of-5-passes-then-waits-for-stragglers",
        heartbeats={"d": 99.0, "e": 99.0},
        pending={"a": 90.0, "b": 95.0, "c": 99.0},
        rule=Rule.WAIT_STRAGGLERS,
        next_check=99.0 + HB,
        reason_has=("d", "e"),
    ),
    case(
        "half/3-of-5-forms",
        heartbeats={"d": 99.0, "e": 99.0},
        pending={"a": 30.0, "b": 35.0, "c": 39.0},
        rule=Rule.FORMED_AFTER_JOIN_TIMEOUT,
        members=["a", "b", "c"],
        qid=1,
    ),
    case(
        "half/2-of-3-forms",
        heartbeats={"c": 99.0},
        pending={"a": 30.0, "b": 99.0},
        rule=Rule.FORMED_AFTER_JOIN_TIMEOUT,
        members=["a", "b"],
        qid=1,
    ),
    case(
        "half/2-of-3-forms-with-zero-join-timeout",
        heartbeats={"c": 99.0},
        pending={"a": 99.9, "b": 99.9},
        join_timeout=0.0,
        rule=Rule.FORMED_AFTER_JOIN_TIMEOUT,
        members=["a", "b"],
        qid=1,
    ),
    case(
        "half/expired-heartbeat-is-not-healthy",
        heartbeats={"b": 90.0},
        pending={"a": 99.0},
        rule=Rule.FORMED,
        members=["a"],
        qid=1,
    ),
    case(
        "half/heartbeat-exactly-timeout-old-is-dead",
        heartbeats={"b": NOW - HB},
        pending={"a": 99.0},
        rule=Rule.FORMED,
        members=["a"],
        qid=1,
    ),
    case(
        "half/heartbeat-just-younger-than-timeout-is-alive",
        heartbeats={"b": NOW - HB + 0.25},
        pending={"a": 99.0},
        rule=Rule.WAIT_MAJORITY,
        next_check=NOW + 0.25,
    ),
    case(
        # Decided exactly at a reported next_check: the expiring heartbeat must be
        # gone, not reported again as next_check == now (float rounding of
        # (last + timeout) - timeout must not keep it alive).
        "half/at-reported-expiry-the-heartbeat-is-gone",
        heartbeats={"b": 506.295},
        pending={"a": 506.0},
        heartbeat_timeout=7.504,
        now=506.295 + 7.504,
        rule=Rule.FORMED,
        members=["a"],
        qid=1,
    ),
    case(
        "pending/keeps-replica-healthy-with-stale-or-no-heartbeat",
        heartbeats={"a": 10.0},  # a's heartbeat is long stale, b never sent one
        pending={"a": 99.0, "b": 99.0},
        min_replicas=2,
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=1,
    ),
    case(
        "pending/stale-requesters-count-as-healthy-for-the-half-rule",
        heartbeats={"a": 10.0, "c": 99.0, "d": 99.0},
        pending={"a": 99.0, "b": 99.0},
        rule=Rule.WAIT_MAJORITY,  # healthy = {a, b, c, d}: 2 of 4
        next_check=99.0 + HB,
    ),
]

FAST_PATH = [
    case(
        "fast/all-previous-asking-forms-despite-idle-healthy-replicas",
        heartbeats={"c": 99.0, "d": 99.0, "e": 99.0},
        pending={"a": 99.9, "b": 99.9},
        previous=["a", "b"],
        quorum_id=5,
        rule=Rule.FAST_PATH,
        members=["a", "b"],
        qid=5,
    ),
    case(
        "fast/ignores-join-timeout",
        heartbeats={"b": 99.9},
        pending={"a": NOW},
        previous=["a"],
        quorum_id=2,
        rule=Rule.FAST_PATH,
        members=["a"],
        qid=2,
    ),
    case(
        "fast/includes-joiners",
        heartbeats={"d": 99.0},
        pending={"a": 99.0, "b": 99.0, "c": 99.5},
        previous=["a", "b"],
        quorum_id=5,
        rule=Rule.FAST_PATH,
        members=["a", "b", "c"],
        qid=6,
    ),
    case(
        "fast/shrink-only-leaves-newcomers-out",
        pending={"a": 99.0, "b": 99.0, "c": 99.5},
        shrink=("a",),
        previous=["a", "b"],
        quorum_id=5,
        rule=Rule.FAST_PATH,
        members=["a", "b"],
        qid=5,
    ),
    case(
        "fast/shrink-only-asked-by-the-newcomer-itself",
        pending={"a": 99.0, "b": 99.0, "c": 99.5},
        shrink=("c",),
        previous=["a", "b"],
        quorum_id=5,
        rule=Rule.FAST_PATH,
        members=["a", "b"],
        qid=5,
    ),
    case(
        "fast/not-taken-when-a-previous-member-is-missing",
        heartbeats={"c": 99.0},
        pending={"a": 99.0, "b": 99.0},
        previous=["a", "b", "c"],
        quorum_id=5,
        rule=Rule.WAIT_STRAGGLERS,
        next_check=99.0 + HB,
        reason_has=("c",),
    ),
]

SHRINK_ONLY = [
    case(
        # torchft 0.2.0 answers this with an empty quorum.
        "shrink/torchft-bug-lone-newcomer-previous-dead",
        heartbeats={"a": 10.0, "c": 99.0},
        pending={"c": 99.0},
        shrink=("c",),
        previous=["a"],
        quorum_id=3,
        rule=Rule.FORMED,
        members=["c"],
        qid=4,
    ),
    case(
        "shrink/lone-newcomer-previous-forgotten",
        pending={"c": 99.0},
        shrink=("c",),
        previous=["a"],
        quorum_id=3,
        rule=Rule.FORMED,
        members=["c"],
        qid=4,
    ),
    case(
        "shrink/lone-newcomer-previous-alive-but-idle-waits",
        heartbeats={"a": 98.0},
        pending={"c": 99.0},
        shrink=("c",),
        previous=["a"],
        quorum_id=3,
        rule=Rule.WAIT_MAJORITY,
        next_check=98.0 + HB,
    ),
    case(
        "shrink/lone-newcomer-forms-once-previous-expired",
        heartbeats={"a": 98.0},
        pending={"c": 99.0},
        shrink=("c",),
        previous=["a"],
        quorum_id=3,
        now=98.0 + HB,
        rule=Rule.FORMED,
        members=["c"],
        qid=4,
    ),
    case(
        "shrink/never-below-min-replicas",
        pending={"a": 99.0, "c": 99.0},
        shrink=("a",),
        previous=["a", "b"],
        quorum_id=3,
        min_replicas=2,
        rule=Rule.WAIT_MIN_REPLICAS,
    ),
    case(
        "shrink/never-below-min-replicas-even-after-join-timeout",
        pending={"a": 1.0, "c": 1.0, "d": 1.0},
        shrink=("a",),
        previous=["a", "b"],
        quorum_id=3,
        min_replicas=2,
        rule=Rule.WAIT_MIN_REPLICAS,
    ),
    case(
        "shrink/held-back-newcomers-do-not-block-the-half-rule",
        heartbeats={"b": 10.0},
        pending={"a": 99.0, "d": 99.0},
        shrink=("a",),
        previous=["a", "b"],
        quorum_id=3,
        rule=Rule.FORMED,
        members=["a"],
        qid=4,
        reason_has=("newcomers held back",),
    ),
    case(
        "shrink/held-back-newcomers-2-of-4-do-not-block",
        heartbeats={"c": 10.0},
        pending={"a": 99.0, "b": 99.0, "d": 99.0, "e": 99.0},
        shrink=("a", "b"),
        previous=["a", "b", "c"],
        quorum_id=3,
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=4,
    ),
    case(
        "shrink/waits-for-previous-member-straggler",
        heartbeats={"c": 99.0},
        pending={"a": 95.0, "b": 99.0, "d": 99.0},
        shrink=("a",),
        previous=["a", "b", "c"],
        quorum_id=3,
        rule=Rule.WAIT_STRAGGLERS,
        next_check=99.0 + HB,
        reason_has=("c",),
    ),
    case(
        "shrink/drops-newcomers-after-join-timeout",
        heartbeats={"c": 99.0},
        pending={"a": 30.0, "b": 35.0, "d": 39.0},
        shrink=("a",),
        previous=["a", "b", "c"],
        quorum_id=3,
        rule=Rule.FORMED_AFTER_JOIN_TIMEOUT,
        members=["a", "b"],
        qid=4,
    ),
    case(
        # A healthy newcomer that has not asked could never join a shrink_only quorum:
        # no reason to wait join_timeout for it.
        "shrink/does-not-wait-for-an-idle-newcomer",
        heartbeats={"c": 10.0, "d": 99.0},
        pending={"a": 99.0, "b": 99.0},
        shrink=("a",),
        previous=["a", "b", "c"],
        quorum_id=3,
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=4,
    ),
    case(
        "shrink/without-previous-quorum-is-a-plain-request",
        pending={"a": 99.0, "b": 99.0},
        shrink=("a", "b"),
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=1,
    ),
]

JOIN_TIMEOUT = [
    case(
        "join/waits-for-healthy-straggler-until-deadline",
        heartbeats={"c": 99.5},
        pending={"a": 98.0, "b": 99.0},
        join_timeout=4.0,
        rule=Rule.WAIT_STRAGGLERS,
        next_check=98.0 + 4.0,  # deadline from the FIRST participant, before c expires
        reason_has=("c",),
    ),
    case(
        "join/waits-with-earlier-heartbeat-expiry-as-next-check",
        heartbeats={"c": 99.5},
        pending={"a": 98.0, "b": 99.0},
        rule=Rule.WAIT_STRAGGLERS,
        next_check=99.5 + HB,
        reason_has=("c",),
    ),
    case(
        "join/forms-exactly-at-deadline",
        heartbeats={"c": 99.5},
        pending={"a": 96.0, "b": 99.0},
        join_timeout=4.0,
        rule=Rule.FORMED_AFTER_JOIN_TIMEOUT,
        members=["a", "b"],
        qid=1,
        reason_has=("straggler",),
    ),
    case(
        "join/forms-after-deadline",
        heartbeats={"c": 99.5},
        pending={"a": 10.0, "b": 99.0},
        rule=Rule.FORMED_AFTER_JOIN_TIMEOUT,
        members=["a", "b"],
        qid=1,
    ),
    case(
        "join/straggler-heartbeat-expiry-is-next-check",
        heartbeats={"c": 97.0},
        pending={"a": 98.0, "b": 99.0},
        rule=Rule.WAIT_STRAGGLERS,
        next_check=97.0 + HB,
        reason_has=("c",),
    ),
    case(
        "join/after-straggler-expiry-forms-without-waiting",
        heartbeats={"c": 97.0},
        pending={"a": 98.0, "b": 99.0},
        now=97.0 + HB,
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=1,
    ),
    case(
        "join/many-stragglers-reason-is-bounded",
        heartbeats={s: 99.0 for s in "defghij"},
        pending={x: 99.0 for x in "abcklmnopqrs"},
        rule=Rule.WAIT_STRAGGLERS,
        next_check=99.0 + HB,
        reason_has=("7 healthy straggler(s)", "d, e, f, g, h ..."),
    ),
]

QUORUM_ID = [
    case(
        "qid/first-quorum-bumps",
        pending={"a": 99.0},
        rule=Rule.FORMED,
        members=["a"],
        qid=1,
    ),
    case(
        "qid/first-quorum-after-restart-bumps-from-stored-id",
        pending={"a": 99.0},
        quorum_id=41,
        rule=Rule.FORMED,
        members=["a"],
        qid=42,
    ),
    case(
        "qid/member-added",
        pending={"a": 99.0, "b": 99.0, "c": 99.0},
        previous=["a", "b"],
        quorum_id=9,
        rule=Rule.FAST_PATH,
        members=["a", "b", "c"],
        qid=10,
    ),
    case(
        "qid/member-removed",
        heartbeats={"c": 10.0},
        pending={"a": 99.0, "b": 99.0},
        previous=["a", "b", "c"],
        quorum_id=9,
        rule=Rule.FORMED,
        members=["a", "b"],
        qid=10,
    ),
    case(
        "qid/different-ids-same-count",
        heartbeats={"b": 10.0},
        pending={"a": 99.0, "c": 99.0},
        previous=["a", "b"],
        quorum_id=9,
        rule=Rule.FORMED,
        members=["a", "c"],
        qid=10,
    ),
    case(
        "qid/commit-failures-same-members-bumps",
        pending={"a": 99.0, "b": 99.0},
        failures={"b": 1},
        previous=["a", "b"],
        quorum_id=9,
        rule=Rule.FAST_PATH,
        members=["a", "b"],
        qid=10,
    ),
    case(
        "qid/same-members-no-failures-stays",
        pending={"a": 99.0, "b": 99.0},
        previous=["a", "b"],
        quorum_id=9,
        rule=Rule.FAST_PATH,
        members=["a", "b"],
        qid=9,
    ),
    case(
        "qid/waiting-keeps-id",
        heartbeats={"b": 99.0},
        pending={"a": 99.0},
        previous=["a", "b"],
        quorum_id=9,
        min_replicas=2,
        rule=Rule.WAIT_MIN_REPLICAS,
        qid=9,
        next_check=99.0 + HB,
    ),
]

SORTING = [
    case(
        "sort/members-by-replica-id-not-insertion-order",
        pending={"b": 99.0, "a": 99.0, "c": 99.0, "10": 99.0, "9": 99.0},
        rule=Rule.FORMED,
        members=["10", "9", "a", "b", "c"],
        qid=1,
    ),
    case(
        "sort/fast-path-sorted-too",
        pending={"c": 99.0, "10": 99.0, "b": 99.0, "9": 99.0, "a": 99.0},
        previous=["b", "a"],
        quorum_id=1,
        rule=Rule.FAST_PATH,
        members=["10", "9", "a", "b", "c"],
        qid=2,
    ),
]


@pytest.mark.parametrize("row", BASIC + HALF_RULE)
def test_participants_min_replicas_and_half_rule(row: dict[str, Any]) -> None:
    check_row(row)


@pytest.mark.parametrize("row", FAST_PATH)
def test_fast_path(row: dict[str, Any]) -> None:
    check_row(row)


@pytest.mark.parametrize("row", SHRINK_ONLY)
def test_shrink_only(row: dict[str, Any]) -> None:
    check_row(row)


@pytest.mark.parametrize("row", JOIN_TIMEOUT)
def test_join_timeout(row: dict[str, Any]) -> None:
    check_row(row)


@pytest.mark.parametrize("row", QUORUM_ID)
def test_quorum_id(row: dict[str, Any]) -> None:
    check_row(row)


@pytest.mark.parametrize("row", SORTING)
def test_members_sorted(row: dict[str, Any]) -> None:
    check_row(row)


# ----------------------------------------------------------- small direct unit tables
@pytest.mark.parametrize(
    "heartbeats, pending, now, expected",
    [
        pytest.param({}, {}, NOW, set(), id="nothing"),
        pytest.param({"a": 99.0, "b": 90.0}, {}, NOW, {"a"}, id="expired-dropped"),
        pytest.param({"a": NOW - HB}, {}, NOW, set(), id="exactly-timeout-old-is-dead"),
        pytest.param({"a": 10.0}, {"a": 1.0, "b": 1.0}, NOW, {"a", "b"}, id="pending-always-healthy"),
    ],
)
def test_healthy_replicas(heartbeats: dict, pending: dict, now: float, expected: set) -> None:
    view = build_view(heartbeats=heartbeats, pending=pending)
    assert healthy_replicas(now, view, Options(min_replicas=1, heartbeat_timeout=HB)) == expected


@pytest.mark.parametrize(
    "previous, quorum_id, members, failures, expected",
    [
        pytest.param(None, 0, ["a"], {}, 1, id="no-previous"),
        pytest.param(["a", "b"], 4, ["a", "b"], {}, 4, id="same"),
        pytest.param(["a", "b"], 4, ["a", "b"], {"a": 2}, 5, id="same-with-failures"),
        pytest.param(["a", "b"], 4, ["a"], {}, 5, id="removed"),
        pytest.param(["a"], 4, ["a", "b"], {}, 5, id="added"),
        pytest.param(["a", "b"], 4, ["a", "c"], {}, 5, id="swapped"),
    ],
)
def test_next_quorum_id(previous, quorum_id, members, failures, expected) -> None:
    prev = None if previous is None else Quorum(quorum_id, tuple(member(r) for r in previous))
    ms = tuple(member(r, commit_failures=failures.get(r, 0)) for r in members)
    assert next_quorum_id(prev, quorum_id, ms) == expected


@pytest.mark.parametrize(
    "heartbeats, pending, horizon, expected",
    [
        pytest.param({}, {}, 60.0, [], id="empty"),
        pytest.param({"a": 99.0, "b": 10.0}, {}, 60.0, ["b"], id="only-old-silent"),
        pytest.param({"a": 10.0, "b": 10.0}, {"a": 1.0}, 60.0, ["b"], id="pending-kept-even-if-silent"),
        pytest.param({"a": NOW - 60.0}, {}, 60.0, [], id="exactly-horizon-old-kept"),
        pytest.param({"a": NOW - 60.001}, {}, 60.0, ["a"], id="just-older-than-horizon-dropped"),
        pytest.param({"a": 99.0}, {"b": 1.0}, 60.0, [], id="pending-without-heartbeat-not-listed"),
    ],
)
def test_forgettable(heartbeats: dict, pending: dict, horizon: float, expected: list) -> None:
    pend = build_view(pending=pending).pending
    before = (dict(heartbeats), dict(pend))
    assert sorted(forgettable(NOW, heartbeats, pend, horizon)) == expected
    assert (heartbeats, dict(pend)) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(min_replicas=0), id="min-replicas-0"),
        pytest.param(dict(min_replicas=-1), id="min-replicas-negative"),
        pytest.param(dict(min_replicas=1, join_timeout=-0.001), id="join-timeout-negative"),
        pytest.param(dict(min_replicas=1, heartbeat_timeout=-1.0), id="heartbeat-timeout-negative"),
        pytest.param(dict(min_replicas=1, heartbeat_timeout=0.0), id="heartbeat-timeout-zero"),
    ],
)
def test_options_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Options(**kwargs)


def test_options_defaults_and_zero_join_timeout() -> None:
    o = Options(min_replicas=1)
    assert (o.join_timeout, o.heartbeat_timeout) == (60.0, 5.0)
    assert Options(min_replicas=3, join_timeout=0.0).join_timeout == 0.0


def test_tables_are_distinctly_named() -> None:
    ids = [p.id for p in BASIC + HALF_RULE + FAST_PATH + SHRINK_ONLY + JOIN_TIMEOUT + QUORUM_ID + SORTING]
    assert len(ids) == len(set(ids))
