"""Quorum leases (rallypoint/lighthouse/LEASES.md): the pure rules on both sides as tables,
the holder's ordering of grants and revokes, FailFast's handling of a member that left a
lease in every order of notice and round, and the lighthouse core's grants and revokes."""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest

from rallypoint._net.lease import LEASE_KEY, encode_grant, parse_grant
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint.lighthouse import leases as ls
from rallypoint.lighthouse import quorum as q
from rallypoint.manager._lease import Lease, LeaseHolder, lease_refusal, leased_quorum, leased_result
from rallypoint.manager.recovery import compute_quorum_result


def _quorum(qid: int, *ids: str, steps: tuple[int, ...] = ()) -> q.Quorum:
    steps = steps or (5,) * len(ids)
    return q.Quorum(qid, tuple(q.Member(r, address=f"http://{r}:1", store_address=f"{r}:2", step=s, world_size=1)
                               for r, s in zip(ids, steps)))


@pytest.mark.parametrize("first, then, cached", [
    ((5, True), (6, True), True),  # the same lease, a later step: only max_step moves
    ((5, True), (9, True), True),
    ((0, True), (1, True), False),  # step 0 (init_sync may heal peers) is never kept
    ((5, True), (6, False), False),  # init_sync changed
])
def test_a_leased_result_is_derived_once_per_lease_and_always_equals_a_fresh_one(
        first: tuple[int, bool], then: tuple[int, bool], cached: bool) -> None:
    base = _quorum(7, "a", "b", "c")
    cache: dict[Any, Any] = {}
    entries = []
    for step, init_sync in (first, then):
        got = leased_result(cache, "r1", base, step, "b", 1, init_sync)
        assert got == compute_quorum_result(leased_quorum(base, step), "b", 1, init_sync)
        assert got.max_step == step and got.quorum_id == 7
        entries.append(cache.get("r1"))
    assert (entries[1] is not None and entries[1] is entries[0]) == cached
    again = leased_result(cache, "r1", base, then[0] + 1, "b", 1, then[1])
    # A new lease (another quorum object, even an equal one) is computed afresh.
    other = _quorum(8, "a", "b")
    fresh = leased_result(cache, "r1", other, then[0] + 1, "b", 1, then[1])
    assert fresh.quorum_id == 8 and fresh != again
    assert fresh == compute_quorum_result(leased_quorum(other, then[0] + 1), "b", 1, then[1])


# ------------------------------------------------------------------ lighthouse rules
@pytest.mark.parametrize("members, takes, enabled, why", [
    (("a", "b"), {"a": True, "b": True}, True, None),
    (("a", "b", "c"), {"a": True, "b": True, "c": True, "z": False}, True, None),
    (("a", "b"), {"a": True, "b": True}, False, "leases are off"),
    (("a",), {"a": True}, True, "a quorum of one is never leased"),
    (("a", "b"), {"a": True}, True, "member b has no liveness stream attached"),  # torchft's client
    (("a", "b"), {"a": True, "b": False}, True, "member b does not take leases"),
])
def test_grant_refusal(members: tuple[str, ...], takes: dict[str, bool], enabled: bool, why: str | None) -> None:
    got = ls.grant_refusal(members, takes, enabled)
    assert got == why if why is None else (got is not None and got.startswith(why))


# A member that failed its round retries that step: its peers' round at that step may be
# waiting in collectives it never joined, so it fails too (torchft's commit-failure test).
@pytest.mark.parametrize("step, failures, after", [(10, 0, 9), (10, 1, 9), (0, 0, -1), (7, 3, 6)])
def test_after_step(step: int, failures: int, after: int) -> None:
    assert ls.after_step(step, failures) == after


def test_revoke_for_request_member_joiner_and_none() -> None:
    lease = _quorum(4, "a", "b")
    assert ls.revoke_for_request(None, "a", 3, 0) is None
    member = ls.revoke_for_request(lease, "a", 10, 0)
    assert member is not None and (member.quorum_id, member.why, member.replica_id, member.after_step) == (4, "member_asked", "a", 9)
    failed = ls.revoke_for_request(lease, "b", 10, 2)
    assert failed is not None and failed.after_step == 9
    joiner = ls.revoke_for_request(lease, "c", 0, 0)
    assert joiner is not None and (joiner.why, joiner.replica_id, joiner.quorum_id) == ("joiner", "", 4)


@pytest.mark.parametrize("lease_ids, rid, held, last_id, upto", [
    (("a", "b"), "a", 4, 4, 3),      # a member of the lease in force keeps it: only older ones end
    (("a", "b"), "a", 0, 4, 3),      # ... also while its grant is still on its way
    (("a", "b"), "c", 0, 4, 4),      # anyone else: every lease up to the last quorum id
    (None, "a", 4, 4, 4),            # the lease was revoked while a's stream was down
    (None, "a", 9, 0, 9),            # a restarted lighthouse with no state knows no lease at all
    (None, "a", 0, 0, None),         # nothing was ever formed: nothing to say
])
def test_revoke_at_attach(lease_ids: tuple[str, ...] | None, rid: str, held: int, last_id: int, upto: int | None) -> None:
    lease = _quorum(4, *lease_ids) if lease_ids else None
    got = ls.revoke_at_attach(lease, rid, held, last_id)
    assert (got.quorum_id if got else None) == upto
    if got is not None:
        assert got.replica_id == "" and got.why == "stale"


def test_lease_desk_grants_revokes_and_asks_for_a_fresh_id() -> None:
    desk = ls.LeaseDesk()
    takes = {"a": True, "b": True}
    assert desk.grant(_quorum(3, "a", "b"), takes) is None and desk.holds("a") == 3 and desk.holds("c") == 0
    assert desk.revoke(ls.Revoke(2, "stale", "older")) is None and desk.lease is not None  # an older id: not this lease
    done = desk.revoke(ls.Revoke(3, "joiner", "c joins"))
    assert done is not None and desk.lease is None and desk.fresh_id and desk.holds("a") == 0
    assert desk.revoke(ls.Revoke(3, "joiner", "again")) is None  # nothing in force: nothing to push
    assert desk.grant(_quorum(4, "a"), takes) is not None and not desk.fresh_id  # refused, and the rule is spent
    assert desk.status() == {"enabled": True, "quorum_id": None, "members": [], "report_every": None,
                             "granted_total": 1, "revoked_total": 1}


def test_a_revoke_gives_the_next_quorum_a_new_id_even_with_the_same_members() -> None:
    prev = _quorum(5, "a", "b")
    pending = {r: q.Pending(m, 0.0) for r, m in zip(("a", "b"), prev.members)}
    same = q.decide(1.0, q.View({}, pending, prev, 5), q.Options(min_replicas=1))
    fresh = q.decide(1.0, q.View({}, pending, prev, 5, fresh_id=True), q.Options(min_replicas=1))
    assert (same.quorum_id, fresh.quorum_id) == (5, 6)


def test_grant_wire_round_trip_and_garbage() -> None:
    assert parse_grant([(LEASE_KEY, encode_grant(12))]) == 12
    assert parse_grant([("other", b"x"), (LEASE_KEY, encode_grant(1))]) == 1
    for bad in (None, [], [(LEASE_KEY, b"\xff\xff\xff")], [(LEASE_KEY, b"x" * 100)], [(LEASE_KEY, encode_grant(0))],
                [(LEASE_KEY, "text")], [(LEASE_KEY, encode_grant(-3))]):
        assert parse_grant(bad) is None, bad


# ------------------------------------------------------------------ group rules
@pytest.mark.parametrize("lease, revoked, step, failures, shrink, why", [
    (Lease(_quorum(4, "a", "b"), 6), 0, 6, 0, False, None),
    (None, 0, 6, 0, False, "no lease held"),
    (Lease(_quorum(4, "a", "b"), 6), 4, 6, 0, False, "the lease of quorum 4 was revoked"),
    (Lease(_quorum(4, "a", "b"), 6), 3, 6, 0, False, None),
    (Lease(_quorum(4, "a", "b"), 6), 0, 6, 1, False, "the group failed its last step"),
    (Lease(_quorum(4, "a", "b"), 6), 0, 6, 0, True, "a rank asked for shrink_only"),
    (Lease(_quorum(4, "a", "b"), 6), 0, 5, 0, False, "the group is at step 5"),  # went back (failed, restored)
    (Lease(_quorum(4, "a", "b"), 6), 0, 8, 0, False, "the group is at step 8"),  # skipped ahead
])
def test_lease_refusal(lease: Lease | None, revoked: int, step: int, failures: int, shrink: bool, why: str | None) -> None:
    got = lease_refusal(lease, revoked, step, failures, shrink)
    assert got == why if why is None else (got is not None and got.startswith(why))


def test_leased_quorum_puts_every_member_at_the_step() -> None:
    base = _quorum(4, "a", "b", steps=(3, 9))
    got = leased_quorum(base, 12)
    assert got.quorum_id == 4 and [m.step for m in got.members] == [12, 12]
    assert [m.store_address for m in got.members] == ["a:2", "b:2"]


def test_holder_serves_consecutive_steps_and_drops_on_refusal() -> None:
    h = LeaseHolder()
    assert h.take(1, 0, False) == (None, "no lease held")
    assert h.grant(_quorum(3, "a", "b", steps=(4, 7)))  # a heals to 7 in the granting round
    assert h.held() == 3
    for step in (8, 9, 10):
        got, why = h.take(step, 0, False)
        assert got is not None and why == "" and got.quorum_id == 3
    got, why = h.take(10, 1, False)  # step 10 failed somewhere: ask
    assert got is None and "failed" in why and h.held() == 0
    assert h.take(11, 0, False)[0] is None  # dropped for good
    assert h.served == 3


def test_holder_ignores_a_grant_its_revoke_overtook() -> None:
    h = LeaseHolder()
    assert not h.revoke(5)  # the revoke of 5 arrives on the stream before the answer granting 5
    assert not h.grant(_quorum(5, "a", "b")) and h.held() == 0
    assert h.grant(_quorum(6, "a", "b")) and h.held() == 6  # the quorum after a revoke has a new id
    assert h.revoke(6) and h.held() == 0


def test_holder_is_safe_across_threads() -> None:
    h = LeaseHolder()
    h.grant(_quorum(1, "a", "b", steps=(0, 0)))
    stop = threading.Event()

    def revoker() -> None:
        n = 1
        while not stop.is_set():
            h.revoke(n)
            n += 1
            h.grant(_quorum(n + 1, "a", "b", steps=(0, 0)))

    t = threading.Thread(target=revoker)
    t.start()
    try:
        for _ in range(2000):
            got, _why = h.take(1, 0, False)
            assert got is None or got.quorum_id > 0
    finally:
        stop.set()
        t.join(10)


# ------------------------------------------------------------------ FailFast: a member left the lease
class _Work:
    def __init__(self) -> None:
        self.done = False

    def finished(self) -> bool:
        return self.done


def _ff(step: int = 10) -> Any:
    from rallypoint.manager._failfast import FailFast

    class PG:
        def __init__(self) -> None:
            self.aborted = threading.Event()

        def abort(self) -> None:
            self.aborted.set()

    ff = FailFast(PG(), logging.LoggerAdapter(logging.getLogger("test"), {}), "a", timedelta(seconds=5))  # type: ignore[arg-type]
    ff.quorum_id = 7
    ff.new_round(1, step)
    return ff


def test_left_lease_mid_allreduce_aborts_a_round_the_member_is_not_in() -> None:
    ff = _ff(step=10)
    ff.quorum_arrived(["a", "b"])
    ff.setup_done()
    assert isinstance(ff.add_work(_Work), _Work)
    ff.left_lease("b", "asked at step 10", 7, 9)  # b committed 9 and asks at 10: our round 10 cannot finish
    assert ff.pg.aborted.is_set() and "left the lease" in str(ff.errored())


def test_left_lease_spares_a_round_the_member_took_part_in() -> None:
    ff = _ff(step=10)
    ff.quorum_arrived(["a", "b"])
    ff.setup_done()
    work = ff.add_work(_Work)
    ff.left_lease("b", "failed step 10", 7, 10)  # b was in round 10 (and failed it): ours finishes or fails by itself
    work.done = True
    assert not ff.pg.aborted.is_set() and ff.errored() is None
    assert isinstance(ff.add_work(_Work), _Work)


def test_left_lease_before_the_round_fails_its_first_collective() -> None:
    ff = _ff(step=10)
    ff.left_lease("b", "asked", 7, 9)  # heard while this round's quorum was still being answered
    ff.quorum_arrived(["a", "b"])  # ... from the lease, a moment before the revoke
    ff.setup_done()
    assert ff.add_work(_Work) is None and "left the lease" in str(ff.errored())


@pytest.mark.parametrize("quorum_id, members", [(8, ["a", "b"]), (7, ["a", "c"])])
def test_left_lease_does_not_touch_another_quorum(quorum_id: int, members: list[str]) -> None:
    ff = _ff(step=10)
    ff.left_lease("b", "asked", 7, 9)
    ff.quorum_id = quorum_id  # the round got a new quorum from the lighthouse (a revoke bumps the id)
    ff.quorum_arrived(members)
    ff.setup_done()
    assert isinstance(ff.add_work(_Work), _Work) and ff.errored() is None


def test_a_peer_down_while_a_leased_round_is_answered_fails_that_round() -> None:
    """The PeerDown arrives while the round's quorum is being answered: a quorum from the
    lighthouse leaves the dead peer out, but one from the lease (same id) still has it."""
    ff = _ff(step=10)
    ff.quorum_arrived(["a", "b"])  # the round before: on the lease with b
    ff.setup_done()
    ff.new_round(2, 11)
    ff.peer_down("c", "stream_broken: connection lost")  # not a member: nothing to remember
    ff.peer_down("b", "stream_broken: connection lost")
    ff.quorum_arrived(["a", "b"])
    ff.setup_done()
    assert ff.add_work(_Work) is None and "went down" in str(ff.errored())


# ------------------------------------------------------------------ the lighthouse core
def _core(**kw: Any) -> Any:
    from rallypoint.lighthouse.core import LighthouseCore
    from rallypoint.lighthouse.metrics import LighthouseMetrics
    from rallypoint.lighthouse.state import StateStore

    return LighthouseCore(q.Options(min_replicas=2, join_timeout=0.05), StateStore(":memory:"), LighthouseMetrics(), **kw)


def _pushed(att: Any) -> list[rpb.AttachResponse]:
    out = []
    while not att.outbox.empty():
        raw = att.outbox.get_nowait()
        out.append(rpb.AttachResponse.FromString(raw) if isinstance(raw, bytes) else raw)
    return out


def test_core_grants_revokes_on_a_joiner_and_a_member_and_bumps_the_id() -> None:
    async def main() -> None:
        core = _core()
        core.start()
        try:
            atts = {r: core.attach(r, f"http://{r}:1", True) for r in ("a", "b")}
            for a in atts.values():
                _pushed(a)
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=3, world_size=1)) for r in ("a", "b")))
            assert core.leases.holds("a") == core.quorum_id == 1
            joiner = asyncio.ensure_future(core.request_quorum(q.Member("c", step=0, world_size=1)))
            await asyncio.sleep(0)
            for a in atts.values():
                (msg,) = _pushed(a)
                assert msg.lease_revoke.quorum_id == 1 and msg.lease_revoke.replica_id == ""
            answers = await asyncio.gather(joiner, *(core.request_quorum(q.Member(r, step=4, world_size=1))
                                                     for r in ("a", "b")))
            assert len(set(answers)) == 1 and core.quorum_id == 2
            assert core.leases.holds("a") == 0  # c has no stream: never leased
            core.attach("c", "http://c:1", True)
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=5, world_size=1)) for r in ("a", "b", "c")))
            # Same members, but c was told at attach that every lease up to 2 is over: a new id.
            assert core.leases.holds("c") == core.quorum_id == 3
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=6, world_size=1, commit_failures=1))
                                   for r in ("a", "b", "c")))  # ... and a lease ends when its members ask
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=6, world_size=1)) for r in ("a", "b", "c")))
            assert core.leases.holds("c") == core.quorum_id == 5
            _pushed(atts["a"])
            ids = core.quorum_id
            asker = asyncio.ensure_future(core.request_quorum(q.Member("b", step=9, world_size=1, commit_failures=1)))
            await asyncio.sleep(0)
            (msg,) = _pushed(atts["a"])[-1:]
            assert (msg.lease_revoke.replica_id, msg.lease_revoke.after_step) == ("b", 8)  # b retries 9: round 9 fails too
            await asyncio.gather(asker, *(core.request_quorum(q.Member(r, step=9, world_size=1)) for r in ("a", "c")))
            assert core.quorum_id == ids + 1 and core.leases.holds("b") == ids + 1
            events = [e.kind for e in core.store.events(limit=50)]
            assert events.count("lease_revoked") == 5  # joiner c (and the left notice of a, first to ask after it); a asking, twice; b asking
        finally:
            await core.stop()

    asyncio.run(main())


def test_core_revokes_before_the_peer_down_and_at_reattach() -> None:
    async def main() -> None:
        core = _core()
        core.start()
        try:
            atts = {r: core.attach(r, f"http://{r}:1", True) for r in ("a", "b", "c")}
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=1, world_size=1)) for r in atts))
            for a in atts.values():
                _pushed(a)
            core.detach(atts["c"], clean=False, reason="connection lost")
            kinds = [m.WhichOneof("kind") for m in _pushed(atts["a"])]
            assert kinds == ["lease_revoke", "peer_down"]
            again = core.attach("c", "http://c:1", True, held_lease=1)  # c comes back still holding lease 1
            (msg,) = _pushed(again)
            assert msg.lease_revoke.quorum_id >= 1
            fresh = _core()  # a restarted lighthouse with no state: it knows no lease
            stale = fresh.attach("a", "http://a:1", True, held_lease=1)
            (msg,) = _pushed(stale)
            assert msg.lease_revoke.quorum_id == 1
        finally:
            await core.stop()

    asyncio.run(main())


def test_core_never_leases_without_the_switch_or_with_a_lease_less_member() -> None:
    async def main() -> None:
        for leases, takes in ((False, (True, True)), (True, (True, False))):
            core = _core(leases=leases)
            core.start()
            try:
                for r, t in zip(("a", "b"), takes):
                    core.attach(r, f"http://{r}:1", t)
                await asyncio.gather(*(core.request_quorum(q.Member(r, step=1, world_size=1)) for r in ("a", "b")))
                assert core.leases.lease is None
            finally:
                await core.stop()

    asyncio.run(main())


# ------------------------------------------------------------------ hostile step reports
def test_step_reports_are_bounded_and_malformed_ones_change_nothing(lighthouse) -> None:
    """A step report over 64 KiB ends only the sender's stream (INVALID_ARGUMENT); one with
    a negative step too; a malformed one is left unscored and the stream stays up."""
    import grpc

    lh = lighthouse(min_replicas=1)
    channel = grpc.insecure_channel(lh.local_address().replace("http://", ""))
    attach = channel.stream_stream("/rallypoint.RallypointLighthouse/Attach")  # bytes in, bytes out

    def msg(**kw: Any) -> bytes:
        return rpb.AttachRequest(**kw).SerializeToString()

    hello = msg(hello=rpb.AttachHello(replica_id="reporter", leases=True))
    try:
        for bad, what in (({"data": "x" * 70_000, "step": 3}, "step_report.data"), ({"data": "{}", "step": -1}, "step_report.step")):
            with pytest.raises(grpc.RpcError) as e:
                list(attach(iter([hello, msg(step_report=rpb.StepReport(**bad))]), timeout=5))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details()
        before = {k: v for k, v in lh.status()["goodput"].items() if k != "now"}
        garbage = [msg(step_report=rpb.StepReport(data=d, step=4)) for d in
                   ("not json", '{"step_stats": {"outcome": "warp"}}', '{"step_stats": [1]}', "[" * 5000)]
        replies = attach(iter([hello, *garbage, msg(goodbye=rpb.AttachGoodbye(reason="done"))]), timeout=5)
        kinds = [rpb.AttachResponse.FromString(r).WhichOneof("kind") for r in replies]
        assert kinds[0] == "welcome"  # the stream ran to its goodbye
        row = next(r for r in lh.status()["replicas"] if r["replica_id"] == "reporter")
        assert row["step"] == 4 and {k: v for k, v in lh.status()["goodput"].items() if k != "now"} == before
    finally:
        channel.close()


def test_members_of_a_revoked_lease_are_waited_for_past_join_timeout() -> None:
    """After a revoke, a member still finishing its round on the lease asks a little later
    than the others: it is waited for until View.expected says, not dropped after the
    (embedded: 100 ms) join timeout; a replica not in the lease is not."""
    opts = q.Options(min_replicas=1, join_timeout=0.1)
    prev = _quorum(3, "a", "b")
    pending = {"a": q.Pending(prev.members[0], 0.0), "c": q.Pending(q.Member("c"), 0.0),
               "e": q.Pending(q.Member("e"), 0.0)}
    beats = {"b": 1.0, "d": 1.0}
    waiting = q.decide(1.0, q.View(beats, pending, prev, 3, expected={"b": 4.0}), opts)
    assert waiting.rule is q.Rule.WAIT_STRAGGLERS and waiting.next_check == 4.0
    formed = q.decide(4.0, q.View(beats, pending, prev, 3, expected={"b": 4.0}), opts)
    assert formed.formed and [m.replica_id for m in formed.members or ()] == ["a", "c", "e"]
    plain = q.decide(1.0, q.View(beats, pending, prev, 3, expected={"d": 0.5}), opts)
    assert plain.formed  # d's wait is over (and without one, join_timeout alone applies)


def test_left_notice_once_per_revoke_from_the_first_member_to_ask() -> None:
    lease = _quorum(6, "a", "b", "c")
    assert ls.left_notice(None, False, "a", 5, 0) is None
    n = ls.left_notice(lease, False, "b", 8, 0)
    assert n is not None and (n.quorum_id, n.replica_id, n.after_step) == (6, "b", 7)
    assert ls.left_notice(lease, True, "c", 8, 0) is None  # already told
    assert ls.left_notice(lease, False, "z", 8, 0) is None  # a joiner is no member
    desk = ls.LeaseDesk()
    desk.grant(lease, {"a": True, "b": True, "c": True})
    desk.revoke(ls.Revoke(6, "joiner", "z joins"))
    assert desk.revoked_lease is lease and not desk.left_sent
    desk.grant(_quorum(7, "a", "b", "c", "z"), {})
    assert desk.revoked_lease is None
    desk2 = ls.LeaseDesk()
    desk2.grant(lease, {"a": True, "b": True, "c": True})
    desk2.revoke(ls.revoke_for_request(lease, "a", 9, 1))
    assert desk2.left_sent  # the member_asked revoke was the notice


def test_a_revoke_at_attach_gives_the_next_quorum_a_new_id() -> None:
    """A member whose stream was down when a quorum formed re-attaches: it is told every
    lease up to the current id is over, so the next quorum must not reuse that id (its
    grant would be refused by that member and taken up by the others)."""
    async def main() -> None:
        core = _core()
        core.start()
        try:
            core.attach("a", "http://a:1", True)
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=1, world_size=1)) for r in ("a", "b")))
            first = core.quorum_id
            assert core.leases.lease is None  # b had no stream: not leased
            b = core.attach("b", "http://b:1", True)
            (msg,) = _pushed(b)
            assert msg.lease_revoke.quorum_id == first and core.leases.fresh_id
            await asyncio.gather(*(core.request_quorum(q.Member(r, step=2, world_size=1)) for r in ("a", "b")))
            assert core.quorum_id == first + 1 and core.leases.holds("b") == first + 1
        finally:
            await core.stop()

    asyncio.run(main())


def test_rallypoint_status_shows_the_lease_and_the_ha_role() -> None:
    from rallypoint.cli import format_status

    text = format_status({"quorum_id": 3, "options": {}, "replicas": [],
                          "lease": {"enabled": True, "quorum_id": 3, "members": ["a", "b"], "granted_total": 2,
                                    "revoked_total": 1},
                          "lighthouse": {"role": "standby", "state_path": "etcd://e:1/p"}})
    assert "lease: quorum 3 leased to 2 member(s); 2 granted, 1 revoked" in text
    assert "this lighthouse: standby (HA, state etcd://e:1/p)" in text
    off = format_status({"quorum_id": 0, "options": {}, "replicas": [], "lease": {"enabled": False, "quorum_id": None}})
    assert "lease: off" in off


@pytest.mark.parametrize("members, every", [(2, 1), (32, 1), (33, 2), (64, 2), (256, 8), (1024, 32), (1025, 33)])
def test_report_every_bounds_the_reports_per_step(members: int, every: int) -> None:
    assert ls.report_every(members) == every
    assert members / every <= ls.REPORTS_PER_STEP or every == 1


def test_grant_carries_report_every_and_clamps_it() -> None:
    from rallypoint._net.lease import MAX_REPORT_EVERY, parse_lease

    assert parse_lease([(LEASE_KEY, encode_grant(3, 8))]).report_every == 8  # type: ignore[union-attr]
    assert parse_lease([(LEASE_KEY, encode_grant(3))]).report_every == 1  # type: ignore[union-attr]
    assert parse_lease([(LEASE_KEY, encode_grant(3, -5))]).report_every == 1  # type: ignore[union-attr]
    assert parse_lease([(LEASE_KEY, encode_grant(3, 2**40))]).report_every == MAX_REPORT_EVERY  # type: ignore[union-attr]


def _round(step: int, outcome: str = "committed", compute: float = 1.0) -> dict:
    return {"step": step, "step_stats": {"step": step - 1, "outcome": outcome, "compute_s": compute, "step_s": 2 * compute}}


def test_stats_batch_reports_at_multiples_and_sums_the_rounds_between() -> None:
    from rallypoint.manager._lease import StatsBatch

    b = StatsBatch()
    assert b.add(_round(5), 5, 1) == [_round(5)]  # every round when report_every is 1
    assert b.add(_round(6), 6, 4) == [] and b.add(_round(7, compute=2.0), 7, 4) == []
    (out,) = b.add(_round(8), 8, 4)  # 8 is a multiple of 4: rounds 6, 7 and 8 in one report
    assert out["step"] == 8 and out["step_stats"]["step"] == 7
    assert out["step_stats"]["compute_s"] == 4.0 and out["step_stats"]["step_s"] == 8.0
    assert b.flush() is None


def test_stats_batch_never_sums_across_an_outcome_change_and_flushes_what_is_left() -> None:
    from rallypoint.manager._lease import StatsBatch

    b = StatsBatch()
    assert b.add(_round(9, "healing", 5.0), 9, 4) == []
    first, second = b.add(_round(10), 10, 5)  # the heal goes out alone, then 10 (a multiple of 5)
    assert first["step_stats"]["outcome"] == "healing" and first["step_stats"]["compute_s"] == 5.0
    assert second["step_stats"]["outcome"] == "committed" and second["step_stats"]["compute_s"] == 1.0
    assert b.add(_round(11), 11, 5) == []
    rest = b.flush()
    assert rest is not None and rest["step"] == 11 and b.flush() is None
    b.add({"step": 12}, 12, 5)  # a round without step stats (a rank sent none)
    assert b.add(_round(13), 13, 5) == [] and b.flush()["step_stats"]["compute_s"] == 1.0  # type: ignore[index]


def test_a_restarted_lighthouse_treats_its_last_quorum_as_just_revoked(tmp_path) -> None:
    """Groups still on a lease the restarted lighthouse never granted: the first member to
    ask tells the others it left (their round past its step fails now instead of hanging),
    a member re-attaching later hears it too, and the next quorum gets a new id. A stranger
    attaching changes no id."""
    from rallypoint.lighthouse.core import LighthouseCore
    from rallypoint.lighthouse.metrics import LighthouseMetrics
    from rallypoint.lighthouse.state import StateStore

    path = str(tmp_path / "lh.db")
    with StateStore(path) as st:
        st.save_quorum(_quorum(7, "a", "b"))
        assert st.flush(5.0)

    async def main() -> None:
        store = StateStore(path)
        core = LighthouseCore(q.Options(min_replicas=2, join_timeout=0.05), store, LighthouseMetrics())
        core.start()
        try:
            assert core.quorum_id == 7 and core.leases.revoked_lease is not None
            stranger = core.attach("z", "http://z:1", True)
            _pushed(stranger)
            a = core.attach("a", "http://a:1", True, held_lease=7)
            (stale,) = _pushed(a)
            assert stale.lease_revoke.quorum_id == 7 and not stale.lease_revoke.replica_id
            asking = asyncio.ensure_future(core.request_quorum(q.Member("a", step=20, world_size=1)))
            await asyncio.sleep(0)
            (left,) = _pushed(a)
            assert (left.lease_revoke.replica_id, left.lease_revoke.after_step) == ("a", 19)
            b = core.attach("b", "http://b:1", True, held_lease=7)  # b comes back later: it hears both
            kinds = [(m.lease_revoke.replica_id, m.lease_revoke.quorum_id) for m in _pushed(b)]
            assert kinds == [("", 7), ("a", 7)]
            joining = asyncio.ensure_future(core.request_quorum(q.Member("z", step=0, world_size=1)))
            await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(asking, joining,
                                                  core.request_quorum(q.Member("b", step=20, world_size=1))), 10)
            assert core.quorum_id == 8 and core.previous is not None and len(core.previous.members) == 3
        finally:
            await core.stop()
            store.close()

    asyncio.run(main())


def test_a_stranger_attaching_or_leases_off_change_no_quorum_id() -> None:
    async def main() -> None:
        for leases in (True, False):
            core = _core(leases=leases)
            core.start()
            try:
                await asyncio.gather(*(core.request_quorum(q.Member(r, step=1, world_size=1)) for r in ("a", "b")))
                core.attach("z", "http://z:1", True)  # no lease held, not in the last quorum
                if not leases:
                    core.attach("a", "http://a:1", True, held_lease=1)
                assert not core.leases.fresh_id
            finally:
                await core.stop()

    asyncio.run(main())
