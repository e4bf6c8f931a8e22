"""Interop with torchft-nightly's native peers (the 0.3 API: reconfigure handles), on loopback.

* torchft-nightly's ManagerServers and ManagerClients against OUR lighthouse: each group
  rank gets its rank's handle of every member, non-empty and in replica order; a handle
  that is not JSON is refused (INVALID_ARGUMENT naming the field) and reaches the ranks;
* a MIXED quorum against our lighthouse: torchft 0.2.0's ManagerServer, torchft-nightly's
  and ours, each gets the same quorum, and the nightly and our ranks their handles
  (``''`` in place of the 0.2.0 group, which sends none);
* OUR ManagerServers against torchft-nightly's LighthouseServer: the handles round-trip.

torchft-nightly installs the same ``torchft`` package as torchft 0.2.0, so its native
module is driven in a subprocess (``nightly_peer.py``), loaded by file from the nightly
folder: ``$RALLYPOINT_TORCHFT_NIGHTLY``, else ``torchft-nightly`` beside the running
venv's (or a layered venv's) ``lib/``. Without that folder these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.manager.client import ManagerClient
from rallypoint.manager.server import ManagerServer

pytestmark = pytest.mark.interop

HERE = Path(__file__).resolve().parent
PEER = HERE / "nightly_peer.py"
PEER_TIMEOUT_S = 60.0
JOIN_S = 30.0


def nightly_folder() -> Path | None:
    """The folder that contains torchft-nightly's ``torchft/`` (see the module docstring)."""
    env = os.environ.get("RALLYPOINT_TORCHFT_NIGHTLY")
    if env:
        return Path(env)
    candidates = [Path(sys.prefix) / "torchft-nightly"]
    for p in sys.path:  # a venv layered over another (site-packages on sys.path): that venv's folder
        path = Path(p)
        if path.name == "site-packages" and path.parent.parent.name == "lib":
            candidates.append(path.parent.parent.parent / "torchft-nightly")
    for c in candidates:
        if any((c / "torchft").glob("_torchft*.so")):
            return c
    return None


NIGHTLY = nightly_folder()
needs_nightly = pytest.mark.skipif(
    NIGHTLY is None or not any((NIGHTLY / "torchft").glob("_torchft*.so")),
    reason="torchft-nightly is not installed: no torchft/_torchft*.so in $RALLYPOINT_TORCHFT_NIGHTLY or in "
           "<venv>/torchft-nightly (the Makefile installs it there with pip --target --no-deps)")


def handle(name: str) -> str:
    """A handle as torchft-nightly's ProcessGroup.get_reconfigure_handle() writes it."""
    return json.dumps({"id": f"pg-{name}", "store": "127.0.0.1:1", "global_rank": None})


def nightly_groups(lighthouse: str, spec: list[dict[str, Any]]) -> subprocess.Popen[str]:
    """Start nightly ManagerServers asking ``lighthouse`` (results: :func:`results`)."""
    return subprocess.Popen([sys.executable, str(PEER), str(NIGHTLY), "groups", lighthouse, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def results(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"nightly peer timed out; stderr tail:\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"nightly peer failed ({proc.returncode}); stderr tail:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def our_lighthouse() -> Iterator[Callable[..., LighthouseServer]]:
    started: list[LighthouseServer] = []

    def make(**kw: Any) -> LighthouseServer:
        kw.setdefault("join_timeout_ms", 30_000)
        lh = LighthouseServer(bind="127.0.0.1:0", **kw)
        started.append(lh)
        return lh

    try:
        yield make
    finally:
        for lh in started:
            lh.shutdown()


class Ours:
    """Our ManagerServer for ``rid`` with one ManagerClient per rank."""

    def __init__(self, lighthouse: str, rid: str, world_size: int) -> None:
        self.server = ManagerServer(replica_id=rid, lighthouse_addr=lighthouse, hostname="127.0.0.1",
                                    bind="127.0.0.1:0", store_addr=f"{rid}:1", world_size=world_size,
                                    heartbeat_interval=timedelta(milliseconds=100), connect_timeout=10.0)
        self.clients = [ManagerClient(self.server.address(), connect_timeout=10.0) for _ in range(world_size)]

    def ask(self, rank: int, step: int, h: str) -> Any:
        return self.clients[rank]._quorum(rank, step, "", False, timeout=JOIN_S, reconfigure_handle=h)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.shutdown()


@needs_nightly
def test_nightly_managers_get_their_handles_from_our_lighthouse(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    lh = our_lighthouse(min_replicas=2)
    spec = [{"replica_id": rid, "world_size": 2, "step": 1, "handles": [handle(f"{rid}{r}") for r in range(2)]}
            for rid in ("nb", "na")]
    out = results(nightly_groups(lh.address(), spec))
    assert not [v for v in out.values() if "error" in v], out
    assert len({v["quorum_id"] for v in out.values()}) == 1
    for key, v in out.items():
        rid, rank = key.split("/")
        assert v["replica_ids"] == ["na", "nb"]
        assert v["reconfigure_handles"] == [handle(f"na{rank}"), handle(f"nb{rank}")]
        # torchft-nightly's Manager takes its process group's rank from its own handle's index
        assert v["reconfigure_handles"].index(handle(f"{rid}{rank}")) == v["replica_rank"]
    members = lh.status()["quorum"]["members"]
    assert [list(m["reconfigure_handles"]) for m in members] == [[handle("na0"), handle("na1")],
                                                                 [handle("nb0"), handle("nb1")]]


@needs_nightly
def test_a_nightly_group_with_a_bad_handle_is_refused(our_lighthouse: Callable[..., LighthouseServer],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """torchft-nightly's ManagerServer checks nothing; our lighthouse refuses a handle that is
    not JSON with INVALID_ARGUMENT naming the field (torchft's server then keeps its ranks
    waiting until their timeout, as it does for any lighthouse error), and forms nothing."""
    lh = our_lighthouse(min_replicas=1)
    with caplog.at_level("WARNING", logger="rallypoint.lighthouse"):
        out = results(nightly_groups(lh.address(), [{"replica_id": "bad", "world_size": 2, "step": 1,
                                                     "handles": ["self", handle("ok")], "timeout_s": 3}]))
    assert set(out) == {"bad/0", "bad/1"}
    assert all("error" in v for v in out.values()), out
    assert any("requester.reconfigure_handles[0] is not JSON: 'self'" in r.getMessage() for r in caplog.records)
    assert lh.status()["quorum"] is None  # nothing formed, nothing changed


@needs_nightly
def test_mixed_quorum_torchft_02_nightly_and_ours(our_lighthouse: Callable[..., LighthouseServer]) -> None:
    from torchft._torchft import ManagerClient as Tf02Client
    from torchft._torchft import ManagerServer as Tf02Server

    lh = our_lighthouse(min_replicas=3)
    ours = Ours(lh.address(), "a-ours", 2)
    tf02 = Tf02Server(replica_id="c-torchft02", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                      bind="127.0.0.1:0", store_addr="127.0.0.1:1", world_size=2,
                      heartbeat_interval=timedelta(milliseconds=100), connect_timeout=timedelta(seconds=10),
                      quorum_retries=0)
    try:
        tf02_clients = [Tf02Client(tf02.address(), connect_timeout=timedelta(seconds=10)) for _ in range(2)]
        nightly = nightly_groups(lh.address(), [{"replica_id": "b-nightly", "world_size": 2, "step": 1,
                                                 "handles": [handle("b0"), handle("b1")]}])
        try:
            with ThreadPoolExecutor(max_workers=4) as pool:
                mine = [pool.submit(ours.ask, r, 1, handle(f"a{r}")) for r in range(2)]
                theirs = [pool.submit(c._quorum, group_rank=r, step=1, checkpoint_metadata="", shrink_only=False,
                                      timeout=timedelta(seconds=JOIN_S), commit_failures=0, init_sync=True)
                          for r, c in enumerate(tf02_clients)]
                got_ours = [f.result(JOIN_S + 5) for f in mine]
                got_tf02 = [f.result(JOIN_S + 5) for f in theirs]
            got_nightly = results(nightly)
        finally:
            if nightly.poll() is None:
                nightly.kill()
                nightly.communicate(timeout=10)
    finally:
        ours.close()
        tf02.shutdown()
    ids = ["a-ours", "b-nightly", "c-torchft02"]
    assert not [v for v in got_nightly.values() if "error" in v], got_nightly
    qid = got_ours[0].quorum_id
    for r in range(2):
        expected = [handle(f"a{r}"), handle(f"b{r}"), ""]  # torchft 0.2.0's group sends none
        assert got_ours[r].replica_ids == ids and got_ours[r].reconfigure_handles == expected
        assert got_ours[r].quorum_id == qid and got_ours[r].replica_rank == 0
        n = got_nightly[f"b-nightly/{r}"]
        assert n["replica_ids"] == ids and n["reconfigure_handles"] == expected
        assert n["quorum_id"] == qid and n["replica_rank"] == 1
        assert list(got_tf02[r].replica_ids) == ids and got_tf02[r].quorum_id == qid
        assert got_tf02[r].replica_rank == 2


@pytest.fixture
def nightly_lighthouse() -> Iterator[str]:
    """torchft-nightly's LighthouseServer (min_replicas=2) in a subprocess; yields its address."""
    proc = subprocess.Popen([sys.executable, str(PEER), str(NIGHTLY), "lighthouse", "2"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the peer prints its address at once (or dies: EOF)
        assert line, "nightly lighthouse did not start"
        yield json.loads(line)["address"]
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@needs_nightly
def test_our_managers_against_the_nightly_lighthouse(nightly_lighthouse: str) -> None:
    groups = [Ours(nightly_lighthouse, rid, 2) for rid in ("y", "x")]
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futs = {(g.server.replica_id, r): pool.submit(g.ask, r, 1, handle(f"{g.server.replica_id}{r}"))
                    for g in groups for r in range(2)}
            got = {k: f.result(JOIN_S + 5) for k, f in futs.items()}
    finally:
        for g in groups:
            g.close()
    for (rid, r), res in got.items():
        assert res.replica_ids == ["x", "y"]
        assert res.reconfigure_handles == [handle(f"x{r}"), handle(f"y{r}")]
        assert res.reconfigure_handles.index(handle(f"{rid}{r}")) == res.replica_rank


@needs_nightly
def test_raw_wire_every_member_field_round_trips_through_the_nightly_lighthouse(nightly_lighthouse: str) -> None:
    """Our stubs, sent with plain grpc to torchft-nightly's lighthouse, come back field for
    field: field 9 (reconfigure_handles) has the number and type torchft 0.3 gives it."""
    import grpc
    from google.protobuf.unknown_fields import UnknownFieldSet

    from rallypoint._proto import torchft_pb2 as pb

    members = [pb.QuorumMember(replica_id=f"wire-{i}", address=f"http://wire{i}:1", store_address=f"wire{i}:2",
                               step=12, world_size=2, shrink_only=False, data=json.dumps({"i": i}),
                               commit_failures=1, reconfigure_handles=[handle(f"w{i}0"), handle(f"w{i}1")])
               for i in range(2)]
    assert len(members[0].ListFields()) == len(pb.QuorumMember.DESCRIPTOR.fields) - 1  # all but shrink_only=False
    with grpc.insecure_channel(nightly_lighthouse.removeprefix("http://")) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        call = channel.unary_unary("/torchft.LighthouseService/Quorum",
                                   request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
                                   response_deserializer=pb.LighthouseQuorumResponse.FromString)
        with ThreadPoolExecutor(max_workers=2) as pool:
            resps = list(pool.map(lambda m: call(pb.LighthouseQuorumRequest(requester=m), timeout=JOIN_S), members))
    for resp in resps:
        assert list(resp.quorum.participants) == members
        for msg in (resp, resp.quorum, *resp.quorum.participants):
            assert len(UnknownFieldSet(msg)) == 0, type(msg).__name__
