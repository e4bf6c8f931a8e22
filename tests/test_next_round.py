"""The next round handed out with the commit vote (``rallypoint/manager/_next_round.py``):
on a lease, the ranks of a multi-rank replica group start their next round from the answer
to their vote, with no ``Quorum`` call; any rank that asks anyway gets the same quorum; a
failed step, a revoke or a torchft-style client takes the old path.

The pure parts get tables; the behaviour runs two replica groups of two ranks each (a
Manager per rank on its own thread, gloo over loopback; each group's store hosted by the
test, as torchrun's agent would), counting the calls rank 1 makes to its group's server.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from rallypoint.manager._next_round import (NEXT_ROUND_KEY, Held, NextRound, encode_next, held_refusal, parse_next,
                                            result_digest, steady_next)
from rallypoint.manager._lease import leased_quorum
from rallypoint.manager._server_next import Issued
from rallypoint.manager.recovery import QuorumResult, compute_quorum_result

T = timedelta(seconds=10)


def _result(**kw: Any) -> QuorumResult:
    base = dict(quorum_id=3, replica_rank=0, replica_world_size=2, recover_src_manager_address="",
                recover_src_replica_rank=None, recover_dst_replica_ranks=[], store_address="127.0.0.1:1/x",
                max_step=7, max_replica_rank=0, max_world_size=2, heal=False, commit_failures=0,
                replica_ids=["a:1", "b:2"])
    base.update(kw)
    return QuorumResult(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the pure parts
@pytest.mark.parametrize("name,kw,step,ok", [
    ("steady", {}, 8, True),
    ("not the next step", {}, 9, False),
    ("healing", {"heal": True, "recover_src_replica_rank": 1}, 8, False),
    ("serving", {"recover_dst_replica_ranks": [1]}, 8, False),
    ("striping", {"stripe_dst_replica_ranks": [1]}, 8, False),
    ("a member behind", {"max_world_size": 1}, 8, False),
    ("not at max step", {"max_replica_rank": None}, 8, False),
    ("after a failure", {"commit_failures": 1}, 8, False),
    ("injections", {"inject": b"[]"}, 8, False),
])
def test_only_a_steady_round_derives_the_next(name: str, kw: dict, step: int, ok: bool) -> None:
    got = steady_next(_result(**kw), step)
    assert (got is not None) is ok, name
    if got is not None:
        assert got == dataclasses.replace(_result(**kw), max_step=step)


HELD = Held(1, 8, "meta", _result(max_step=8))


@pytest.mark.parametrize("held,rank,step,meta,shrink,failures,why", [
    (HELD, 1, 8, "meta", False, 0, None),
    (None, 1, 8, "meta", False, 0, "no round"),
    (HELD, 0, 8, "meta", False, 0, "group rank 1"),
    (HELD, 1, 9, "meta", False, 0, "step 8"),
    (HELD, 1, 8, "meta", False, 1, "failed"),
    (HELD, 1, 8, "meta", True, 0, "shrink_only"),
    (HELD, 1, 8, "other", False, 0, "checkpoint metadata"),
])
def test_when_a_rank_takes_the_handed_out_round(held: Held | None, rank: int, step: int, meta: str, shrink: bool,
                                                 failures: int, why: str | None) -> None:
    got = held_refusal(held, rank, step, meta, shrink, failures)
    assert (got is None) if why is None else (got is not None and why in got)


@pytest.mark.parametrize("value,want", [
    ("8 " + "a" * 32, (8, "a" * 32)),
    (b"8 " + b"0" * 32, (8, "0" * 32)),
    (None, None), ("", None), ("8", None), ("x " + "a" * 32, None), ("-1 " + "a" * 32, None),
    ("8 " + "A" * 32, None), ("8 " + "a" * 31, None), ("8  " + "a" * 32, None),
    ("9" * 40 + " " + "a" * 32, None),  # over the length limit
])
def test_the_hand_out_is_parsed_strictly(value: Any, want: Any) -> None:
    assert parse_next(value) == want


def test_a_client_holds_a_round_only_when_its_digest_matches() -> None:
    nr = NextRound()
    nr.asked(1, "meta", _result(replica_rank=1, max_replica_rank=1))
    good = encode_next(8, result_digest(_result(replica_rank=1, max_replica_rank=1, max_step=8)))
    bad = encode_next(8, result_digest(_result(replica_rank=0, max_step=8)))  # another rank's
    nr.voted(1, 7, True, ((NEXT_ROUND_KEY, bad),))
    assert nr.take(1, 8, "meta", False, 0, None) is None
    nr.voted(1, 7, False, ((NEXT_ROUND_KEY, good),))  # a failed vote hands nothing out
    assert nr.take(1, 8, "meta", False, 0, None) is None
    nr.voted(1, 7, True, ((NEXT_ROUND_KEY, good),))
    got = nr.take(1, 8, "meta", False, 0, {"compute_s": 0.5})
    assert got is not None and got.max_step == 8 and got.replica_rank == 1
    assert nr.take(1, 8, "meta", False, 0, None) is None  # used once
    assert [k for k, _ in nr.vote_metadata()] == ["x-rallypoint-next-round", "x-rallypoint-step-stats"]
    assert [k for k, _ in nr.vote_metadata()] == ["x-rallypoint-next-round"]  # the stats went once


# ------------------------------------------------------------------ two groups of two ranks
class _Groups:
    """Two replica groups of two ranks, one Manager per rank on its own thread."""

    def __init__(self, lh: Any) -> None:
        from torch.distributed import TCPStore

        self.lh = lh
        self.stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
        self.ex = cf.ThreadPoolExecutor(4)
        self.pgs: dict[tuple[int, int], Any] = {}
        self.fail_at: dict[tuple[int, int], int] = {}
        self.asked: dict[tuple[int, int], int] = {}
        self.ms = dict(zip([(g, r) for r in range(2) for g in range(2)],
                           self.ex.map(lambda gr: self._make(*gr), [(g, r) for r in range(2) for g in range(2)])))

    def _make(self, g: int, r: int) -> Any:
        from rallypoint.manager import Manager
        from rallypoint.process_groups import ProcessGroupGloo

        pg = self.pgs[(g, r)] = ProcessGroupGloo(timeout=T)
        m = Manager(pg, lambda sd: None, dict, min_replica_size=2, rank=r, world_size=2, store_addr="127.0.0.1",
                    store_port=self.stores[g].port, lighthouse_addr=self.lh.address(), replica_id=f"grp{g}",
                    hostname="127.0.0.1", timeout=T, quorum_timeout=T, connect_timeout=T)
        real = m._client._quorum
        self.asked[(g, r)] = 0

        def counted(*a: Any, **kw: Any) -> Any:
            self.asked[(g, r)] += 1
            return real(*a, **kw)

        m._client._quorum = counted
        return m

    def _steps(self, g: int, r: int, n: int) -> list[tuple[int, bool, float]]:
        m, out = self.ms[(g, r)], []
        for _ in range(n):
            m.start_quorum()
            t = torch.tensor([float(10 * g + r)])
            m.allreduce(t).wait()  # the average over the groups of this group rank's values
            if self.fail_at.get((g, r)) == m.current_step():
                del self.fail_at[(g, r)]
                m.report_error(RuntimeError("injected by the test"))
            out.append((m.current_step(), m.should_commit(), t.item()))
        return out

    def steps(self, n: int) -> dict[tuple[int, int], list[tuple[int, bool, float]]]:
        """``n`` rounds of every rank, each on its own thread (as separate processes would)."""
        keys = list(self.ms)
        return dict(zip(keys, self.ex.map(lambda k: self._steps(*k, n), keys, timeout=90)))

    def until_three(self, within_s: float = 60.0) -> None:
        """Every rank steps until it committed a round with three replica groups in it (a
        joiner's), however long the joiner takes to start (at most ``within_s`` seconds)."""
        end = time.monotonic() + within_s

        def run(k: tuple[int, int]) -> None:
            m = self.ms[k]
            while not any(r.outcome == "committed" and r.replica_world_size == 3 for r in m.step_records()):
                if time.monotonic() > end:
                    raise AssertionError(f"rank {k} had no committed round with the joiner within {within_s:.0f}s")
                self._steps(*k, 1)

        list(self.ex.map(run, list(self.ms), timeout=within_s + 30))

    def until(self, step: int) -> None:
        """Every rank steps until it committed ``step`` steps (at most 30 rounds): after a
        failure the groups need different numbers of rounds to get there."""
        def run(k: tuple[int, int]) -> None:
            for _ in range(30):
                if self.ms[k].current_step() >= step:
                    return
                self._steps(*k, 1)
            raise AssertionError(f"rank {k} is at step {self.ms[k].current_step()} after 30 rounds")

        list(self.ex.map(run, list(self.ms), timeout=90))

    def close(self) -> None:
        for m in self.ms.values():
            m.shutdown(wait=False)
        for pg in self.pgs.values():
            pg.shutdown()
        self.ex.shutdown()


@pytest.fixture
def groups(lighthouse: Any, monkeypatch: Any) -> Any:
    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")
    g = _Groups(lighthouse(min_replicas=2, join_timeout_ms=5000))
    yield g
    g.close()


def test_on_a_lease_rank_1_makes_one_call_per_step_and_every_step_commits(groups: Any) -> None:
    groups.steps(3)  # the first rounds grant the lease
    server = groups.ms[(0, 0)]._server
    reported: list[tuple[int, list[int]]] = []
    real = server._report_leased

    def report(step: int, ranks: list, first_at: float) -> None:
        reported.append((step, [r.group_rank for r in ranks if r.step_stats is not None]))
        real(step, ranks, first_at)

    server._report_leased = report
    asked = dict(groups.asked)
    taken = {k: m._client.taken for k, m in groups.ms.items()}
    res = groups.steps(12)
    for (g, r), rows in res.items():
        assert all(ok for _, ok, _ in rows), ((g, r), rows)
        assert all(v == pytest.approx(5.0 + r) for _, _, v in rows), rows  # (r + 10 + r) / 2: both groups averaged
    assert {k: m.current_step() for k, m in groups.ms.items()} == {k: 15 for k in groups.ms}
    # rank 1 (over gRPC) and rank 0 (in process) started every round from the vote's answer
    assert {k: groups.asked[k] - asked[k] for k in groups.ms} == {k: 0 for k in groups.ms}
    assert {k: m._client.taken - taken[k] for k, m in groups.ms.items()} == {k: 12 for k in groups.ms}
    # the step stats of every handed-out round are reported, both ranks' (they ride the votes)
    assert [st for st, _ in reported][-11:] == list(range(4, 15)), reported
    assert all(ranks == [0, 1] for _, ranks in reported[-11:]), reported
    assert groups.lh.status()["lease"]["quorum_id"] is not None


def test_a_failed_step_hands_nothing_out_and_the_group_asks(groups: Any) -> None:
    groups.steps(3)
    asked = dict(groups.asked)
    groups.fail_at[(1, 1)] = 4  # group 1's rank 1 fails step 4: group 1 votes no
    groups.until(10)
    assert all(m.current_step() == 10 for m in groups.ms.values()), {k: m.current_step() for k, m in groups.ms.items()}
    failed = {k: [r.step for r in m.step_records() if r.outcome == "failed"] for k, m in groups.ms.items()}
    assert failed[(1, 0)][:1] == [4] and failed[(1, 1)][:1] == [4], failed
    assert all(groups.asked[(1, r)] > asked[(1, r)] for r in range(2))  # the retry asked
    # and once the groups are back together, they are on a lease again: no more calls
    asked, taken = dict(groups.asked), {k: m._client.taken for k, m in groups.ms.items()}
    res = groups.steps(6)
    assert all(ok for rows in res.values() for _, ok, _ in rows), res
    assert groups.asked == asked and all(m._client.taken - taken[k] == 6 for k, m in groups.ms.items())


def test_a_rank_that_asks_anyway_gets_the_handed_out_quorum(groups: Any) -> None:
    """A client that does not take hand-outs (torchft's, say) asks; the server answers it
    with the round its group rank 0 took from the vote, so they stay in one round."""
    groups.steps(3)
    groups.ms[(1, 1)]._client.leased_quorum = lambda *a, **kw: None
    asked, taken0 = dict(groups.asked), groups.ms[(1, 0)]._client.taken
    res = groups.steps(6)
    assert all(ok for rows in res.values() for _, ok, _ in rows), res
    assert groups.asked[(1, 1)] - asked[(1, 1)] == 6 and groups.asked[(1, 0)] == asked[(1, 0)]
    assert groups.ms[(1, 0)]._client.taken - taken0 == 6
    assert len({m.current_step() for m in groups.ms.values()}) == 1


def test_a_third_group_joins_one_step_after_the_revoke(groups: Any, lighthouse: Any) -> None:
    """A joiner revokes the lease; the groups on it run the round already handed out, then
    ask, and a later quorum has all three (the joiner heals to their step). The groups
    train until a round with the joiner committed, however long it takes to start."""
    from torch.distributed import TCPStore

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    groups.steps(3)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stop = threading.Event()

    def joiner(r: int) -> int:
        pg = ProcessGroupGloo(timeout=T)
        m = Manager(pg, lambda sd: None, dict, min_replica_size=2, rank=r, world_size=2, store_addr="127.0.0.1",
                    store_port=store.port, lighthouse_addr=groups.lh.address(), replica_id="grp2",
                    hostname="127.0.0.1", timeout=T, quorum_timeout=T, connect_timeout=T)
        try:
            while not stop.is_set():
                try:
                    m.start_quorum()
                    m.allreduce(torch.tensor([1.0])).wait()
                    m.should_commit()
                except TimeoutError:
                    if not stop.is_set():
                        raise
                    # its last round asked for a quorum the finished groups never joined
            return m.current_step()
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(joiner, r) for r in range(2)]
        try:
            groups.until_three()
        finally:
            stop.set()
        got = [f.result(timeout=60) for f in futs]
    assert min(got) > 3, got  # the joiner healed forward to the groups' step
    steps = {k: m.current_step() for k, m in groups.ms.items()}
    assert len(set(steps.values())) == 1, steps


def test_a_vote_with_bad_stats_is_refused_and_counts_for_nothing(lighthouse: Any) -> None:
    """A rank's ``ShouldCommit`` that asks for the next round with malformed step stats gets
    INVALID_ARGUMENT naming the field, and its vote is not counted; its good vote then
    decides the step and hands out the next round, which the client takes once (two
    groups of two ranks on ManagerServers; a lone group is never leased)."""
    import grpc

    from rallypoint._proto import torchft_pb2 as pb
    from rallypoint.manager._local import LocalManagerClient
    from rallypoint.manager.client import ManagerClient
    from rallypoint.manager.server import ManagerServer

    lh = lighthouse(min_replicas=2)
    servers = [ManagerServer(replica_id=rid, lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                             store_addr=f"store-{rid}:1", world_size=2, on_lease_left=lambda *a: None)
               for rid in ("a", "b")]
    s = servers[0]
    clients = [ManagerClient(x.address(), connect_timeout=5) for x in servers]
    c = clients[0]
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            asks = [pool.submit(LocalManagerClient(x)._quorum, 0, 3, f"http://{x.replica_id}0:1", False, 10.0)
                    for x in servers]
            asks += [pool.submit(cl._quorum, 1, 3, f"http://{x.replica_id}1:1", False, 10.0)
                     for x, cl in zip(servers, clients)]
            results = [f.result(10) for f in asks]
            r1 = results[2]
            assert len({r.quorum_id for r in results}) == 1 and s._lease.held() == r1.quorum_id  # leased
            channel = grpc.insecure_channel(s.address().split("://")[1])
            call = channel.unary_unary("/torchft.ManagerService/ShouldCommit",
                                       request_serializer=pb.ShouldCommitRequest.SerializeToString,
                                       response_deserializer=pb.ShouldCommitResponse.FromString)
            with pytest.raises(grpc.RpcError) as e:
                call(pb.ShouldCommitRequest(group_rank=1, step=3, should_commit=True), timeout=5,
                     metadata=[*c._rank_metadata, ("x-rallypoint-next-round", "1"),
                               ("x-rallypoint-step-stats", '{"compute_s":-1}')])
            channel.close()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'compute_s'" in e.value.details()
            assert 3 not in s._commits and s._issued is None  # nothing counted, nothing handed out
            v0 = pool.submit(LocalManagerClient(s).should_commit, 0, 3, True, 10.0)
            assert c.should_commit(1, 3, True, 10.0) is True and v0.result(10) is True
        assert s._issued is not None and s._issued.step == 4
        got = c.leased_quorum(1, 4, "http://a1:1", False)
        assert got is not None and got.max_step == 4 and got.replica_rank == r1.replica_rank and c.taken == 1
        assert c.leased_quorum(1, 4, "http://a1:1", False) is None  # once
        # asking anyway gets the same round, at once (no gathering, no lighthouse)
        assert c._quorum(1, 4, "http://a1:1", False, 10.0) == got
        # each rank's result is derived once per lease, and a later round's equals a fresh one
        base = s._issued.base
        for step in (4, 5, 9):
            s._issued = Issued(step, base)
            for rank in (0, 1):
                fresh = compute_quorum_result(leased_quorum(base, step), "a", rank, True)
                assert s._issued_result(rank, step) == fresh and fresh.max_step == step
                assert s._issued_results[rank][0] is base
    finally:
        for cl in clients:
            cl.close()
        for x in servers:
            x.shutdown()
