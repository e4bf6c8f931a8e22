"""Oversized fields are refused before use and before fan-out (issue 13, part 1): the
lighthouse and the managers share one table of limits (``rallypoint._net.limits``).
Each refusal is INVALID_ARGUMENT naming the field, and nothing changes."""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest

from conftest import wait_until, watched_leaver
from rallypoint._net.limits import MAX_REASON_BYTES, clip, utf8_len
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LivenessStream
from rallypoint.manager.server import ManagerServer

TEN = timedelta(seconds=10)
BIG = "x" * (200 * 1024)  # far over the 1 KiB reason limit, under the server's receive limit


@pytest.mark.parametrize("value, limit, expected", [
    ("short", 10, "short"),
    ("x" * 10, 10, "x" * 10),
    ("é" * 20, 30, None),  # cut on a character boundary
])
def test_clip(value: str, limit: int, expected: str | None) -> None:
    out = clip(value, limit)
    assert utf8_len(out) <= limit
    if expected is not None:
        assert out == expected
    else:
        assert out.endswith("…(cut)") and out.startswith("é")


def test_a_huge_goodbye_reason_reaches_peers_bounded(lighthouse) -> None:
    """One client says goodbye with a 200 KiB reason: the PeerDown the lighthouse fans out
    carries at most 1 KiB of it, and the other replicas' streams stay up. (A 5 MiB one,
    which once broke every stream, no longer even arrives: the server's receive limit is
    sized to the largest legal request.)"""
    lh = lighthouse(min_replicas=1)
    with watched_leaver(lh.local_address()) as (leaver, seen):
        leaver.close(BIG)
        wait_until(lambda: seen, 5.0, what="PeerDown for leaver")
        rid, why = seen[0]
        assert rid == "leaver" and utf8_len(why) <= MAX_REASON_BYTES + 64 and "(cut)" in why
        row = next(r for r in lh.status()["replicas"] if r["replica_id"] == "watcher")
        assert row["attached"] and not row["dead"], row


def _lh_stub(address: str):
    channel = grpc.insecure_channel(address.replace("http://", ""))
    kill = channel.unary_unary("/rallypoint.RallypointLighthouse/KillReplica",
                               request_serializer=rpb.KillReplicaRequest.SerializeToString,
                               response_deserializer=rpb.KillReplicaResponse.FromString)
    return channel, kill


def test_lighthouse_refuses_an_oversized_kill_reason(lighthouse) -> None:
    lh = lighthouse(min_replicas=1)
    channel, kill = _lh_stub(lh.local_address())
    try:
        with pytest.raises(grpc.RpcError) as e:
            kill(rpb.KillReplicaRequest(replica_id="anyone", reason="r" * (MAX_REASON_BYTES + 1)), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "reason is" in e.value.details() and str(MAX_REASON_BYTES) in e.value.details()
    finally:
        channel.close()
    assert not [ev for ev in lh.core.store.events(limit=100) if ev.kind == "kill"]


@pytest.fixture
def manager_server(lighthouse):
    lh = lighthouse(min_replicas=1)
    kills: list[str] = []
    server = ManagerServer(replica_id="target", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                           bind="127.0.0.1:0", store_addr="127.0.0.1:29500", world_size=2,
                           connect_timeout=TEN, on_kill=kills.append)
    channel = grpc.insecure_channel(server.address().replace("http://", ""))
    try:
        yield server, channel, kills
    finally:
        channel.close()
        server.shutdown()


def test_manager_refuses_an_oversized_kill_message(manager_server) -> None:
    _server, channel, kills = manager_server
    kill = channel.unary_unary("/torchft.ManagerService/Kill", request_serializer=pb.KillRequest.SerializeToString,
                               response_deserializer=pb.KillResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        kill(pb.KillRequest(msg=BIG[: 2 * MAX_REASON_BYTES]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "msg is" in e.value.details()
    assert kills == []


def test_manager_refuses_oversized_checkpoint_metadata(manager_server) -> None:
    """A Quorum request whose checkpoint address is 8 KiB is refused and stores nothing:
    CheckpointMetadata for that rank still says it is unknown."""
    _server, channel, _ = manager_server
    quorum = channel.unary_unary("/torchft.ManagerService/Quorum",
                                 request_serializer=pb.ManagerQuorumRequest.SerializeToString,
                                 response_deserializer=pb.ManagerQuorumResponse.FromString)
    meta = channel.unary_unary("/torchft.ManagerService/CheckpointMetadata",
                               request_serializer=pb.CheckpointMetadataRequest.SerializeToString,
                               response_deserializer=pb.CheckpointMetadataResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        quorum(pb.ManagerQuorumRequest(group_rank=1, step=0, checkpoint_metadata="h" * 8192), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checkpoint_metadata is" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        meta(pb.CheckpointMetadataRequest(rank=1), timeout=5)
    assert e.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), e.value


def test_outbox_is_bounded() -> None:
    """Notices for a stream that is not read stop at OUTBOX_LIMIT and mark it for dropping."""
    import asyncio

    from rallypoint.lighthouse.core import OUTBOX_LIMIT, _Attachment

    async def fill() -> _Attachment:
        att = _Attachment("slow", "")
        for i in range(OUTBOX_LIMIT + 500):
            att.push(i)
        return att

    att = asyncio.run(fill())
    assert att.outbox.qsize() == OUTBOX_LIMIT and att.overflow.is_set()


def test_an_overflowing_stream_is_dropped(lighthouse) -> None:
    """When a replica's notices overflow, the lighthouse ends its stream (recorded as a
    crash with the reason) instead of buffering; the other replicas are unaffected."""
    lh = lighthouse(min_replicas=1)
    watcher = LivenessStream(lh.local_address(), "watcher")
    slow = LivenessStream(lh.local_address(), "slow", reconnect_backoff=(30.0, 30.0))
    try:
        assert watcher.start(5.0) and slow.start(5.0)
        att = lh.core._attached["slow"]
        lh._loop.call_soon_threadsafe(att.overflow.set)
        wait_until(lambda: any(e.kind == "crash" and "unread" in e.detail.get("reason", "")
                               for e in lh.core.store.events(limit=100, replica_id="slow")), 5.0,
                   what="the overflowing stream dropped")
        row = next(r for r in lh.status()["replicas"] if r["replica_id"] == "watcher")
        assert row["attached"] and not row["dead"], row
    finally:
        slow.close()
        watcher.close()


#: Bytes that are not a protobuf message of any type: an invalid wire type, a truncated
#: varint, a length running past the end, a group that never ends.
MALFORMED = [b"\xff\xff\xff\xff", b"\x08", b"\x0a\x05ab", b"\x0b", b"\x0a\xff\xff\xff\xff\x0f"]
LIGHTHOUSE_METHODS = ["/torchft.LighthouseService/Quorum", "/torchft.LighthouseService/Heartbeat",
                      "/rallypoint.RallypointLighthouse/Status", "/rallypoint.RallypointLighthouse/KillReplica"]
MANAGER_METHODS = ["/torchft.ManagerService/Quorum", "/torchft.ManagerService/CheckpointMetadata",
                   "/torchft.ManagerService/ShouldCommit", "/torchft.ManagerService/Kill"]


def _raw_calls(channel: grpc.Channel, methods: list[str]) -> None:
    for method in methods:
        call = channel.unary_unary(method)  # bytes in, bytes out
        for payload in MALFORMED:
            with pytest.raises(grpc.RpcError) as e:
                call(payload, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, e.value)
            assert "is not a valid" in e.value.details(), (method, payload, e.value.details())


def test_malformed_bytes_are_invalid_argument_at_the_lighthouse(lighthouse) -> None:
    lh = lighthouse(min_replicas=1)
    channel = grpc.insecure_channel(lh.local_address().replace("http://", ""))
    try:
        _raw_calls(channel, LIGHTHOUSE_METHODS)
    finally:
        channel.close()
    assert lh.status()["replicas"] == []  # nothing was recorded


def test_malformed_bytes_are_invalid_argument_at_a_manager(manager_server) -> None:
    _server, channel, kills = manager_server
    _raw_calls(channel, MANAGER_METHODS)
    assert kills == []


def test_deeply_nested_data_is_invalid_argument(lighthouse) -> None:
    lh = lighthouse(min_replicas=1)
    channel = grpc.insecure_channel(lh.local_address().replace("http://", ""))
    quorum = channel.unary_unary("/torchft.LighthouseService/Quorum",
                                 request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
                                 response_deserializer=pb.LighthouseQuorumResponse.FromString)
    deep = "[" * 30_000 + "]" * 30_000  # valid JSON within the 64 KiB limit, too deep to parse
    try:
        with pytest.raises(grpc.RpcError) as e:
            quorum(pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="deep", data=deep)), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requester.data" in e.value.details()
    finally:
        channel.close()


@pytest.mark.parametrize("payload", MALFORMED)
def test_malformed_bytes_on_the_attach_stream_are_invalid_argument(lighthouse, payload: bytes) -> None:
    """Garbage as the first message, and garbage after a valid hello: each ends only that
    caller's stream, with INVALID_ARGUMENT; another replica's stream stays up."""
    lh = lighthouse(min_replicas=1)
    channel = grpc.insecure_channel(lh.local_address().replace("http://", ""))
    attach = channel.stream_stream("/rallypoint.RallypointLighthouse/Attach")  # bytes in, bytes out
    hello = rpb.AttachRequest(hello=rpb.AttachHello(replica_id="garbler")).SerializeToString()
    try:
        with watched_leaver(lh.local_address()) as (_leaver, _seen):
            for messages in ([payload], [hello, payload]):
                with pytest.raises(grpc.RpcError) as e:
                    list(attach(iter(messages), timeout=5))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (messages, e.value)
                assert "not a valid rallypoint.AttachRequest" in e.value.details()
            rows = {r["replica_id"]: r for r in lh.status()["replicas"]}
            assert rows["watcher"]["attached"] and not rows["watcher"]["dead"], rows
    finally:
        channel.close()
