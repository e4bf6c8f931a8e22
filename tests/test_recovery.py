"""The pure per-rank quorum results (rallypoint.manager.recovery): a table of cases
checked field by field, and hypothesis properties over random quorums."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.manager.recovery import QuorumResult, compute_quorum_result


def q(*steps: int, quorum_id: int = 7, commit_failures: tuple[int, ...] | None = None, order: list[int] | None = None) -> Quorum:
    """Members r0, r1, ... at the given steps (given in ``order`` to check sorting)."""
    cfs = commit_failures or (0,) * len(steps)
    members = [
        Member(
            replica_id=f"r{i}",
            address=f"http://m{i}:1",
            store_address=f"s{i}:2",
            step=s,
            world_size=2,
            commit_failures=cfs[i],
        )
        for i, s in enumerate(steps)
    ]
    if order is not None:
        members = [members[i] for i in order]
    return Quorum(quorum_id, tuple(members))


def fields(r: QuorumResult, *names: str) -> tuple[Any, ...]:
    return tuple(getattr(r, n) for n in names)


KEYS = ("heal", "recover_src_replica_rank", "recover_dst_replica_ranks", "max_replica_rank", "store_address")

# (quorum, replica, group_rank, init_sync) -> (heal, src, dsts, max_replica_rank, store)
CASES = [
    # First step with init_sync: everyone but the primary (max set at group_rank % n) heals from it.
    pytest.param(q(0, 0, 0), "r0", 0, True, (False, None, [1, 2], 0, "s0:2"), id="init-sync-primary"),
    pytest.param(q(0, 0, 0), "r1", 0, True, (True, 0, [], 1, "s0:2"), id="init-sync-healer"),
    # ... group rank 1 starts from the same copy (torchft 0.2.0 would pick r1 here, so a
    # group's ranks would start from different replicas); only its store differs.
    pytest.param(q(0, 0, 0), "r0", 1, True, (False, None, [1, 2], 0, "s1:2"), id="init-sync-rank1-same-primary"),
    pytest.param(q(0, 0, 0), "r1", 1, True, (True, 0, [], 1, "s1:2"), id="init-sync-rank1-heals-from-it"),
    # First step without init_sync: nobody heals.
    pytest.param(q(0, 0, 0), "r1", 0, False, (False, None, [], 1, "s0:2"), id="no-init-sync"),
    pytest.param(q(0, 0, 0), "r2", 2, False, (False, None, [], 2, "s2:2"), id="no-init-sync-store"),
    # One healer, one source.
    pytest.param(q(5, 3), "r1", 0, True, (True, 0, [], None, "s0:2"), id="one-healer"),
    pytest.param(q(5, 3), "r0", 0, True, (False, None, [1], 0, "s0:2"), id="one-source"),
    pytest.param(q(5, 3), "r1", 3, False, (True, 0, [], None, "s0:2"), id="one-healer-any-rank"),
    # Several healers, several sources: round-robin from offset group_rank.
    pytest.param(q(9, 2, 9, 4, 1), "r1", 0, True, (True, 0, [], None, "s0:2"), id="rr-r1-g0"),
    pytest.param(q(9, 2, 9, 4, 1), "r3", 0, True, (True, 2, [], None, "s0:2"), id="rr-r3-g0"),
    pytest.param(q(9, 2, 9, 4, 1), "r4", 0, True, (True, 0, [], None, "s0:2"), id="rr-r4-g0"),
    pytest.param(q(9, 2, 9, 4, 1), "r0", 0, True, (False, None, [1, 4], 0, "s0:2"), id="rr-r0-g0"),
    pytest.param(q(9, 2, 9, 4, 1), "r2", 0, True, (False, None, [3], 1, "s0:2"), id="rr-r2-g0"),
    pytest.param(q(9, 2, 9, 4, 1), "r1", 1, True, (True, 2, [], None, "s2:2"), id="rr-r1-g1"),
    pytest.param(q(9, 2, 9, 4, 1), "r0", 1, True, (False, None, [3], 0, "s2:2"), id="rr-r0-g1"),
    pytest.param(q(9, 2, 9, 4, 1), "r2", 1, True, (False, None, [1, 4], 1, "s2:2"), id="rr-r2-g1"),
    # A behind member at max_step 0 is impossible; behind at max_step > 0 heals even without init_sync.
    pytest.param(q(4, 0), "r1", 0, False, (True, 0, [], None, "s0:2"), id="behind-no-init-sync"),
    # Members arrive unsorted: ranks follow replica_id order.
    pytest.param(q(5, 3, 5, order=[2, 0, 1]), "r1", 1, True, (True, 2, [], None, "s2:2"), id="unsorted"),
]


@pytest.mark.parametrize(("quorum", "rid", "group_rank", "init_sync", "expected"), CASES)
def test_table(quorum: Quorum, rid: str, group_rank: int, init_sync: bool, expected: tuple) -> None:
    r = compute_quorum_result(quorum, rid, group_rank, init_sync)
    assert fields(r, *KEYS) == expected
    n = len(quorum.members)
    assert r.replica_rank == int(rid[1:])
    assert r.replica_world_size == n
    assert r.quorum_id == quorum.quorum_id
    assert r.replica_ids == [f"r{i}" for i in range(n)]
    assert r.max_step == max(m.step for m in quorum.members)
    assert r.max_world_size == sum(m.step == r.max_step for m in quorum.members)
    src = r.recover_src_replica_rank
    assert r.recover_src_manager_address == (f"http://m{src}:1" if src is not None else "")


@pytest.mark.parametrize(("rid", "group_rank", "srcs", "stripe_dst"), [
    ("r1", 0, [0, 2], []),  # assigned r0 first, then the other source
    ("r3", 0, [2, 0], []),  # assigned r2 first, then round-robin after it
    ("r1", 1, [2, 0], []),  # group rank 1 is assigned r2: a different first source
    ("r0", 0, [], [1, 3, 4]),  # a source: every healer may fetch a part from it
    ("r2", 1, [], [1, 3, 4]),
])
def test_striping_table(rid: str, group_rank: int, srcs: list[int], stripe_dst: list[int]) -> None:
    r = compute_quorum_result(q(9, 2, 9, 4, 1), rid, group_rank, True)
    assert r.recover_src_replica_ranks == srcs
    assert r.recover_src_manager_addresses == [f"http://m{k}:1" for k in srcs]
    assert r.stripe_dst_replica_ranks == stripe_dst


def test_commit_failures_is_the_max_over_members() -> None:
    r = compute_quorum_result(q(1, 1, 1, commit_failures=(0, 3, 1)), "r0", 0, True)
    assert r.commit_failures == 3
    assert compute_quorum_result(q(1, 1), "r1", 0, True).commit_failures == 0


def test_single_member() -> None:
    r = compute_quorum_result(q(0), "r0", 0, True)
    assert fields(r, *KEYS) == (False, None, [], 0, "s0:2")
    assert (r.replica_world_size, r.max_world_size) == (1, 1)


def test_unknown_replica_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="'ghost' is not a member of quorum 7"):
        compute_quorum_result(q(1, 2), "ghost", 0, True)


def test_negative_group_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="group_rank"):
        compute_quorum_result(q(1), "r0", -1, True)


# ----------------------------------------------------------------- properties
@st.composite
def quorums(draw: st.DrawFn) -> Quorum:
    n = draw(st.integers(1, 9))
    steps = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    cfs = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    order = draw(st.permutations(list(range(n))))
    return q(*steps, commit_failures=tuple(cfs), order=order)


@settings(max_examples=300, deadline=None)
@given(quorum=quorums(), group_rank=st.integers(0, 12), init_sync=st.booleans())
def test_assignment_properties(quorum: Quorum, group_rank: int, init_sync: bool) -> None:
    n = len(quorum.members)
    results = [compute_quorum_result(quorum, f"r{i}", group_rank, init_sync) for i in range(n)]
    healers = {i for i, r in enumerate(results) if r.heal}
    sources = set(range(n)) - healers
    assert sources, "someone is always up to date"
    max_step = max(m.step for m in quorum.members)
    for i, r in enumerate(results):
        assert r.replica_rank == i
        # Everyone computes the same shared facts.
        assert fields(r, "quorum_id", "max_step", "max_world_size", "store_address", "commit_failures", "replica_ids") == fields(
            results[0], "quorum_id", "max_step", "max_world_size", "store_address", "commit_failures", "replica_ids"
        )
        step = next(m.step for m in quorum.members if m.replica_id == f"r{i}")
        if step < max_step:
            assert r.heal
        if r.heal:
            # Exactly one source, up to date, and not itself healing.
            assert r.recover_src_replica_rank in sources
            assert r.recover_dst_replica_ranks == []
        else:
            assert r.recover_src_replica_rank is None and r.recover_src_manager_address == ""
            assert step == max_step
        assert (r.max_replica_rank is None) == (step != max_step)
    # Striping (rallypoint's fields): a healer lists every source once, its assigned one
    # first, with the matching addresses; a source lists every healer; nobody else does.
    for i, r in enumerate(results):
        if r.heal:
            assert r.recover_src_replica_ranks[0] == r.recover_src_replica_rank
            assert sorted(r.recover_src_replica_ranks) == sorted(sources)
            assert r.recover_src_manager_addresses == [f"http://m{k}:1" for k in r.recover_src_replica_ranks]
            assert r.stripe_dst_replica_ranks == []
        else:
            assert r.recover_src_replica_ranks == [] and r.recover_src_manager_addresses == []
            assert r.stripe_dst_replica_ranks == sorted(healers)
    # Each source's dst list is exactly the healers that named it.
    for s in sources:
        named = sorted(i for i in healers if results[i].recover_src_replica_rank == s)
        assert results[s].recover_dst_replica_ranks == named
    # Loads spread within one of each other.
    loads = [len(results[s].recover_dst_replica_ranks) for s in sources]
    assert max(loads) - min(loads) <= 1
    assert sum(loads) == len(healers)
    # init_sync at step 0: exactly one member does not heal.
    if init_sync and max_step == 0:
        assert len(sources) == 1
    if not init_sync:
        assert healers == {i for i in range(n) if results[i].max_replica_rank is None}


@given(quorum=quorums(), ranks=st.integers(1, 6))
def test_first_step_every_group_rank_starts_from_the_same_copy(quorum: Quorum, ranks: int) -> None:
    """At step 0 with init_sync, all ranks of a replica group take the state of the same
    replica, so a group never mixes two replicas' initial states."""
    n = len(quorum.members)
    if max(m.step for m in quorum.members) != 0:
        return
    for i in range(n):
        srcs = {compute_quorum_result(quorum, f"r{i}", g, True).recover_src_replica_rank for g in range(ranks)}
        assert len(srcs) == 1, srcs


def test_stripe_addition_round_trips_and_bad_ones_are_ignored() -> None:
    """The striping fields travel as trailing metadata (torchft's message unchanged); a
    client takes them only when well-formed, within size limits and consistent with the
    answer (else it heals from its assigned source alone)."""
    import dataclasses

    from rallypoint.manager.client import STRIPE_KEY, result_from_pb, result_to_pb, stripe_metadata, with_stripe

    full = compute_quorum_result(q(9, 2, 9, 4, 1), "r1", 0, True)
    bare = result_from_pb(result_to_pb(full))  # what torchft's fields carry
    assert bare.recover_src_replica_ranks == [] and bare.heal
    md = stripe_metadata(full)
    assert md is not None and md[0][0] == STRIPE_KEY
    assert with_stripe(bare, md) == full
    assert stripe_metadata(compute_quorum_result(q(3, 3), "r0", 0, True)) is None  # nothing to stripe
    assert with_stripe(bare, None) == bare
    assert with_stripe(bare, ((STRIPE_KEY, b"\xff" * 10),)) == bare  # not a message
    assert with_stripe(bare, ((STRIPE_KEY, b"\x00" * (1 << 15)),)) == bare  # over the size limit
    wrong_first = dataclasses.replace(full, recover_src_replica_ranks=[2, 0])
    assert with_stripe(bare, stripe_metadata(wrong_first)) == bare  # not the assigned source first
    out_of_range = dataclasses.replace(full, recover_src_replica_ranks=[0, 99])
    assert with_stripe(bare, stripe_metadata(out_of_range)) == bare
    long_addr = dataclasses.replace(full, recover_src_manager_addresses=["http://m0:1", "x" * 5000])
    assert with_stripe(bare, stripe_metadata(long_addr)) == bare
