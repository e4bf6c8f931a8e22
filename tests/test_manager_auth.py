"""The job token guards the manager side too (issue 13, part 1): every ManagerService
method of a ManagerServer and the checkpoint server a Manager builds require it once it
is configured (``RALLYPOINT_TOKEN`` or the ``token`` argument), and every client
rallypoint builds sends it. An attacker without it is refused and changes nothing; an
empty token is an error, never "auth off"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from rallypoint._net.auth import bearer_matches, job_token
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.manager.client import ManagerClient
from rallypoint.manager.server import ManagerServer
from rallypoint.transports.http import HTTPTransport

TOKEN = "s3cret-job-token"
TEN = timedelta(seconds=10)


@pytest.mark.parametrize("explicit, environ, expected", [
    (None, {}, None),
    (None, {"RALLYPOINT_TOKEN": "abc"}, "abc"),
    ("xyz", {"RALLYPOINT_TOKEN": "abc"}, "xyz"),
])
def test_job_token(explicit, environ, expected) -> None:
    assert job_token(explicit, environ) == expected


@pytest.mark.parametrize("explicit, environ, message", [
    ("", {}, "the token is empty"),
    (None, {"RALLYPOINT_TOKEN": ""}, "RALLYPOINT_TOKEN is empty"),
    ("  ", {}, "empty"),
    ("a\nb", {}, "one line"),
    ("x" * 5000, {}, "longer than"),
])
def test_unusable_tokens_are_errors(explicit, environ, message) -> None:
    with pytest.raises(ValueError, match=message):
        job_token(explicit, environ)


@pytest.mark.parametrize("header, ok", [
    (f"Bearer {TOKEN}", True), (f"bearer  {TOKEN} ", True), (f"Bearer {TOKEN}".encode(), True),
    (None, False), ("", False), (TOKEN, False), ("Bearer", False), ("Bearer wrong", False),
    (f"Basic {TOKEN}", False), (f"Bearer {TOKEN}x", False),
])
def test_bearer_matches(header, ok) -> None:
    """The one check every server makes (the lighthouse's gRPC and HTTP, the managers',
    the checkpoint server's)."""
    assert bearer_matches(header, TOKEN) is ok


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch):
    """A lighthouse and a ManagerServer (group of 2, so votes wait) with the job token
    from RALLYPOINT_TOKEN; Kill is recorded instead of ending the process."""
    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    kills: list[str] = []
    server = ManagerServer(replica_id="victim", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                           bind="127.0.0.1:0", store_addr="127.0.0.1:29500", world_size=2,
                           connect_timeout=TEN, on_kill=kills.append)
    try:
        yield server, kills
    finally:
        server.shutdown()
        lh.shutdown()


def _stub(address: str):
    channel = grpc.insecure_channel(address.replace("http://", ""))
    return channel, {
        "Kill": channel.unary_unary("/torchft.ManagerService/Kill", request_serializer=pb.KillRequest.SerializeToString,
                                    response_deserializer=pb.KillResponse.FromString),
        "ShouldCommit": channel.unary_unary("/torchft.ManagerService/ShouldCommit",
                                            request_serializer=pb.ShouldCommitRequest.SerializeToString,
                                            response_deserializer=pb.ShouldCommitResponse.FromString),
        "Quorum": channel.unary_unary("/torchft.ManagerService/Quorum",
                                      request_serializer=pb.ManagerQuorumRequest.SerializeToString,
                                      response_deserializer=pb.ManagerQuorumResponse.FromString),
        "CheckpointMetadata": channel.unary_unary("/torchft.ManagerService/CheckpointMetadata",
                                                  request_serializer=pb.CheckpointMetadataRequest.SerializeToString,
                                                  response_deserializer=pb.CheckpointMetadataResponse.FromString),
    }


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]],
                         ids=["no token", "wrong token", "no Bearer"])
def test_every_manager_method_refuses_a_caller_without_the_token(guarded, metadata) -> None:
    server, kills = guarded
    channel, stub = _stub(server.address())
    requests = {
        "Kill": pb.KillRequest(msg="attacker"),
        "ShouldCommit": pb.ShouldCommitRequest(group_rank=1, step=0, should_commit=True),
        "Quorum": pb.ManagerQuorumRequest(group_rank=1, step=0, checkpoint_metadata="http://evil/"),
        "CheckpointMetadata": pb.CheckpointMetadataRequest(rank=0),
    }
    try:
        for name, req in requests.items():
            with pytest.raises(grpc.RpcError) as e:
                stub[name](req, timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, e.value)
            assert "bearer token" in e.value.details()
    finally:
        channel.close()
    assert kills == []  # nothing reached the handlers
    # The forged True vote for rank 1 was not recorded: rank 0's False and a real rank
    # 1 vote decide, and the step does not commit.
    with ManagerClient(server.address(), connect_timeout=TEN) as c:  # sends RALLYPOINT_TOKEN
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(2) as pool:
            f0 = pool.submit(c.should_commit, 0, 0, False, 10)
            f1 = pool.submit(c.should_commit, 1, 0, True, 10)
            assert (f0.result(15), f1.result(15)) == (False, False)


def test_the_token_holder_is_served(guarded) -> None:
    server, kills = guarded
    with ManagerClient(server.address(), connect_timeout=TEN) as c:
        c.kill("maintenance")
    assert kills == ["maintenance"]
    with ManagerClient(server.address(), connect_timeout=TEN, token="wrong") as c:
        with pytest.raises(PermissionError, match="refused"):
            c.kill("nope")
    assert kills == ["maintenance"]


def test_default_checkpoint_server_requires_the_job_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTPTransport a Manager builds by default reads RALLYPOINT_TOKEN: the state it
    serves during a heal is refused to a caller without it, and a peer with it heals."""
    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    sender = HTTPTransport(timeout=TEN, bind="127.0.0.1:0")
    receiver = HTTPTransport(timeout=TEN, bind="127.0.0.1:0")
    try:
        state = {"w": torch.arange(6.0)}
        sender.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=TEN)
        base = sender.metadata()
        r = httpx.get(f"{base}/checkpoint/3/full", timeout=5)
        assert r.status_code == 401
        assert TOKEN not in r.text
        assert httpx.get(f"{base}/checkpoint/3/header", timeout=5,
                         headers={"authorization": "Bearer wrong"}).status_code == 401
        got = receiver.recv_checkpoint(src_rank=0, metadata=base, step=3, timeout=TEN)
        assert torch.equal(got["w"], state["w"])
    finally:
        sender.shutdown(wait=False)
        receiver.shutdown(wait=False)


def test_empty_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RALLYPOINT_TOKEN", "")
    with pytest.raises(ValueError, match="RALLYPOINT_TOKEN is empty"):
        LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    with pytest.raises(ValueError, match="RALLYPOINT_TOKEN is empty"):
        HTTPTransport(timeout=TEN, bind="127.0.0.1:0")
    env = {**os.environ, "RALLYPOINT_TOKEN": ""}
    p = subprocess.run([sys.executable, "-m", "rallypoint", "lighthouse", "--min-replicas", "1", "--bind",
                        "127.0.0.1:0", "--http-bind", "off", "--state", ":memory:"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "RALLYPOINT_TOKEN is empty" in p.stderr, p.stderr


TRAIN = textwrap.dedent(
    """
    import json, logging, sys
    from datetime import timedelta
    import torch
    from torch import nn
    import rallypoint as torchft

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    name, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(seed)  # different initial weights: the step-0 heal must copy them
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
                              load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                              replica_id=name, hostname="127.0.0.1", timeout=timedelta(seconds=20),
                              quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=20))
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.OptimizerWrapper(manager, opt)
    while manager.current_step() < 3:
        optimizer.zero_grad()
        ddp(torch.ones(4, 3) * (seed + 1)).sum().backward()
        optimizer.step()
    json.dump({"step": manager.current_step(), "w": model.weight.tolist()}, open(out, "w"))
    manager.shutdown()
    """
)


def test_two_groups_train_and_heal_with_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replica groups (plain python processes) with RALLYPOINT_TOKEN set, against a
    lighthouse with the same token: the quorum, the step-0 heal (manager metadata and the
    checkpoint server) and the commits all pass the token; both end identical."""
    monkeypatch.setenv("RALLYPOINT_TOKEN", TOKEN)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["TORCHFT_LIGHTHOUSE"] = lh.address()
    procs = [subprocess.Popen([sys.executable, str(script), f"g{i}", str(i), str(tmp_path / f"g{i}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lh.shutdown()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    a, b = (json.loads((tmp_path / f"g{i}.json").read_text()) for i in range(2))
    assert a["step"] == b["step"] == 3
    assert a["w"] == b["w"]
    assert any("healing to step 0" in err for _, err in outs)


class _Foreign:
    """A transport that is not rallypoint's (defined in this test module)."""

    def __init__(self, metadata: str) -> None:
        self._metadata = metadata

    def metadata(self) -> str:
        return self._metadata


@pytest.mark.parametrize("transport, metadata, token, warns", [
    (_Foreign("http://host:1/checkpoint"), "http://host:1/checkpoint", "tok", True),
    (_Foreign("https://host:1"), "https://host:1", "tok", True),
    (_Foreign("http://host:1"), "http://host:1", None, False),  # no token: nothing is guarded anyway
    (_Foreign("<n/a>"), "<n/a>", "tok", False),  # over the process group: no server of its own
    (HTTPTransport.__new__(HTTPTransport), "http://host:1", "tok", False),  # ours checks the token
])
def test_unguarded_transport(transport: object, metadata: str, token: str | None, warns: bool) -> None:
    from rallypoint.manager._heal import unguarded_transport

    said = unguarded_transport(transport, metadata, token)
    assert (said is not None) == warns
    if warns:
        assert said is not None and "_Foreign" in said and metadata in said and "token" in said


def test_torchfts_http_transport_with_a_job_token_is_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """torchft 0.2.0's HTTPTransport given to a replica whose job has a token: it is used,
    and the log says that its server is open to anyone (it takes no token)."""
    import logging

    tf_http = pytest.importorskip("torchft.checkpointing.http_transport")
    from rallypoint.manager._heal import warn_if_unguarded

    monkeypatch.setenv("RALLYPOINT_TOKEN", "tok")
    theirs = tf_http.HTTPTransport(timeout=TEN, num_chunks=0)
    try:
        with caplog.at_level(logging.WARNING, logger="test.heal"):
            warn_if_unguarded(theirs, logging.getLogger("test.heal"))
        assert "torchft.checkpointing.http_transport.HTTPTransport is not rallypoint's" in caplog.text
        assert theirs.metadata() in caplog.text
        caplog.clear()
        ours = HTTPTransport(bind="127.0.0.1:0")
        try:
            with caplog.at_level(logging.WARNING, logger="test.heal"):
                warn_if_unguarded(ours, logging.getLogger("test.heal"))
            assert caplog.text == ""
        finally:
            ours.shutdown()
    finally:
        theirs.shutdown()
