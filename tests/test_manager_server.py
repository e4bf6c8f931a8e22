"""ManagerServer + ManagerClient against a real (in-process) lighthouse on loopback.

Two replica groups of two ranks each, every rank a thread with its own ManagerClient;
quorum results, should_commit voting keyed by step, error fan-out when the lighthouse
fails or times out, Kill, and interop with torchft 0.2.0's Rust ``ManagerClient`` (and a
differential check of our answers against torchft's own ``ManagerServer``).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import timedelta
from typing import Any, TypeVar

import grpc
import pytest

from conftest import wait_until
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.manager.client import ManagerClient
from rallypoint.manager.recovery import QuorumResult
from rallypoint.manager.server import ManagerServer

T = TypeVar("T")
JOIN_S = 20.0
CONNECT = 5.0


class Cluster:
    """A lighthouse plus ManagerServers and clients; everything is shut down at teardown."""

    def __init__(self) -> None:
        self.lighthouses: list[Any] = []
        self.servers: list[Any] = []
        self.clients: list[Any] = []

    def lighthouse(self, **kw: Any) -> LighthouseServer:
        kw.setdefault("join_timeout_ms", 10_000)
        lh = LighthouseServer(bind="127.0.0.1:0", **kw)
        self.lighthouses.append(lh)
        return lh

    def server(self, lh_addr: str, rid: str, world_size: int = 2, **kw: Any) -> ManagerServer:
        kw.setdefault("store_addr", f"store-{rid}:29500")
        s = ManagerServer(
            replica_id=rid,
            lighthouse_addr=lh_addr,
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            world_size=world_size,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=CONNECT,
            **kw,
        )
        self.servers.append(s)
        return s

    def client(self, addr: str) -> ManagerClient:
        c = ManagerClient(addr, connect_timeout=CONNECT)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in reversed(self.servers):
            s.shutdown()
        for lh in reversed(self.lighthouses):
            lh.shutdown()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def concurrently(*calls: Callable[[], T], timeout: float = JOIN_S) -> list[T | BaseException]:
    """Run the calls in parallel threads; results (or raised exceptions) in call order."""
    out: list[T | BaseException] = []
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        for f in futures:
            try:
                out.append(f.result(timeout=timeout))
            except Exception as e:  # noqa: BLE001 - collected for the test to check
                out.append(e)
    return out


def ok(results: list[T | BaseException]) -> list[T]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def two_groups(cluster: Cluster, **server_kw: Any) -> tuple[LighthouseServer, list[ManagerServer], list[list[ManagerClient]]]:
    lh = cluster.lighthouse(min_replicas=2)
    servers = [cluster.server(lh.address(), f"grp{g}", **server_kw) for g in range(2)]
    clients = [[cluster.client(s.address()) for _ in range(2)] for s in servers]
    return lh, servers, clients


# ------------------------------------------------------------------------ quorum
def test_two_groups_two_ranks_consistent_results(cluster: Cluster) -> None:
    _, servers, clients = two_groups(cluster)
    steps = [3, 5]  # grp0 is behind
    calls = [
        (lambda g=g, r=r: clients[g][r]._quorum(r, steps[g], f"meta-{g}-{r}", False, timeout=10.0))
        for g in range(2)
        for r in range(2)
    ]
    res = ok(concurrently(*calls))
    by = {(g, r): res[2 * g + r] for g in range(2) for r in range(2)}
    assert len({x.quorum_id for x in res}) == 1
    for (g, r), x in by.items():
        assert x.replica_rank == g and x.replica_world_size == 2
        assert x.replica_ids == ["grp0", "grp1"]
        assert x.max_step == 5 and x.max_world_size == 1
        assert x.store_address == "store-grp1:29500"
    for r in range(2):
        healer, source = by[(0, r)], by[(1, r)]
        assert healer.heal and healer.recover_src_replica_rank == 1
        assert healer.recover_src_manager_address == servers[1].address()
        assert healer.max_replica_rank is None and healer.recover_dst_replica_ranks == []
        assert not source.heal and source.recover_src_replica_rank is None and source.recover_src_manager_address == ""
        assert source.recover_dst_replica_ranks == [0] and source.max_replica_rank == 0
    # The healer reads each source rank's checkpoint metadata from the source's server.
    assert clients[0][1]._checkpoint_metadata(1, timeout=5.0) == "meta-0-1"
    src = cluster.client(by[(0, 0)].recover_src_manager_address)
    assert [src._checkpoint_metadata(r, timeout=5.0) for r in range(2)] == ["meta-1-0", "meta-1-1"]
    with pytest.raises(KeyError, match="no checkpoint metadata for group rank 7"):
        src._checkpoint_metadata(7, timeout=5.0)

    # Next step: both at 6, nobody heals; the lighthouse's fast path keeps the quorum id.
    res2 = ok(concurrently(*((lambda g=g, r=r: clients[g][r]._quorum(r, 6, "m", False, timeout=10.0)) for g in range(2) for r in range(2))))
    assert {x.quorum_id for x in res2} == {res[0].quorum_id}
    assert not any(x.heal for x in res2)
    assert [x.max_world_size for x in res2] == [2, 2, 2, 2]


def test_first_step_init_sync_heals_all_but_the_primary(cluster: Cluster) -> None:
    _, _, clients = two_groups(cluster)
    res = ok(concurrently(*((lambda g=g, r=r: clients[g][r]._quorum(r, 0, "", False, timeout=10.0)) for g in range(2) for r in range(2))))
    by = {(g, r): res[2 * g + r] for g in range(2) for r in range(2)}
    # Every group rank starts from the same copy, replica 0 (torchft 0.2.0 would use
    # replica r for group rank r, mixing two replicas' initial states in one group).
    for r in range(2):
        assert by[(0, r)].heal is False and by[(0, r)].recover_dst_replica_ranks == [1]
        assert by[(1, r)].heal is True and by[(1, r)].recover_src_replica_rank == 0
        assert by[(0, r)].store_address == by[(1, r)].store_address == f"store-grp{r}:29500"


def test_rank_that_gave_up_is_withdrawn_from_the_round(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "solo")
    c0, c1 = cluster.client(s.address()), cluster.client(s.address())
    with pytest.raises(TimeoutError, match="group rank 0 at step 1"):
        c0._quorum(0, 1, "", False, timeout=0.3)
    # A fresh round for the same step needs both ranks again: rank 1 alone must not complete it.
    with pytest.raises(TimeoutError):
        c1._quorum(1, 1, "", False, timeout=0.3)
    res = ok(concurrently(lambda: c0._quorum(0, 1, "", False, timeout=5.0), lambda: c1._quorum(1, 1, "", False, timeout=5.0)))
    assert [x.replica_world_size for x in res] == [1, 1]


def test_out_of_range_group_rank_is_rejected(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "solo")
    with pytest.raises(ValueError, match="group_rank 2 is out of range"):
        cluster.client(s.address())._quorum(2, 1, "", False, timeout=2.0)


# --------------------------------------------------------------------- errors
@pytest.mark.parametrize("retries", [0, 2])
def test_lighthouse_unreachable_fails_every_waiting_rank_at_once(cluster: Cluster, retries: int) -> None:
    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "lonely", quorum_retries=retries)
    c0, c1 = cluster.client(s.address()), cluster.client(s.address())
    lh.shutdown()
    t0 = time.monotonic()
    res = concurrently(lambda: c0._quorum(0, 1, "", False, timeout=15.0), lambda: c1._quorum(1, 1, "", False, timeout=15.0))
    elapsed = time.monotonic() - t0
    for r in res:
        assert isinstance(r, ConnectionError), r
        assert "lonely" in str(r) and "lighthouse" in str(r)
    assert elapsed < 5.0, elapsed


def test_lighthouse_timeout_fans_out_before_the_ranks_deadlines(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=2)  # only one group ever asks: no quorum
    s = cluster.server(lh.address(), "early", quorum_timeout=0.5)
    c0, c1 = cluster.client(s.address()), cluster.client(s.address())
    t0 = time.monotonic()
    res = concurrently(lambda: c0._quorum(0, 1, "", False, timeout=15.0), lambda: c1._quorum(1, 1, "", False, timeout=15.0))
    elapsed = time.monotonic() - t0
    for r in res:
        assert isinstance(r, TimeoutError), r
        assert "early" in str(r) and "timed out" in str(r)
    assert elapsed < 5.0, elapsed


def test_request_deadline_bounds_the_lighthouse_call(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=2)
    s = cluster.server(lh.address(), "bounded")
    c0, c1 = cluster.client(s.address()), cluster.client(s.address())
    t0 = time.monotonic()
    res = concurrently(lambda: c0._quorum(0, 1, "", False, timeout=0.8), lambda: c1._quorum(1, 1, "", False, timeout=0.8))
    assert all(isinstance(r, TimeoutError) for r in res), res
    assert time.monotonic() - t0 < 5.0
    # The lighthouse no longer holds the group as a participant.
    deadline = time.monotonic() + 5.0
    while any(r["replica_id"] == "bounded" and r["participating"] for r in lh.status()["replicas"]):
        assert time.monotonic() < deadline, "lighthouse still holds the abandoned quorum request"
        time.sleep(0.02)


# -------------------------------------------------------------- should_commit
def test_should_commit_votes(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "voter")
    c = [cluster.client(s.address()) for _ in range(2)]

    def vote(step: int, votes: tuple[bool, bool], timeout: float = 5.0) -> list[Any]:
        return concurrently(*((lambda r=r: c[r].should_commit(r, step, votes[r], timeout=timeout)) for r in range(2)))

    assert vote(1, (True, True)) == [True, True]
    assert vote(2, (True, False)) == [False, False]
    # A retried vote for a decided step gets the same answer.
    assert c[0].should_commit(0, 2, True, timeout=2.0) is False

    # Rank 0 votes False for step 3 and gives up; that vote never counts at step 4.
    with pytest.raises(TimeoutError, match="should_commit of group rank 0 at step 3"):
        c[0].should_commit(0, 3, False, timeout=0.3)
    assert vote(4, (True, True)) == [True, True]

    # A vote still waiting for step 5 is released (not counted) once step 6 decides.
    stale: list[Any] = []
    t = threading.Thread(target=lambda: stale.append(concurrently(lambda: c[0].should_commit(0, 5, False, timeout=10.0))[0]))
    t.start()
    deadline = time.monotonic() + 5.0
    while 5 not in s._commits:  # the step-5 vote has arrived (read-only peek)
        assert time.monotonic() < deadline, "step-5 vote never reached the server"
        time.sleep(0.01)
    assert concurrently(lambda: c[0].should_commit(0, 6, True, timeout=5.0), lambda: c[1].should_commit(1, 6, True, timeout=5.0)) == [True, True]
    t.join(JOIN_S)
    assert isinstance(stale[0], ConnectionError) and "superseded by step 6" in str(stale[0])


def test_a_false_vote_stands(cluster: Cluster) -> None:
    """Rank 1 votes False for step 7; a second vote True for rank 1 and step 7 (a retry
    or a forgery) arriving before rank 0 voted does not turn the step into a commit."""
    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "stubborn")
    c = [cluster.client(s.address()) for _ in range(2)]
    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(concurrently(lambda: c[1].should_commit(1, 7, False, timeout=10.0))[0]))
    t.start()
    deadline = time.monotonic() + 5.0
    while 7 not in s._commits:  # rank 1's False has arrived (read-only peek)
        assert time.monotonic() < deadline, "the step-7 vote never reached the server"
        time.sleep(0.01)
    # On the server's loop, in this order: rank 1's second vote (True), then rank 0's.
    import asyncio

    second = asyncio.run_coroutine_threadsafe(s._vote(1, 7, True), s._loop)
    rank0 = asyncio.run_coroutine_threadsafe(s._vote(0, 7, True), s._loop)
    assert (second.result(10), rank0.result(10)) == (False, False)
    t.join(JOIN_S)
    assert first == [False]


# ----------------------------------------------------------------------- kill
def test_kill_calls_on_kill_with_the_message(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=1)
    got: list[str] = []
    s = cluster.server(lh.address(), "victim", on_kill=got.append)
    cluster.client(s.address()).kill("operator asked", timeout=5.0)
    assert got == ["operator asked"]


KILL_CHILD = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from rallypoint.manager.server import ManagerServer
s = ManagerServer("doomed", sys.argv[1], "127.0.0.1", "127.0.0.1:0", "st:1", 1, liveness=False)
print(s.address(), flush=True)
import time
time.sleep(60)
"""


def test_kill_ends_the_process_with_a_logged_reason(cluster: Cluster) -> None:
    lh = cluster.lighthouse(min_replicas=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, lh.address()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20.0)
        assert ready, "child manager server did not start within 20s"
        addr = proc.stdout.readline().strip()
        assert addr.startswith("http://127.0.0.1:"), addr
        cluster.client(addr).kill("node is being drained", timeout=5.0)
        assert proc.wait(timeout=10) == 1
        assert proc.stderr is not None
        assert "got Kill: node is being drained" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_heartbeats_kill_via_lighthouse_and_goodbye(cluster: Cluster) -> None:
    from rallypoint.lighthouse.client import LighthouseClient

    lh = cluster.lighthouse(min_replicas=1)
    got: list[str] = []
    s = cluster.server(lh.address(), "held", on_kill=got.append)

    def row() -> dict:
        return next(r for r in lh.status()["replicas"] if r["replica_id"] == "held")

    assert row()["attached"] and not row()["dead"] and row()["address"] == s.address()
    with LighthouseClient(lh.address(), connect_timeout=CONNECT) as lc:
        assert lc.kill("held", reason="drain the node", timeout=5.0) == s.address()
    assert got == ["drain the node"]
    s.shutdown()
    # A clean shutdown says goodbye: gone at once, recorded as a leave (not a crash).
    deadline = time.monotonic() + 5.0
    while not (row()["dead"] and not row()["attached"]):
        assert time.monotonic() < deadline, row()
        time.sleep(0.01)
    kinds = [e.kind for e in lh.core.store.events(limit=20, since_id=None, replica_id="held")]
    assert "leave" in kinds, kinds


# -------------------------------------------------------------------- interop
TF_FIELDS = (
    "quorum_id",
    "replica_rank",
    "replica_world_size",
    "recover_src_replica_rank",
    "recover_dst_replica_ranks",
    "max_step",
    "max_replica_rank",
    "max_world_size",
    "heal",
    "replica_ids",
)


def _norm(r: Any, addresses: list[str], stores: list[str]) -> dict[str, Any]:
    d = {f: getattr(r, f) for f in TF_FIELDS}
    d["recover_dst_replica_ranks"] = list(d["recover_dst_replica_ranks"])
    d["replica_ids"] = list(d["replica_ids"])
    d["src_addr"] = addresses.index(r.recover_src_manager_address) if r.recover_src_manager_address else None
    d["store"] = stores.index(r.store_address)
    return d


@pytest.mark.interop
def test_torchft_client_and_server_agree_with_ours(cluster: Cluster) -> None:
    """torchft 0.2.0's Rust ManagerClient against our ManagerServer gets what our client
    gets, and both match torchft's own ManagerServer on the same scenarios."""
    from torchft._torchft import ManagerClient as TfClient
    from torchft._torchft import ManagerServer as TfServer

    n, ws = 3, 2
    tf_td = timedelta(seconds=10)
    rounds = [[0, 0, 0], [7, 2, 7], [4, 4, 1]]  # init_sync first step, healers, multi-source
    seen: dict[str, list[list[dict]]] = {}
    for kind in ("ours-tfclient", "ours-ourclient", "theirs"):
        lh = cluster.lighthouse(min_replicas=n)
        if kind == "theirs":
            servers: list[Any] = []
            for i in range(n):
                servers.append(
                    TfServer(
                        replica_id=f"rep{i}", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                        store_addr=f"store{i}:1", world_size=ws, heartbeat_interval=timedelta(milliseconds=100),
                        connect_timeout=tf_td, quorum_retries=0,
                    )
                )
                cluster.servers.append(servers[-1])
        else:
            # Leases off: these rounds jump between steps, which ends a lease and (LEASES.md) gives
            # the next quorum a new id, where torchft's server keeps it; the answers are compared here.
            servers = [cluster.server(lh.address(), f"rep{i}", world_size=ws, store_addr=f"store{i}:1", leases=False)
                       for i in range(n)]
        addresses = [s.address() for s in servers]
        stores = [f"store{i}:1" for i in range(n)]
        if kind == "ours-ourclient":
            clients = [[cluster.client(a) for _ in range(ws)] for a in addresses]
            ask = lambda i, g, step: clients[i][g]._quorum(g, step, f"m{i}{g}", False, timeout=10.0, commit_failures=0, init_sync=True)  # noqa: E731
            commit = lambda i, g, step: clients[i][g].should_commit(g, step, True, timeout=10.0)  # noqa: E731
        else:
            tclients = [[TfClient(addr=a, connect_timeout=tf_td) for _ in range(ws)] for a in addresses]
            ask = lambda i, g, step: tclients[i][g]._quorum(  # noqa: E731
                group_rank=g, step=step, checkpoint_metadata=f"m{i}{g}", shrink_only=False, timeout=tf_td, commit_failures=0, init_sync=True
            )
            commit = lambda i, g, step: tclients[i][g].should_commit(g, step, True, tf_td)  # noqa: E731
        seen[kind] = []
        for steps in rounds:
            res = ok(concurrently(*((lambda i=i, g=g: ask(i, g, steps[i])) for i in range(n) for g in range(ws))))
            seen[kind].append([_norm(r, addresses, stores) for r in res])
            assert ok(concurrently(*((lambda i=i, g=g: commit(i, g, steps[i])) for i in range(n) for g in range(ws)))) == [True] * (n * ws)
    assert seen["ours-tfclient"] == seen["ours-ourclient"]
    # Identical to torchft's answers, except on purpose in the first (init_sync, step 0)
    # round for group rank 1: torchft starts it from replica 1, we from replica 0 like rank 0.
    assert seen["ours-tfclient"][1:] == seen["theirs"][1:]
    ours0, theirs0 = seen["ours-tfclient"][0], seen["theirs"][0]
    assert [ours0[k] for k in range(0, n * ws, ws)] == [theirs0[k] for k in range(0, n * ws, ws)]  # group rank 0
    assert [d["heal"] for d in ours0] == [False, False, True, True, True, True]
    assert [d["heal"] for d in theirs0] == [False, True, True, False, True, True]
    # Sanity: the round with healers did heal rep1 (from a replica at step 7).
    assert [d["heal"] for d in seen["theirs"][1]] == [False, False, True, True, False, False]


@pytest.mark.interop
def test_our_server_against_torchft_lighthouse(cluster: Cluster) -> None:
    """Our ManagerServer asks torchft's own lighthouse (no liveness stream there: heartbeats only)."""
    from torchft._torchft import LighthouseServer as TfLighthouse

    lh = TfLighthouse(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    cluster.lighthouses.append(lh)
    servers = [cluster.server(lh.address(), f"grp{g}", world_size=1) for g in range(2)]
    clients = [cluster.client(s.address()) for s in servers]
    res = ok(concurrently(*((lambda g=g: clients[g]._quorum(0, [2, 4][g], "", False, timeout=10.0)) for g in range(2))))
    assert [r.replica_rank for r in res] == [0, 1]
    assert [r.heal for r in res] == [True, False]
    assert res[0].recover_src_manager_address == servers[1].address()
    assert res[1].recover_dst_replica_ranks == [0]


def test_our_result_type_round_trips() -> None:
    from rallypoint.manager.client import result_from_pb, result_to_pb

    r = QuorumResult(3, 1, 2, "http://a:1", 0, [], "s:1", 9, None, 1, True, 2, ["a", "b"])
    assert asdict(result_from_pb(result_to_pb(r))) == asdict(r)
    r2 = QuorumResult(3, 0, 2, "", None, [1], "s:1", 9, 0, 1, False, 0, ["a", "b"])
    assert asdict(result_from_pb(result_to_pb(r2))) == asdict(r2)


# ------------------------------------------------------------------ step stats
def test_the_lighthouse_gets_the_slower_ranks_step_stats(cluster: Cluster) -> None:
    """Rank 1 over gRPC (the x-rallypoint-step-stats metadata) and rank 0 in process both
    report; the lighthouse's request data carries the slower rank's stats."""
    from rallypoint.manager._local import LocalManagerClient

    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "stats")
    slow = {"step": 4, "round": 2, "outcome": "committed", "step_s": 3.0, "compute_s": 2.5, "comm_s": 0.25}
    res = ok(concurrently(
        lambda: LocalManagerClient(s)._quorum(0, 5, "", False, 5.0, step_stats={"step": 4, "compute_s": 1}),
        lambda: cluster.client(s.address())._quorum(1, 5, "", False, 5.0, step_stats=slow)))
    assert [r.replica_ids for r in res] == [["stats"], ["stats"]]
    assert lh.core.previous is not None
    data = json.loads(lh.core.previous.members[0].data)
    assert data["step_stats"] == {**slow, "rank": 1} and data["step"] == 5 and data["group_world_size"] == 2


@pytest.mark.parametrize("header, field", [('{"compute_s":-1}', "'compute_s'"), ('{"colour":"red"}', "'colour'")])
def test_bad_step_stats_are_refused_and_change_nothing(cluster: Cluster, header: str, field: str) -> None:
    from rallypoint._proto import torchft_pb2 as pb
    from rallypoint.manager._local import LocalManagerClient

    lh = cluster.lighthouse(min_replicas=1)
    s = cluster.server(lh.address(), "strict")
    with ThreadPoolExecutor(1) as pool:
        rank0 = pool.submit(LocalManagerClient(s)._quorum, 0, 3, "http://rank0:1", False, 10.0)
        wait_until(lambda: 3 in s._rounds and 0 in s._rounds[3].requests, what="rank 0 in the round")
        channel = grpc.insecure_channel(s.address().split("://")[1])
        call = channel.unary_unary("/torchft.ManagerService/Quorum",
                                   request_serializer=pb.ManagerQuorumRequest.SerializeToString,
                                   response_deserializer=pb.ManagerQuorumResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            call(pb.ManagerQuorumRequest(group_rank=1, step=3, checkpoint_metadata="http://evil:1"), timeout=5,
                 metadata=[("x-rallypoint-step-stats", header), ("x-rallypoint-rank-key", "k" * 32)])
        channel.close()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        assert list(s._rounds) == [3] and list(s._rounds[3].requests) == [0] and list(s._rounds[3].stats) == [0]
        assert 1 not in s._metadata and 1 not in s._rank_keys
        # The round still completes with rank 1's good request.
        good = cluster.client(s.address())._quorum(1, 3, "http://rank1:1", False, 5.0, step_stats={"compute_s": 0.5})
        assert good.replica_ids == rank0.result(10).replica_ids == ["strict"]
