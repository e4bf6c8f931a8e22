"""torchft 0.3's reconfigure handles, end to end through rallypoint (issue 36).

* pure tables: what a handle, a member's handles and a rank's handle may be
  (:mod:`rallypoint._net.handles`), the answer per group rank, the quorum id rule;
* persistence: the state file, etcd's JSON and the wire keep every member's handles;
* our lighthouse: handles kept in replica order, bad ones refused (INVALID_ARGUMENT naming
  the field) without touching the quorum of the others;
* our lighthouse + our ManagerServers: each group rank gets its own rank's handle of every
  member, in replica order; a bad or repeated rank handle is refused and changes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rallypoint._net import handles as H
from rallypoint._net.limits import MAX_GROUP_HANDLES, MAX_RECONFIGURE_HANDLE_BYTES
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse import validate
from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.etcd_state import quorum_from_json, quorum_json
from rallypoint.lighthouse.quorum import Member, Pending, Quorum, next_quorum_id
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.lighthouse.state import StateStore
from rallypoint.manager.client import ManagerClient, result_from_pb, result_to_pb
from rallypoint.manager.recovery import compute_quorum_result
from rallypoint.manager.server import ManagerServer

T = TypeVar("T")
JOIN_S = 20.0


def handle(i: Any, store: str = "h:1") -> str:
    """A handle as torchft-nightly's ProcessGroup.get_reconfigure_handle() writes it."""
    return json.dumps({"id": f"pg-{i}", "store": store, "global_rank": None})


# ------------------------------------------------------------------ pure tables
@pytest.mark.parametrize("value, error", [
    ("", None),
    ("{}", None),
    (handle(1), None),
    ('{"id": "x", "nested": {"a": [1, 2]}}', None),
    ("gloo:0:-1:0:127.0.0.1:34275", None),  # torch 2.14's native ProcessGroupGloo handle
    ("nccl2:0:3:1:[::1]:29500", None),
    ("self", "reconfigure_handle is not JSON"),
    ("gloo: 0", "reconfigure_handle is not JSON"),  # a space: not torch's form
    ("gloo:", "reconfigure_handle is not JSON"),
    ("9p:x", "reconfigure_handle is not JSON"),
    ('{"id": ', "reconfigure_handle is not JSON"),
    ("[1, 2]", "reconfigure_handle is JSON but not an object"),
    ('"pg-1"', "reconfigure_handle is JSON but not an object"),
    ("null", "reconfigure_handle is JSON but not an object"),
    ('{"id": "' + "x" * MAX_RECONFIGURE_HANDLE_BYTES + '"}', "reconfigure_handle is 4106 bytes; the limit is 4096"),
    ("[" * 5000 + "]" * 5000, "reconfigure_handle is 10000 bytes"),
    ("[" * 2000 + "]" * 2000, "reconfigure_handle is not JSON"),  # under the limit, but nested too deeply
])
def test_check_handle(value: str, error: str | None) -> None:
    if error is None:
        assert H.check_handle(value) == value
    else:
        with pytest.raises(ValueError, match=error.replace("[", r"\[")):
            H.check_handle(value)


F = "requester.reconfigure_handles"


@pytest.mark.parametrize("handles, world_size, error", [
    ([], 4, None),  # torchft 0.2 and our own process groups send none
    ([handle(0), handle(1)], 2, None),
    (["", ""], 2, None),  # torchft-nightly's server sends one per rank even when all are ''
    ([handle(0), ""], 2, None),  # a rank without a reconfigurable process group
    ([handle(0)], 2, f"{F} has 1 handles for a replica group of world_size 2"),
    ([handle(0), handle(1), handle(2)], 2, f"{F} has 3 handles"),
    ([handle(0)], 0, f"{F} has 1 handles for a replica group of world_size 0"),
    ([handle(0), "oops"], 2, rf"{F}\[1\] is not JSON"),
    ([handle(0), "[]"], 2, rf"{F}\[1\] is JSON but not an object"),
    ([handle(0), handle(0)], 2, rf"{F}\[1\] repeats {F}\[0\]"),
    (["", handle(5), "", handle(5)], 4, rf"{F}\[3\] repeats {F}\[1\]"),
    ([""] * (MAX_GROUP_HANDLES + 1), MAX_GROUP_HANDLES + 1, f"{F} has {MAX_GROUP_HANDLES + 1} handles; the limit"),
    ([handle("x" * 4000 + str(i)) for i in range(300)], 300, f"{F} are .* bytes together; the limit is 1048576"),
])
def test_check_group_handles(handles: list[str], world_size: int, error: str | None) -> None:
    if error is None:
        assert H.check_group_handles(handles, world_size) == tuple(handles)
    else:
        with pytest.raises(ValueError, match=error):
            H.check_group_handles(handles, world_size)


@pytest.mark.parametrize("mine, others, expected", [
    ((), {"b": ("x",)}, None),
    (("a0", "a1"), {}, None),
    (("a0", "a1"), {"b": ("b0", "b1")}, None),
    (("", ""), {"b": ("", "")}, None),  # '' is "none", never a collision
    (("a0", "b1"), {"b": ("b0", "b1")}, (1, "b")),
    (("c0",), {"b": ("b0",), "c": ("", "c0")}, (0, "c")),
])
def test_collision(mine: tuple[str, ...], others: dict[str, tuple[str, ...]], expected: Any) -> None:
    assert H.collision(mine, others) == expected


@pytest.mark.parametrize("handle_, rank, by_rank, error", [
    ("", 0, {1: ""}, None),
    ("{}", 0, {}, None),
    ('{"id": 1}', 1, {0: '{"id": 0}'}, None),
    ('{"id": 1}', 1, {1: '{"id": 1}'}, None),  # the rank's own earlier request is replaced, not a duplicate
    ('{"id": 1}', 1, {0: '{"id": 1}'}, "reconfigure_handle of group rank 1 is also group rank 0's"),
    ("nope", 0, {}, "reconfigure_handle is not JSON"),
    ("x" * (MAX_RECONFIGURE_HANDLE_BYTES + 1), 0, {}, "reconfigure_handle is 4097 bytes"),
])
def test_rank_handle_refusal(handle_: str, rank: int, by_rank: dict[int, str], error: str | None) -> None:
    why = H.rank_handle_refusal(handle_, rank, by_rank)
    assert (why is None) == (error is None)
    if error is not None:
        assert why is not None and error in why


@pytest.mark.parametrize("by_rank, world_size, expected", [
    ({0: "", 1: ""}, 2, ()),
    ({}, 2, ()),
    ({0: "a", 1: "b"}, 2, ("a", "b")),
    ({1: "b", 0: ""}, 3, ("", "b", "")),
])
def test_group_handles(by_rank: dict[int, str], world_size: int, expected: tuple[str, ...]) -> None:
    assert H.group_handles(by_rank, world_size) == expected


@pytest.mark.parametrize("members, rank, expected", [
    ([("a0", "a1"), ("b0", "b1")], 0, ["a0", "b0"]),
    ([("a0", "a1"), ("b0", "b1")], 1, ["a1", "b1"]),
    ([("a0", "a1"), ()], 1, ["a1", ""]),  # a member that sent none: ''
    ([("a0",), ("b0", "b1")], 1, ["", "b1"]),  # fewer (another lighthouse may pass that on): ''
    ([(), ()], 0, ["", ""]),
])
def test_handles_for_rank(members: list[tuple[str, ...]], rank: int, expected: list[str]) -> None:
    assert H.handles_for_rank(members, rank) == expected


def _m(rid: str, *hs: str, step: int = 1, ws: int = 2) -> Member:
    return Member(rid, address=f"http://{rid}:1", store_address=f"{rid}:2", step=step, world_size=ws,
                  reconfigure_handles=hs)


@pytest.mark.parametrize("before, after", [
    ((_m("a"), _m("b")), (_m("a"), _m("b"))),  # no handles: torchft 0.2's rule alone
    ((_m("a", "a0", "a1"), _m("b", "b0", "b1")), (_m("a", "a0", "a1"), _m("b", "b0", "b1"))),
    # torch's native handle after a reconfigure: the communicator id in it changed
    ((_m("a", "gloo:0:-1:0:h:1", "gloo:1:-1:0:h:2"), _m("b")), (_m("a", "gloo:0:5:0:h:1", "gloo:1:5:0:h:2"), _m("b"))),
    ((_m("a"), _m("b")), (_m("a", "a0", "a1"), _m("b"))),  # a now sends handles
])
def test_a_changed_handle_alone_keeps_the_quorum_id(before: tuple[Member, ...], after: tuple[Member, ...]) -> None:
    """Handles are carried, not compared (as torchft's lighthouse): torch's native handle
    changes at every reconfigure, so comparing would reconfigure every step."""
    assert next_quorum_id(Quorum(5, before), 5, after) == 5
    assert next_quorum_id(Quorum(5, before), 5, after[:1]) == 6  # membership still counts


def test_each_group_rank_gets_its_handles_in_replica_order() -> None:
    members = (_m("c", "c0", "c1", step=3), _m("a", "a0", "a1", step=3), _m("b", step=3))  # not sorted
    for rank in range(2):
        for rid in ("a", "b", "c"):
            r = compute_quorum_result(Quorum(1, members), rid, rank)
            assert r.replica_ids == ["a", "b", "c"]
            assert r.reconfigure_handles == [f"a{rank}", "", f"c{rank}"]
            # the rank finds itself at its replica rank (a process group's rank = own handle's index)
            if rid != "b":
                assert r.reconfigure_handles.index(f"{rid}{rank}") == r.replica_rank
    # the wire keeps it
    r = compute_quorum_result(Quorum(1, members), "a", 1)
    assert result_from_pb(result_to_pb(r)).reconfigure_handles == ["a1", "", "c1"]


# ------------------------------------------------------------------ persistence and wire
QUORUM = Quorum(9, (_m("a", handle("a0"), ""), _m("b"), _m("c", handle("c0"), handle("c1"))), created=12.5)


def test_the_wire_keeps_every_members_handles() -> None:
    msg = pb.Quorum(quorum_id=9, participants=[validate.member_to_pb(m) for m in QUORUM.members])
    back = pb.Quorum.FromString(msg.SerializeToString())
    assert tuple(validate.member_from_pb(p) for p in back.participants) == QUORUM.members
    assert list(back.participants[0].reconfigure_handles) == [handle("a0"), ""]


def test_the_state_file_keeps_every_members_handles(tmp_path: Path) -> None:
    db = str(tmp_path / "lh.db")
    with StateStore(db) as s:
        s.save_quorum(QUORUM)
        assert s.flush(JOIN_S)
    with StateStore(db) as s:
        restored = s.restore().last_quorum
    assert restored == QUORUM
    assert restored is not None and restored.members[2].reconfigure_handles == (handle("c0"), handle("c1"))


def test_etcd_json_keeps_every_members_handles() -> None:
    assert quorum_from_json(quorum_json(QUORUM)) == QUORUM


@pytest.mark.parametrize("bad", [{"x": 1}, [1, 2], "ab"])
def test_a_restored_member_with_bad_handles_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError, match="reconfigure_handles must be a list of strings"):
        Member("a", reconfigure_handles=bad)


def test_lighthouse_validation_names_the_field() -> None:
    req = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a", world_size=2,
                                                               reconfigure_handles=[handle(0), "x"]))
    with pytest.raises(validate.InvalidRequest, match=r"requester.reconfigure_handles\[1\] is not JSON"):
        validate.quorum_request(req)
    pending = {"b": Pending(_m("b", handle(0), handle(1)), 0.0)}
    member = _m("a", handle(1), handle(2))
    with pytest.raises(validate.InvalidRequest, match=r"requester.reconfigure_handles\[0\] .* is also replica b's"):
        validate.handle_collision(member, pending)
    validate.handle_collision(_m("b", handle(0), handle(1)), pending)  # its own earlier request: fine


# ------------------------------------------------------------------ live: lighthouse, servers
def concurrently(*calls: Callable[[], T], timeout: float = JOIN_S) -> list[T]:
    """Run the calls in parallel threads; their results in call order (the first error raised)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futures]


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., LighthouseServer]]:
    started: list[LighthouseServer] = []

    def make(**kw: Any) -> LighthouseServer:
        kw.setdefault("join_timeout_ms", 10_000)
        lh = LighthouseServer(bind="127.0.0.1:0", **kw)
        started.append(lh)
        return lh

    try:
        yield make
    finally:
        for lh in started:
            lh.shutdown()


def test_lighthouse_keeps_handles_in_replica_order_and_refuses_bad_ones(
        lighthouse: Callable[..., LighthouseServer]) -> None:
    lh = lighthouse(min_replicas=2)
    clients = [LighthouseClient(lh.address(), connect_timeout=5.0) for _ in range(4)]
    try:
        def ask(i: int, rid: str, hs: list[str], ws: int = 2) -> Any:
            return clients[i].quorum(rid, timeout=10.0, address=f"http://{rid}:1", store_address=f"{rid}:2",
                                     step=1, world_size=ws, reconfigure_handles=hs)

        bad = [
            (["x", ""], r"requester.reconfigure_handles\[0\] is not JSON"),
            ([handle(0)], "has 1 handles for a replica group of world_size 2"),
            ([handle(0), handle(0)], r"requester.reconfigure_handles\[1\] repeats"),
            ([handle("x" * 5000), ""], r"requester.reconfigure_handles\[0\] is \d+ bytes; the limit is 4096"),
        ]
        for hs, msg in bad:
            with pytest.raises(ValueError, match=msg):
                ask(0, "zed", hs)
        # "zed" and "alpha" form a quorum; "beta" repeats one of zed's handles: refused while
        # zed waits, and the quorum of the others forms regardless.
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            zed = pool.submit(ask, 0, "zed", [handle("z0"), handle("z1")])
            wait_for(lambda: participating(lh, "zed"), "zed asked")
            with pytest.raises(ValueError, match=r"requester.reconfigure_handles\[1\] .* is also replica zed's"):
                ask(2, "beta", ["", handle("z1")])
            alpha = pool.submit(ask, 1, "alpha", [handle("a0"), ""])
            quorums = [zed.result(JOIN_S), alpha.result(JOIN_S)]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        for q in quorums:
            assert [m.replica_id for m in q.members] == ["alpha", "zed"]
            assert [m.reconfigure_handles for m in q.members] == [(handle("a0"), ""), (handle("z0"), handle("z1"))]
    finally:
        for c in clients:
            c.close()


def participating(lh: LighthouseServer, rid: str) -> bool:
    """Whether ``rid`` has a pending Quorum request at ``lh`` (its status, as an operator sees it)."""
    return any(r["replica_id"] == rid and r["participating"] for r in lh.status()["replicas"])


def wait_for(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + JOIN_S
    while not check():
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(0.02)


class Groups:
    """Our lighthouse and ``n`` of our ManagerServers of ``world_size`` ranks, one client per rank."""

    def __init__(self, lh: LighthouseServer, n: int, world_size: int = 2) -> None:
        self.servers = [ManagerServer(replica_id=f"grp{g}", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                                      bind="127.0.0.1:0", store_addr=f"store{g}:1", world_size=world_size,
                                      heartbeat_interval=timedelta(milliseconds=100), connect_timeout=5.0)
                        for g in range(n)]
        self.clients = [[ManagerClient(s.address(), connect_timeout=5.0) for _ in range(world_size)]
                        for s in self.servers]

    def ask(self, g: int, r: int, step: int, h: str, timeout: float = 10.0) -> Any:
        return self.clients[g][r]._quorum(r, step, "", False, timeout=timeout, reconfigure_handle=h)

    def close(self) -> None:
        for row in self.clients:
            for c in row:
                c.close()
        for s in self.servers:
            s.shutdown()


@pytest.fixture
def groups(lighthouse: Callable[..., LighthouseServer]) -> Iterator[Callable[..., Groups]]:
    made: list[Groups] = []

    def make(n: int, world_size: int = 2, min_replicas: int | None = None) -> Groups:
        g = Groups(lighthouse(min_replicas=min_replicas or n), n, world_size)
        made.append(g)
        return g

    try:
        yield make
    finally:
        for g in made:
            g.close()


def test_each_group_rank_gets_its_ranks_handles_in_replica_order(groups: Callable[..., Groups]) -> None:
    gs = groups(3)
    # grp1 runs torchft 0.2-style process groups (no handles): '' in its place.
    hs = {(g, r): (handle(f"{g}.{r}") if g != 1 else "") for g in range(3) for r in range(2)}
    res = concurrently(*((lambda g=g, r=r: gs.ask(g, r, 1, hs[(g, r)])) for g in range(3) for r in range(2)))
    by = {(g, r): res[2 * g + r] for g in range(3) for r in range(2)}
    for (g, r), x in by.items():
        assert x.replica_ids == ["grp0", "grp1", "grp2"]
        assert x.reconfigure_handles == [handle(f"0.{r}"), "", handle(f"2.{r}")]
        if g != 1:
            assert x.reconfigure_handles.index(hs[(g, r)]) == x.replica_rank == g
    first = by[(0, 0)].quorum_id
    # Same handles next step: the same quorum id (nobody reconfigures) ...
    res2 = concurrently(*((lambda g=g, r=r: gs.ask(g, r, 2, hs[(g, r)])) for g in range(3) for r in range(2)))
    assert {x.quorum_id for x in res2} == {first}
    # ... changed handles (torch's native ones change at every reconfigure) are passed on as
    # they are, and alone do not change the quorum id.
    hs[(2, 0)], hs[(2, 1)] = handle("2.0-new"), handle("2.1-new")
    res3 = concurrently(*((lambda g=g, r=r: gs.ask(g, r, 3, hs[(g, r)])) for g in range(3) for r in range(2)))
    assert {x.quorum_id for x in res3} == {first}
    assert res3[5].reconfigure_handles == [handle("0.1"), "", handle("2.1-new")]


def test_a_bad_or_repeated_rank_handle_is_refused_and_changes_nothing(groups: Callable[..., Groups]) -> None:
    gs = groups(1, min_replicas=1)
    with pytest.raises(ValueError, match="reconfigure_handle is not JSON"):
        gs.ask(0, 0, 1, "not json")
    with pytest.raises(ValueError, match="reconfigure_handle is 4097 bytes; the limit is 4096"):
        gs.ask(0, 0, 1, "x" * 4097)
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        rank0 = pool.submit(gs.ask, 0, 0, 1, handle("r0"))
        # rank 1 claims rank 0's process group: refused, and rank 0's request stays in the round.
        server = gs.servers[0]
        wait_for(lambda: 0 in getattr(server._rounds.get(1), "requests", {}), "rank 0 joined the round")
        with pytest.raises(ValueError, match="reconfigure_handle of group rank 1 is also group rank 0's"):
            gs.ask(0, 1, 1, handle("r0"))
        assert not rank0.done()
        ok = gs.ask(0, 1, 1, handle("r1"))
        assert ok.reconfigure_handles == [handle("r1")]
        assert rank0.result(JOIN_S).reconfigure_handles == [handle("r0")]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
