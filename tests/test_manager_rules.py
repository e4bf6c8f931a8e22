"""The ManagerServer's rules (rallypoint/manager/rules.py) driven with tables of plain
values: the group's lighthouse request, the step-stats checks, the group-size check,
the lighthouse call's budget and retries, and the commit vote. No server, no clock."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from rallypoint.manager._votes import claim_rank  # the old import path keeps working
from rallypoint.manager.rules import (
    MAX_STEP_STATS_BYTES,
    RankRequest,
    aggregate_requests,
    check_step_stats,
    encode_step_stats,
    fold_vote,
    group_size_error,
    lighthouse_budget,
    parse_step_stats,
    retry_pause,
    slowest_step_stats,
    vote_decision,
)

FULL = {"step": 7, "round": 3, "outcome": "committed", "step_s": 1.5, "compute_s": 1.0, "quorum_wait_s": 0.1,
        "comm_s": 0.3, "heal_s": 0.0, "commit_s": 0.05}


# ------------------------------------------------------------------ aggregation
R = RankRequest


@pytest.mark.parametrize("reqs, shrink_only, commit_failures, shrink_ranks", [
    ([R(0), R(1)], False, 0, []),
    ([R(0, shrink_only=True), R(1)], True, 0, [0]),
    ([R(1, shrink_only=True), R(0, shrink_only=True)], True, 0, [0, 1]),
    ([R(0, commit_failures=2), R(1, commit_failures=5), R(2, commit_failures=1)], False, 5, []),
    ([R(0)], False, 0, []),
])
def test_aggregate_shrink_only_and_commit_failures(reqs: list[RankRequest], shrink_only: bool,
                                                   commit_failures: int, shrink_ranks: list[int]) -> None:
    g = aggregate_requests(12, len(reqs), reqs, first_at=100.0, now=100.25)
    assert (g.shrink_only, g.commit_failures) == (shrink_only, commit_failures)
    assert g.data == {"step": 12, "group_world_size": len(reqs), "gather_s": 0.25,
                      "shrink_only_ranks": shrink_ranks, "commit_failures": commit_failures}
    assert list(g.data) == ["step", "group_world_size", "gather_s", "shrink_only_ranks", "commit_failures"]
    json.dumps(g.data)  # what the lighthouse gets must be JSON


@pytest.mark.parametrize("first_at, now, gather_s", [(5.0, 5.0, 0.0), (1.0, 3.1234567, 2.123457), (0.0, 1e-7, 0.0)])
def test_aggregate_gather_s(first_at: float, now: float, gather_s: float) -> None:
    assert aggregate_requests(0, 1, [R(0)], first_at, now).data["gather_s"] == gather_s


def test_aggregate_needs_a_request() -> None:
    with pytest.raises(ValueError, match="step 3"):
        aggregate_requests(3, 2, [], 0.0, 0.0)


@pytest.mark.parametrize("stats, expected", [
    ({0: None, 1: None}, None),
    ({0: {"compute_s": 1.0}, 1: None}, {"compute_s": 1.0, "rank": 0}),
    ({0: {"compute_s": 1.0}, 1: {"compute_s": 2.0}}, {"compute_s": 2.0, "rank": 1}),
    ({0: {"compute_s": 3.0}, 1: {"compute_s": 2.0}}, {"compute_s": 3.0, "rank": 0}),
    ({2: {"compute_s": 2.0, "step": 1}, 1: {"compute_s": 2.0, "step": 2}}, {"compute_s": 2.0, "step": 2, "rank": 1}),
    ({0: {"step": 4}, 1: {"compute_s": 0.0}}, {"compute_s": 0.0, "rank": 1}),  # no compute_s loses
    ({0: {}, 1: {}}, {"rank": 0}),
])
def test_slowest_step_stats(stats: dict[int, Any], expected: dict[str, Any] | None) -> None:
    assert slowest_step_stats(stats) == expected


def test_aggregate_carries_the_slowest_ranks_stats() -> None:
    reqs = [R(0, step_stats={**FULL, "compute_s": 1.0}), R(1, step_stats={**FULL, "compute_s": 4.0}), R(2)]
    data = aggregate_requests(7, 3, reqs, 0.0, 1.0).data
    assert data["step_stats"] == {**FULL, "compute_s": 4.0, "rank": 1}
    assert "step_stats" not in aggregate_requests(7, 3, [R(0), R(1), R(2)], 0.0, 1.0).data


# ------------------------------------------------------------------ step stats
@pytest.mark.parametrize("value, expected", [
    ({}, {}),
    (FULL, FULL),
    ({"compute_s": 2}, {"compute_s": 2.0}),
    ({"step": 0, "round": 0, "step_s": 0, "commit_s": 1e6}, {"step": 0, "round": 0, "step_s": 0.0, "commit_s": 1e6}),
    *[({"outcome": o}, {"outcome": o}) for o in ("committed", "failed", "healing", "spare")],
])
def test_good_step_stats(value: dict[str, Any], expected: dict[str, Any]) -> None:
    got = check_step_stats(value)
    assert got == expected and all(type(got[k]) is float for k in got if k.endswith("_s"))
    assert parse_step_stats(encode_step_stats(value)) == expected


@pytest.mark.parametrize("value, field", [
    ([], "JSON object"),
    ("x", "JSON object"),
    ({"compute": 1.0}, "'compute'"),
    ({"step": 1, "zzz": 1}, "'zzz'"),
    ({"step": -1}, "'step'"),
    ({"step": 1.0}, "'step'"),
    ({"step": True}, "'step'"),
    ({"round": "3"}, "'round'"),
    ({"round": 2**63}, "'round'"),
    ({"outcome": "done"}, "'outcome'"),
    ({"outcome": None}, "'outcome'"),
    ({"compute_s": -0.1}, "'compute_s'"),
    ({"step_s": 1e6 + 1}, "'step_s'"),
    ({"comm_s": math.nan}, "'comm_s'"),
    ({"heal_s": math.inf}, "'heal_s'"),
    ({"commit_s": "1"}, "'commit_s'"),
    ({"quorum_wait_s": False}, "'quorum_wait_s'"),
])
def test_bad_step_stats_name_the_field(value: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        check_step_stats(value)


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    ("", "not valid JSON"),
    ('{"compute_s": NaN}', "'compute_s'"),
    ('{"compute_s": 1e999}', "'compute_s'"),
    ("[" * 600 + "]" * 600, "bytes; the limit is 1024"),
    (json.dumps({"outcome": "x" * MAX_STEP_STATS_BYTES}), "the limit is 1024"),
    (b'{"step": 1, "outcome": "\xff"}', "not valid JSON"),
])
def test_bad_step_stats_text(text: str | bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_step_stats(text)


def test_step_stats_absent_and_compact() -> None:
    assert parse_step_stats(None) is None
    assert encode_step_stats({"step": 1, "compute_s": 0.5}) == '{"step":1,"compute_s":0.5}'


# ------------------------------------------------------------------ group sizes
@pytest.mark.parametrize("sizes, expected", [
    ({}, None),
    ({"a": 2}, None),
    ({"a": 2, "b": 2}, None),
    ({"a": 2, "b": 0}, None),  # a size not reported is skipped
    ({"b": 2, "a": 3}, "replica groups of different sizes in quorum 9: a has 3 rank(s), b has 2 rank(s); "
                       "every replica group must have the same number of ranks"),
])
def test_group_size_error(sizes: dict[str, int], expected: str | None) -> None:
    assert group_size_error(9, sizes) == expected


# ------------------------------------------------------------------ the lighthouse call
@pytest.mark.parametrize("deadlines, now, quorum_timeout, expected", [
    ([None, None], 10.0, None, 60.0),
    ([None], 10.0, 5.0, 5.0),
    ([12.0, 15.0, None], 10.0, None, 5.0),
    ([12.0, 15.0], 10.0, 3.0, 3.0),
    ([9.0], 10.0, None, 0.001),
])
def test_lighthouse_budget(deadlines: list[float | None], now: float, quorum_timeout: float | None,
                           expected: float) -> None:
    assert lighthouse_budget(deadlines, now, quorum_timeout, 60.0) == pytest.approx(expected)


@pytest.mark.parametrize("attempt, retries, now, end, expected", [
    (0, 0, 0.0, 10.0, None),
    (0, 2, 0.0, 10.0, 0.1),
    (1, 2, 0.0, 10.0, 0.2),
    (2, 2, 0.0, 10.0, None),
    (5, 9, 0.0, 10.0, 1.0),
    (0, 2, 9.95, 10.0, None),  # the pause would run past the budget
])
def test_retry_pause(attempt: int, retries: int, now: float, end: float, expected: float | None) -> None:
    assert retry_pause(attempt, retries, now, end) == expected


# ------------------------------------------------------------------ the commit vote
@pytest.mark.parametrize("sequence, world_size, votes, decision", [
    ([], 2, {}, None),
    ([(0, True)], 2, {0: True}, None),
    ([(0, True), (1, True)], 2, {0: True, 1: True}, True),
    ([(0, True), (1, False)], 2, {0: True, 1: False}, False),
    ([(1, False), (1, True), (0, True)], 2, {0: True, 1: False}, False),  # a False stands
    ([(0, True), (0, True)], 2, {0: True}, None),  # a retry is not a second rank
    ([(0, True), (0, False), (1, True)], 2, {0: False, 1: True}, False),  # a later False wins
    ([(0, True), (2, True)], 3, {0: True, 2: True}, None),  # rank 1 missing
    ([(0, True)], 1, {0: True}, True),
])
def test_vote_folding_and_decision(sequence: list[tuple[int, bool]], world_size: int, votes: dict[int, bool],
                                   decision: bool | None) -> None:
    state: dict[int, bool] = {}
    for rank, vote in sequence:
        state = fold_vote(state, rank, vote)
    assert state == votes
    assert vote_decision(state, world_size) is decision


def test_fold_vote_does_not_change_its_input() -> None:
    votes = {0: False}
    assert fold_vote(votes, 0, True) == {0: False} and fold_vote(votes, 1, True) == {0: False, 1: True}
    assert votes == {0: False}


def test_claim_rank_import_path() -> None:
    assert claim_rank({}, 0, None) is None
