"""No forged commit from inside the job (issue 13, item 4): the job token says a caller
belongs to the job, the rank key says which rank it is. Once a rank has spoken, another
caller (even with the token; a torchft client sends no key) cannot vote for it, and a
``Quorum`` from another caller cannot rewrite the checkpoint address healing peers are
sent to. Refusals are PERMISSION_DENIED naming the rank, and change nothing."""

from __future__ import annotations

import concurrent.futures as cf
from datetime import timedelta

import grpc
import pytest

from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.manager._votes import RANK_KEY_HEADER, claim_rank
from rallypoint.manager.client import ManagerClient
from rallypoint.manager.server import ManagerServer

TOKEN = "rank-identity-token"
TEN = timedelta(seconds=10)


@pytest.mark.parametrize("bound, rank, key, refused", [
    ({}, 1, None, None),  # torchft's client, nothing bound: torchft's rules
    ({}, 1, "k1", None),  # first key binds
    ({1: "k1"}, 1, "k1", None),  # the holder again
    ({1: "k1"}, 0, "k1", None),  # one process may hold several ranks (threads of one client)
    ({1: "k1"}, 1, "k2", "held by another process"),
    ({1: "k1"}, 1, None, "a caller without it may not speak"),
    ({}, 1, "x" * 129, "1..128 characters"),
    ({}, 1, "", "1..128 characters"),
])
def test_claim_rank(bound: dict, rank: int, key: str | None, refused: str | None) -> None:
    why = claim_rank(bound, rank, key)
    assert (why is None) if refused is None else (why is not None and refused in why), why


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch):
    """A lighthouse and the ManagerServer of a two-rank group, both with the job token,
    and one client per rank (each its own rank key), as two processes would have."""
    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    server = ManagerServer(replica_id="g", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                           store_addr="127.0.0.1:29500", world_size=2, connect_timeout=TEN, on_kill=lambda _m: None)
    ranks = [ManagerClient(server.address(), connect_timeout=TEN) for _ in range(2)]
    try:
        yield server, ranks
    finally:
        for c in ranks:
            c.close()
        server.shutdown()
        lh.shutdown()


def _both(pool: cf.ThreadPoolExecutor, f0, f1) -> tuple:
    a, b = pool.submit(f0), pool.submit(f1)
    return a.result(20), b.result(20)


def _quorum_both(pool: cf.ThreadPoolExecutor, ranks: list[ManagerClient], step: int) -> None:
    _both(pool, lambda: ranks[0]._quorum(0, step, "http://rank0:1", False, TEN),
          lambda: ranks[1]._quorum(1, step, "http://rank1:1", False, TEN))


def test_a_token_holder_cannot_vote_for_another_rank(group) -> None:
    server, ranks = group
    with cf.ThreadPoolExecutor(2) as pool:
        _quorum_both(pool, ranks, 0)
        assert _both(pool, lambda: ranks[0].should_commit(0, 0, True, TEN),
                     lambda: ranks[1].should_commit(1, 0, True, TEN)) == (True, True)
        # Step 1: rank 1 failed and will vote False. A forger with the job token (its own
        # client, so another rank key) votes True for rank 1 first, then a torchft-style
        # caller without a key tries the same.
        with ManagerClient(server.address(), connect_timeout=TEN) as forger:
            with pytest.raises(PermissionError, match="group rank 1 is held by another process"):
                forger.should_commit(1, 1, True, TEN)
        channel = grpc.insecure_channel(server.address().split("://")[1])
        vote = channel.unary_unary("/torchft.ManagerService/ShouldCommit",
                                   request_serializer=pb.ShouldCommitRequest.SerializeToString,
                                   response_deserializer=pb.ShouldCommitResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            vote(pb.ShouldCommitRequest(group_rank=1, step=1, should_commit=True), timeout=5,
                 metadata=[("authorization", f"Bearer {TOKEN}")])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "group rank 1" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a forged key is no better
            vote(pb.ShouldCommitRequest(group_rank=1, step=1, should_commit=True), timeout=5,
                 metadata=[("authorization", f"Bearer {TOKEN}"), (RANK_KEY_HEADER, "guess")])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        channel.close()
        assert 1 not in server._commits, "the refused votes left no round behind"
        # The real votes decide: rank 1's False wins.
        assert _both(pool, lambda: ranks[0].should_commit(0, 1, True, TEN),
                     lambda: ranks[1].should_commit(1, 1, False, TEN)) == (False, False)


def test_a_quorum_call_cannot_rewrite_another_ranks_checkpoint_address(group) -> None:
    server, ranks = group
    with cf.ThreadPoolExecutor(2) as pool:
        _quorum_both(pool, ranks, 0)
    with ManagerClient(server.address(), connect_timeout=TEN) as reader:
        assert reader._checkpoint_metadata(1, TEN) == "http://rank1:1"
        with ManagerClient(server.address(), connect_timeout=TEN) as forger:
            with pytest.raises(PermissionError, match="group rank 1"):
                forger._quorum(1, 0, "http://evil:1", False, timedelta(seconds=2))
            with pytest.raises(PermissionError, match="group rank 0"):
                forger._quorum(0, 0, "http://evil:1", False, timedelta(seconds=2))
        assert reader._checkpoint_metadata(1, TEN) == "http://rank1:1"
        assert reader._checkpoint_metadata(0, TEN) == "http://rank0:1"
    assert not server._rounds, "the refused requests opened no quorum round"


def test_rank_zero_in_process_is_bound_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Group rank 0 calls its own server in process (LocalManagerClient); a remote caller
    claiming rank 0 afterwards is refused."""
    from rallypoint.manager._local import LocalManagerClient

    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    server = ManagerServer(replica_id="solo", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                           store_addr="127.0.0.1:29500", world_size=1, connect_timeout=TEN, on_kill=lambda _m: None)
    try:
        local = LocalManagerClient(server)
        assert local._quorum(0, 0, "http://me:1", False, TEN).replica_ids == ["solo"]
        assert local.should_commit(0, 0, True, TEN) is True
        with ManagerClient(server.address(), connect_timeout=TEN) as forger:
            with pytest.raises(PermissionError, match="group rank 0"):
                forger.should_commit(0, 1, False, TEN)
        assert local.should_commit(0, 1, True, TEN) is True
    finally:
        server.shutdown()
        lh.shutdown()


@pytest.mark.parametrize("metadata", ["file:///etc/passwd", "gopher://x:1", "x" * 5000, ""])
def test_the_receiver_fetches_only_from_an_http_source(metadata: str) -> None:
    """What a source's manager hands out as its checkpoint address must be an http(s) URL
    of bounded size, or nothing is fetched."""
    from rallypoint.transports import HTTPTransport
    from rallypoint.transports._http_util import TransferError

    receiver = HTTPTransport(bind="127.0.0.1:0")
    try:
        with pytest.raises(TransferError, match="is not an http\\(s\\) URL"):
            receiver.recv_checkpoint(0, metadata, 3, timedelta(seconds=2))
    finally:
        receiver.shutdown()
