"""The commit vote over group rank 0's vote socket (``rallypoint/manager/_vote_socket.py``).

What a user relies on: after the first vote over gRPC, ranks > 0 vote over the socket and
get the same decisions; the job token guards it (a wrong proof is refused and nothing
counts) and never travels; bad frames are refused and change nothing; a socket that fails
falls back to gRPC; a client that gives up withdraws its vote; one rank's claim holds; the
switch turns it off; torchft's clients never see it. Plus table tests of the wire's pure
parts.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from conftest import wait_until
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.manager import _vote_socket as vs
from rallypoint.manager.client import ManagerClient
from rallypoint.manager.server import ManagerServer

CONNECT = 5.0
TOKEN = "vote-socket-test-token"


# ------------------------------------------------------------------------ the wire, as tables
@pytest.mark.parametrize("obj,error", [
    ({"rank": 1, "step": 7, "vote": True, "timeout_s": 5}, None),
    ({"rank": 1, "step": 7, "vote": False, "timeout_s": 0.5, "meta": [["a", "b"]]}, None),
    ({"rank": -1, "step": 7, "vote": True, "timeout_s": 5}, "'rank'"),
    ({"rank": True, "step": 7, "vote": True, "timeout_s": 5}, "'rank'"),
    ({"rank": 1, "step": "7", "vote": True, "timeout_s": 5}, "'step'"),
    ({"rank": 1, "step": 2**63, "vote": True, "timeout_s": 5}, "'step'"),
    ({"rank": 1, "step": 7, "vote": 1, "timeout_s": 5}, "'vote'"),
    ({"rank": 1, "step": 7, "vote": True, "timeout_s": 0}, "'timeout_s'"),
    ({"rank": 1, "step": 7, "vote": True, "timeout_s": 1e9}, "'timeout_s'"),
    ({"rank": 1, "step": 7, "vote": True, "timeout_s": 5, "meta": [["a"]]}, "'meta'"),
    ({"rank": 1, "step": 7, "vote": True, "timeout_s": 5, "meta": [["a", 1]]}, "'meta'"),
    ({"rank": 1, "step": 7, "vote": True, "timeout_s": 5, "meta": [["k", "v"]] * 9}, "'meta'"),
    ([1, 2], "JSON object"),
])
def test_parse_request(obj: Any, error: str | None) -> None:
    body = json.dumps(obj).encode()
    if error is None:
        req = vs.parse_request(body)
        assert (req.rank, req.step, req.vote) == (obj["rank"], obj["step"], obj["vote"])
        assert req.meta == dict(tuple(p) for p in obj.get("meta", []))
    else:
        with pytest.raises(ValueError, match=error):
            vs.parse_request(body)


def test_parse_request_refuses_bytes_that_are_not_json() -> None:
    with pytest.raises(ValueError, match="JSON"):
        vs.parse_request(b"\xff\xfe not json")


@pytest.mark.parametrize("obj,want", [
    ({"decision": True, "trailing": [["k", "v"]]}, vs.VoteAnswer(True, (("k", "v"),))),
    ({"decision": False}, vs.VoteAnswer(False, ())),
    ({"code": "PERMISSION_DENIED", "message": "no"}, vs.VoteAnswer(None, (), "PERMISSION_DENIED", "no")),
    ({"decision": "yes"}, ValueError),
    ({"decision": True, "trailing": [["k"]]}, ValueError),
    ({"code": 3, "message": "x"}, ValueError),
])
def test_parse_answer(obj: Any, want: Any) -> None:
    body = json.dumps(obj).encode()
    if want is ValueError:
        with pytest.raises(ValueError):
            vs.parse_answer(body)
    else:
        assert vs.parse_answer(body) == want


@pytest.mark.parametrize("n,ok", [(1, True), (vs.MAX_FRAME_BYTES, True), (0, False), (vs.MAX_FRAME_BYTES + 1, False),
                                  (2**32 - 1, False)])
def test_frame_length_is_checked_before_the_body_is_read(n: int, ok: bool) -> None:
    prefix = struct.pack("!I", n)
    if ok:
        assert vs.frame_length(prefix) == n
    else:
        with pytest.raises(ValueError, match="announces"):
            vs.frame_length(prefix)


def test_encode_frame_refuses_an_oversized_frame() -> None:
    with pytest.raises(ValueError, match="limit"):
        vs.encode_frame({"x": "y" * vs.MAX_FRAME_BYTES})


_ID = bytes(range(vs.INSTANCE_BYTES))


@pytest.mark.parametrize("trailing,want", [
    ([(vs.PORT_KEY, vs.advertise(4242, _ID))], (4242, _ID)),
    ([(vs.PORT_KEY, vs.advertise(4242, _ID).encode())], (4242, _ID)),
    ([], None), (None, None), ([("other", vs.advertise(4242, _ID))], None),
    ([(vs.PORT_KEY, "4242")], None),  # no instance id
    ([(vs.PORT_KEY, "4242/" + "ab" * 8)], None),  # too short an id
    ([(vs.PORT_KEY, "4242/" + "zz" * 16)], None),  # not hex
    ([(vs.PORT_KEY, "0/" + "ab" * 16)], None), ([(vs.PORT_KEY, "65536/" + "ab" * 16)], None),
    ([(vs.PORT_KEY, "-1/" + "ab" * 16)], None), ([(vs.PORT_KEY, "12a/" + "ab" * 16)], None),
    ([(vs.PORT_KEY, "1" * 50 + "/" + "ab" * 16)], None), ([(vs.PORT_KEY, "1" * 5000)], None),
])
def test_advertised(trailing: Any, want: tuple[int, bytes] | None) -> None:
    assert vs.advertised(trailing) == want


def test_proof_binds_the_nonce_and_the_token() -> None:
    nonce = bytes(range(32))
    p = vs.proof(TOKEN, nonce)
    assert len(p) == vs.PROOF_BYTES and TOKEN.encode() not in p
    assert vs.proof_ok(TOKEN, nonce, p)
    assert not vs.proof_ok(TOKEN, bytes(32), p)  # another nonce
    assert not vs.proof_ok("another-token", nonce, p)
    assert not vs.proof_ok(TOKEN, nonce, bytes(32))  # what a client without a token sends
    assert vs.proof_ok(None, nonce, b"anything")  # a server without a token takes any proof


@pytest.mark.parametrize("env,want", [({}, True), ({vs.ENV: "1"}, True), ({vs.ENV: "0"}, False)])
def test_switch(env: dict[str, str], want: bool) -> None:
    assert vs.enabled(env) is want


# ------------------------------------------------------------------------ against a ManagerServer
class Group:
    """A lighthouse and one replica group's ManagerServer of two ranks, with clients."""

    def __init__(self, token: str | None = None) -> None:
        self.lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10_000, token=token)
        self.server = ManagerServer(replica_id="g", lighthouse_addr=self.lh.address(), hostname="127.0.0.1",
                                    bind="127.0.0.1:0", store_addr="store-g:29500", world_size=2,
                                    heartbeat_interval=timedelta(milliseconds=100), connect_timeout=CONNECT,
                                    token=token)
        self.token = token
        self.clients: list[ManagerClient] = []

    def client(self, **kw: Any) -> ManagerClient:
        c = ManagerClient(self.server.address(), connect_timeout=CONNECT, token=self.token, **kw)
        self.clients.append(c)
        return c

    def vote(self, clients: list[ManagerClient], step: int, votes: tuple[bool, bool], timeout: float = 5.0) -> list[Any]:
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(c.should_commit, r, step, votes[r], timeout) for r, c in enumerate(clients)]
            return [f.result(timeout=timeout + 10) for f in futs]

    @property
    def socket_votes(self) -> int:
        sock = self.server._vote_socket
        return sock.votes if sock is not None else 0

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.shutdown()
        self.lh.shutdown()


@pytest.fixture
def group() -> Iterator[Group]:
    g = Group()
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def token_group() -> Iterator[Group]:
    g = Group(token=TOKEN)
    try:
        yield g
    finally:
        g.close()


def _raw(g: Group) -> tuple[socket.socket, bytes]:
    """A raw connection to the group's vote socket and the nonce it opened with."""
    assert g.server._vote_socket is not None
    sock = socket.create_connection(("127.0.0.1", g.server._vote_socket.port), timeout=5)
    head = b""
    while len(head) < len(vs.MAGIC) + vs.NONCE_BYTES + vs.INSTANCE_BYTES:
        chunk = sock.recv(64)
        assert chunk, "the vote socket closed before its greeting"
        head += chunk
    assert head.startswith(vs.MAGIC) and head.endswith(g.server._vote_socket.instance)
    return sock, head[len(vs.MAGIC):len(vs.MAGIC) + vs.NONCE_BYTES]


def _closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection (bounded wait)."""
    sock.settimeout(5)
    got = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return got
        got += chunk


def test_votes_move_to_the_socket_after_the_first_answer_and_decide_alike(group: Group) -> None:
    cs = [group.client(), group.client()]
    assert group.vote(cs, 1, (True, True)) == [True, True]  # over gRPC: the answer names the socket
    assert group.socket_votes == 0
    assert group.vote(cs, 2, (True, True)) == [True, True]
    assert group.socket_votes == 2
    assert group.vote(cs, 3, (True, False)) == [False, False]
    assert group.vote(cs, 4, (False, True)) == [False, False]
    assert group.socket_votes == 6
    # A retried vote for a decided step gets the same answer over the socket too.
    assert cs[0].should_commit(0, 3, True, 2.0) is False


def test_the_switch_keeps_every_vote_on_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vs.ENV, "0")
    g = Group()
    try:
        assert g.server._vote_socket is None
        cs = [g.client(), g.client()]
        for step in (1, 2, 3):
            assert g.vote(cs, step, (True, True)) == [True, True]
        assert all(c._fast is None for c in cs)
    finally:
        g.close()


def test_a_group_of_one_rank_serves_no_socket() -> None:
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    s = ManagerServer(replica_id="solo", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                      store_addr="store:1", world_size=1, connect_timeout=CONNECT)
    try:
        assert s._vote_socket is None
    finally:
        s.shutdown()
        lh.shutdown()


def test_the_token_guards_the_socket_and_a_wrong_proof_changes_nothing(token_group: Group) -> None:
    g = token_group
    cs = [g.client(), g.client()]
    assert g.vote(cs, 1, (True, True)) == [True, True]
    assert g.vote(cs, 2, (True, True)) == [True, True]
    assert g.socket_votes == 2  # the right token's proof is accepted
    assert g.server._vote_socket is not None
    refused = g.server._vote_socket.refused
    for bad in (bytes(vs.PROOF_BYTES), None):  # no token's proof; a proof of another token
        sock, nonce = _raw(g)
        sock.sendall((bad if bad is not None else vs.proof("not-the-token", nonce))
                     + vs.encode_frame({"rank": 1, "step": 3, "vote": False, "timeout_s": 5}))
        assert _closed_by_server(sock) == b""  # closed before any answer
        sock.close()
    assert g.server._vote_socket.refused == refused + 2
    assert 3 not in g.server._commits and g.socket_votes == 2  # the forged False never counted
    assert g.vote(cs, 3, (True, True)) == [True, True]


def test_the_token_never_travels_on_the_socket() -> None:
    """The client sends a proof of the token, never the token: a fake server that records
    every byte the client sends sees neither the token nor its bytes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    seen = bytearray()
    nonce = bytes(range(32))

    def fake() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            conn.sendall(vs.MAGIC + nonce + _ID)
            while len(seen) < vs.PROOF_BYTES + 4:
                seen.extend(conn.recv(4096))
            n = struct.unpack("!I", bytes(seen[vs.PROOF_BYTES:vs.PROOF_BYTES + 4]))[0]
            while len(seen) < vs.PROOF_BYTES + 4 + n:
                seen.extend(conn.recv(4096))
            conn.sendall(vs.encode_frame({"decision": True}))

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    client = vs.VoteSocketClient("127.0.0.1", srv.getsockname()[1], TOKEN, _ID)
    try:
        assert client.vote(1, 5, True, [("x-rallypoint-rank-key", "k")], 5.0).decision is True
    finally:
        client.close()
        t.join(5)
        srv.close()
    assert bytes(seen[:vs.PROOF_BYTES]) == vs.proof(TOKEN, nonce)
    assert TOKEN.encode() not in seen


@pytest.mark.parametrize("frame,answered", [
    (struct.pack("!I", vs.MAX_FRAME_BYTES + 1), False),  # refused from the length alone
    (struct.pack("!I", 0), False),
    (struct.pack("!I", 9) + b"not json!", True),  # told why, then closed
    (vs.encode_frame({"rank": 1, "step": 3, "vote": "yes", "timeout_s": 5}), True),
])
def test_a_bad_frame_is_refused_and_changes_nothing(group: Group, frame: bytes, answered: bool) -> None:
    cs = [group.client(), group.client()]
    assert group.vote(cs, 1, (True, True)) == [True, True]
    assert group.server._vote_socket is not None
    refused = group.server._vote_socket.refused
    sock, nonce = _raw(group)
    sock.sendall(vs.proof(None, nonce) + frame)
    got = _closed_by_server(sock)
    sock.close()
    if answered:
        answer = vs.parse_answer(got[4:])
        assert answer.code == "INVALID_ARGUMENT" and "bad vote" in answer.message
    else:
        assert got == b""
    assert group.server._vote_socket.refused == refused + 1
    assert group.socket_votes == 0 and not group.server._commits
    assert group.vote(cs, 2, (True, True)) == [True, True]  # the group goes on


def test_a_socket_that_fails_falls_back_to_grpc(group: Group) -> None:
    cs = [group.client(), group.client()]
    assert group.vote(cs, 1, (True, True)) == [True, True]
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    for c in cs:
        c._drop_fast()
        c._fast = vs.VoteSocketClient("127.0.0.1", port, None, _ID)
    before = group.socket_votes
    assert group.vote(cs, 2, (True, True)) == [True, True]  # over gRPC
    assert group.socket_votes == before
    assert all(c._fast_failed == (port, _ID) for c in cs)
    assert group.vote(cs, 3, (True, False)) == [False, False]  # back on the server's socket
    assert group.socket_votes == before + 2


def test_a_port_another_server_took_gets_no_vote(group: Group) -> None:
    """A client whose server's socket port now belongs to another server (its server
    restarted, another replica group's socket got the port) sends nothing there: the
    greeting names another instance, so the vote goes over gRPC to its own server and the
    other socket counts nothing."""
    other = Group()
    try:
        cs = [group.client(), group.client()]
        assert group.vote(cs, 1, (True, True)) == [True, True]
        assert group.server._vote_socket is not None and other.server._vote_socket is not None
        stale = cs[1]._fast
        assert stale is not None and stale.instance == group.server._vote_socket.instance
        # The port this client learnt now answers as the other group's socket.
        cs[1]._fast = vs.VoteSocketClient("127.0.0.1", other.server._vote_socket.port, None, stale.instance)
        before = (group.socket_votes, other.socket_votes)
        assert group.vote(cs, 2, (True, False)) == [False, False]  # decided by its own group, over gRPC
        assert other.socket_votes == before[1] and 2 not in other.server._commits
        assert cs[1]._fast_failed == (other.server._vote_socket.port, stale.instance)
        assert group.vote(cs, 3, (True, True)) == [True, True]  # its own server's socket again
        assert group.socket_votes == before[0] + 3  # rank 0's two votes and rank 1's last
        assert cs[1]._fast is not None and cs[1]._fast.instance == group.server._vote_socket.instance
    finally:
        other.close()


def test_silent_connections_at_the_cap_give_way_to_the_ranks(group: Group, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone who reaches the port can fill the cap with connections that never prove the
    token: a rank's newcomer takes the oldest one's place and its vote goes over the socket;
    only when every place holds a proven connection is a newcomer closed (that rank votes
    over gRPC, and the decision is the same)."""
    monkeypatch.setattr(vs, "MAX_CONNECTIONS", 3)
    cs = [group.client(), group.client()]
    assert group.vote(cs, 1, (True, True)) == [True, True]  # over gRPC: the answer names the socket
    silent = [_raw(group)[0] for _ in range(3)]  # the cap's worth, none proving anything
    before = group.socket_votes
    assert group.vote(cs, 2, (True, True)) == [True, True]
    assert group.socket_votes == before + 2  # both ranks' newcomers got in: the votes came over the socket
    # ...in the places of the two oldest silent connections, which the server closed.
    assert [_closed_by_server(s) for s in silent[:2]] == [b"", b""]
    # A proven newcomer takes the last silent one's place; now every place is proven.
    sock, nonce = _raw(group)
    sock.sendall(vs.proof(None, nonce))
    proven = [sock]
    assert _closed_by_server(silent[2]) == b""
    server = group.server._vote_socket
    assert server is not None
    wait_until(lambda: len(server._conns) == 3 and all(ok for _, ok in server._conns.values()), timeout=5,
               what="the last silent connection displaced and the proof accepted")
    refused = server.refused
    late = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert _closed_by_server(late) == b""  # every place proven: the newcomer is closed unanswered
    assert server.refused == refused + 1
    assert group.vote(cs, 3, (True, False)) == [False, False]  # the ranks' kept connections still serve
    assert group.socket_votes == before + 4
    for sock in (*silent, *proven, late):
        sock.close()


def test_a_vote_given_up_is_withdrawn(group: Group) -> None:
    cs = [group.client(), group.client()]
    assert group.vote(cs, 1, (True, True)) == [True, True]
    with pytest.raises(TimeoutError, match="step 2"):
        cs[0].should_commit(0, 2, False, 0.3)  # rank 1 never votes for step 2
    wait_until(lambda: 2 not in group.server._commits, timeout=10, what="the given-up vote withdrawn")
    assert group.vote(cs, 3, (True, True)) == [True, True]


def test_one_rank_cannot_vote_for_another_over_the_socket(group: Group) -> None:
    cs = [group.client(), group.client()]
    assert group.vote(cs, 1, (True, True)) == [True, True]
    assert group.server._vote_socket is not None
    intruder = group.client()  # another process: its own rank key
    intruder._fast = vs.VoteSocketClient("127.0.0.1", group.server._vote_socket.port, None,
                                         group.server._vote_socket.instance)
    with pytest.raises(PermissionError, match="rank"):
        intruder.should_commit(1, 2, False, 2.0)
    assert group.socket_votes == 1 and 2 not in group.server._commits  # refused before it counted
    assert group.vote(cs, 2, (True, True)) == [True, True]  # its False did not fail the step


def test_shutdown_closes_the_open_vote_connections_at_once(group: Group) -> None:
    import time

    cs = [group.client(), group.client()]
    for step in (1, 2):
        assert group.vote(cs, step, (True, True)) == [True, True]
    assert group.socket_votes == 2  # both clients hold an open, idle connection now
    t0 = time.monotonic()
    group.server.shutdown()
    assert time.monotonic() - t0 < 5.0
    with pytest.raises((ConnectionError, TimeoutError)):  # the socket is gone; gRPC too
        cs[1].should_commit(1, 3, True, 1.0)


def test_a_kept_connection_the_server_closed_is_replaced_without_failing_the_vote(group: Group) -> None:
    """The server closes idle connections (after 10 minutes); the next vote finds its kept
    connection closed only after writing to it, and goes again on a new one."""
    import asyncio

    cs = [group.client(), group.client()]
    for step in (1, 2):
        assert group.vote(cs, step, (True, True)) == [True, True]
    sock_server = group.server._vote_socket
    assert sock_server is not None and group.server._loop is not None

    async def close_all() -> int:
        writers = list(sock_server._conns)
        for w in writers:
            w.close()
        return len(writers)

    assert asyncio.run_coroutine_threadsafe(close_all(), group.server._loop).result(5) == 2
    wait_until(lambda: not sock_server._conns, timeout=5, what="the server-side connections closed")
    before = sock_server.votes
    assert group.vote(cs, 3, (True, False)) == [False, False]  # decided, not a connection error
    assert group.vote(cs, 4, (True, True)) == [True, True]
    assert sock_server.votes == before + 4  # both steps over the socket


def test_a_vote_socket_that_never_answers_times_out_naming_the_vote(group: Group) -> None:
    """The client's own bound: a source that takes the vote and never answers costs the
    vote's timeout (plus a second), and the error names the rank and the step."""
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    held: list[socket.socket] = []

    def silent() -> None:
        conn, _ = srv.accept()
        held.append(conn)
        conn.sendall(vs.MAGIC + bytes(vs.NONCE_BYTES) + _ID)

    t = threading.Thread(target=silent, daemon=True)
    t.start()
    c = group.client()
    c._fast = vs.VoteSocketClient("127.0.0.1", srv.getsockname()[1], None, _ID)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="should_commit of group rank 1 at step 5"):
            c.should_commit(1, 5, True, 0.3)
        assert time.monotonic() - t0 < 5.0
    finally:
        t.join(5)
        for s in held:
            s.close()
        srv.close()


def _read_frame(sock: socket.socket) -> Any:
    """One answer frame from a raw connection (bounded wait)."""
    sock.settimeout(5)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk = sock.recv(4096)
        assert chunk, "the vote socket closed before answering"
        data += chunk
    return vs.parse_answer(data[4:])


def test_a_vote_undecided_in_its_time_is_answered_so_withdrawn_and_the_connection_serves_on(group: Group) -> None:
    sock, nonce = _raw(group)  # a caller without a rank key (torchft's rules) for group rank 1
    try:
        sock.sendall(vs.proof(None, nonce) + vs.encode_frame({"rank": 1, "step": 4, "vote": False, "timeout_s": 0.3}))
        answer = _read_frame(sock)  # rank 0 never votes for step 4
        assert answer.decision is None and answer.code == "DEADLINE_EXCEEDED" and "0.3s" in answer.message
        wait_until(lambda: 4 not in group.server._commits, timeout=10, what="the undecided vote withdrawn")
        rank0 = group.client()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(rank0.should_commit, 0, 5, True, 5.0)
            sock.sendall(vs.encode_frame({"rank": 1, "step": 5, "vote": True, "timeout_s": 5}))
            assert _read_frame(sock).decision is True  # the same connection, the next vote
            assert fut.result(10) is True
        assert group.socket_votes == 2
    finally:
        sock.close()


def test_a_connection_cancelled_mid_vote_leaves_no_task_behind() -> None:
    """The server's loop cancels a connection's task (the loop shuts down) while its vote
    waits: the vote is withdrawn and the watch for the client going away ends with it."""
    import asyncio

    started = threading.Event()

    async def never(req: Any, peer: str) -> tuple[bool, list[tuple[str, str]]]:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def scenario() -> list[asyncio.Task[Any]]:
        async with asyncio.timeout(10):
            return await cancelled_mid_vote()

    async def cancelled_mid_vote() -> list[asyncio.Task[Any]]:
        server = vs.VoteSocketServer(None, never, "test")
        reader = asyncio.StreamReader()
        reader.feed_data(vs.encode_frame({"rank": 1, "step": 3, "vote": True, "timeout_s": 60}))
        task = asyncio.ensure_future(server._one_vote(reader, None, "peer"))  # type: ignore[arg-type]
        for _ in range(100):
            if started.is_set():
                break
            await asyncio.sleep(0.01)
        assert started.is_set(), "the vote never reached decide"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]

    assert asyncio.run(scenario()) == []
