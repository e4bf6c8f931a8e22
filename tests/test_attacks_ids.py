"""Issue 37, item 7: replica ids are no longer first-come.

A token holder (the operator's token, or a job's own) runs a process of its own on
loopback and sends a Quorum, a Heartbeat or an Attach under a live victim's replica id,
with rallypoint's client (its own session) and with raw gRPC (no session at all). Each is
refused (PERMISSION_DENIED), counted in ``/metrics`` as ``replica_id_taken``; the victim
keeps training: its address and quorum membership are unchanged and its peer gets no
PeerDown. After the victim leaves, the id is anyone's again. A legit replica's stream that
reconnects (a restarted lighthouse, or the same process opening a new stream over a
half-open one) is still welcomed.
"""

from __future__ import annotations

import json
import queue
import re
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import httpx
import pytest

from conftest import Proc, replica_row, wait_until
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream
from rallypoint.lighthouse.jobs import JobConfig
from rallypoint.lighthouse.owners import SESSION_HEADER, Caller, OwnerDesk, caller_of, refusal

OPERATOR = "operator-s3cret-0123456789"
LLAMA = "llama-s3cret-abcdef"
T = 10.0

# A replica that trains: attach (with its manager address), then ask for a quorum each
# step; one JSON line per quorum and per PeerDown heard.
REPLICA = r"""
import json, os, sys, time
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream
addr, rid, address = sys.argv[1], sys.argv[2], sys.argv[3]
def say(**kw):
    print(json.dumps(kw), flush=True)
stream = LivenessStream(addr, rid, address, on_peer_down=lambda peer, reason: say(peer_down=peer, reason=reason))
if not stream.start(10.0):
    say(error="liveness stream not welcomed"); sys.exit(3)
say(attached=rid)
client = LighthouseClient(addr, connect_timeout=10.0)
step = 0
while not os.path.exists(sys.argv[4]):
    try:
        q = client.quorum(rid, timeout=30.0, address=address, step=step)
    except Exception as e:
        say(error=str(e)); time.sleep(0.05); continue
    say(quorum_id=q.quorum_id, members=list(q.replica_ids), step=step)
    step += 1
    time.sleep(0.05)
stream.close("finished training")
say(left=rid)
"""

# The attacker: the same token, its own process. Prints what each attempt got.
ATTACKER = r"""
import json, sys
import grpc
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse.client import LighthouseClient, LivenessStream
addr, rid, evil = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
c = LighthouseClient(addr, connect_timeout=10.0)
try:
    c.quorum(rid, timeout=3.0, address=evil, step=10**9)
    out["quorum"] = "OK"
except Exception as e:
    out["quorum"] = repr(e)
try:
    c.heartbeat(rid, timeout=3.0)
    out["heartbeat"] = "OK"
except Exception as e:
    out["heartbeat"] = repr(e)
s = LivenessStream(addr, rid, evil, reconnect_backoff=(5.0, 5.0))
out["attach"] = "welcomed" if s.start(3.0) else "not welcomed"
s.close()
# Raw gRPC with the token and no session at all.
md = ([("authorization", "Bearer " + sys.argv[4])] if sys.argv[4] != "-" else []) + (
    [("rallypoint-job", sys.argv[5])] if len(sys.argv) > 5 else [])
ch = grpc.insecure_channel(addr.split("://")[-1], options=[("grpc.enable_http_proxy", 0)])
req = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=rid, address=evil, step=10**9))
try:
    ch.unary_unary("/torchft.LighthouseService/Quorum")(req.SerializeToString(), timeout=3.0, metadata=md)
    out["raw_quorum"] = "OK"
except grpc.RpcError as e:
    out["raw_quorum"] = e.code().name; out["raw_quorum_details"] = e.details()
hello = rpb.AttachRequest(hello=rpb.AttachHello(replica_id=rid, address=evil)).SerializeToString()
call = ch.stream_stream("/rallypoint.RallypointLighthouse/Attach")(iter([hello]), timeout=3.0, metadata=md)
try:
    out["raw_attach"] = [len(m) for m in call]
except grpc.RpcError as e:
    out["raw_attach"] = e.code().name
print(json.dumps(out), flush=True)
"""


# ------------------------------------------------------------------ the rule, as a table
A = Caller("cred-a", "s1", "127.0.0.1")


@pytest.mark.parametrize("owner, caller, refused", [
    (None, A, False),  # unbound: the first caller binds it
    (A, A, False),  # the owner, again (a reconnect of the same process)
    (A, Caller("cred-a", "s1", "10.0.0.9"), False),  # its session over another interface
    (A, Caller("cred-b", "s1", "127.0.0.1"), False),  # its session with a rotated token
    (A, Caller("cred-b", "s2", "127.0.0.1"), True),  # another credential, another process
    (Caller("c", None, "10.0.0.1"), Caller("d", None, "10.0.0.1"), True),  # torchft: another credential
    (A, Caller("cred-a", "s2", "127.0.0.1"), True),  # another process, same token and host
    (A, Caller("cred-a", None, "127.0.0.1"), True),  # raw gRPC, no session
    (Caller("c", None, "10.0.0.1"), Caller("c", None, "10.0.0.1"), False),  # torchft: bound to its host
    (Caller("c", None, "10.0.0.1"), Caller("c", None, "10.0.0.2"), True),
    (Caller("c", None, "10.0.0.1"), Caller("c", "s9", "10.0.0.1"), True),  # a rallypoint process is not it
    (Caller("", None, "10.0.0.1"), Caller("", None, "10.0.0.2"), True),  # no credential anywhere: still its host
])
def test_refusal_rule(owner: Caller | None, caller: Caller, refused: bool) -> None:
    why = refusal(owner, caller, "g:1")
    assert (why is not None) == refused
    if why:
        assert "'g:1' is registered by" in why and "cred-a" not in why and "cred-b" not in why and "s1" not in why


def test_owner_desk_binds_first_and_frees_on_release() -> None:
    desk = OwnerDesk()
    b = Caller("cred-a", "s2", "127.0.0.1")
    assert desk.claim("g:1", A) is None and desk.owner("g:1") == A
    assert desk.claim("g:1", b) is not None and desk.owner("g:1") == A  # nothing changed
    desk.release("g:1")
    assert desk.claim("g:1", b) is None and desk.owner("g:1") == b
    desk.keep_only(set())
    assert len(desk) == 0


def test_caller_of_hashes_the_credential_and_parses_the_peer() -> None:
    c = caller_of([("authorization", f"Bearer {OPERATOR}"), (SESSION_HEADER, "abc")], "ipv4:127.0.0.1:5555")
    assert c.session == "abc" and c.host == "127.0.0.1" and c.credential and OPERATOR not in c.credential
    assert caller_of([("authorization", f"Bearer {OPERATOR}")], "ipv6:[::1]:7").credential == c.credential
    assert caller_of(None, "ipv4:10.1.2.3:1") == Caller("", None, "10.1.2.3")
    assert caller_of([(SESSION_HEADER, "x" * 1000)], "ipv4:1.2.3.4:1").session == "x" * 128


# ------------------------------------------------------------------ against a real lighthouse
def _rejected(http: httpx.Client, reason: str, job: str | None) -> float:
    text = http.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("rallypoint_lighthouse_rejected_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if labels.get("reason") == reason and labels.get("rallypoint_job") == job:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _http(lh: Any) -> httpx.Client:
    addr = lh.http_address()
    return httpx.Client(base_url=addr if "://" in addr else f"http://{addr}", timeout=T)


def _drain(p: Proc) -> None:
    """Move the lines a child printed so far into ``p.seen``."""
    while True:
        try:
            line = p.lines.get_nowait()
        except queue.Empty:
            return
        if line is None:
            p.lines.put(None)
            return
        p.seen.append(line)


def _lines(p: Proc) -> list[dict]:
    _drain(p)
    out = []
    for line in list(p.seen):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _quorums(p: Proc) -> list[dict]:
    return [e for e in _lines(p) if "quorum_id" in e]


def _training(lh: Any, spawn_python: Callable[..., Proc], stop: Path, env: dict[str, str]) -> dict[str, Proc]:
    """Two replicas training together (each one's quorums have both)."""
    procs = {rid: spawn_python(REPLICA, lh.local_address(), rid, f"http://127.0.0.1:{port}", str(stop), name=rid,
                               env=env)
             for rid, port in (("victim:0a1b", 40001), ("peer:2c3d", 40002))}
    for rid, p in procs.items():
        assert p.json_line(20.0) == {"attached": rid}
    for p in procs.values():
        p.wait_line(lambda line: len(json.loads(line).get("members", [])) == 2 if line.startswith("{") else False, 20.0)
    return procs


def _attack(spawn_python: Callable[..., Proc], lh: Any, rid: str, token: str | None, env: dict[str, str],
            job: str | None = None) -> dict:
    p = spawn_python(ATTACKER, lh.local_address(), rid, "http://127.0.0.1:6666", token or "-", *([job] if job else []),
                     name="attacker", env=env)
    got = p.json_line(40.0)
    p.wait(10.0)
    return got


@pytest.mark.parametrize("setup", ["operator-token", "job-token", "open-job"])
def test_attack_id_takeover_is_refused_and_the_victim_keeps_training(lighthouse, spawn_python, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     setup: str) -> None:
    """The attacker holds what the victim holds: the operator's token, the job's own token,
    or (an open job) nothing at all."""
    monkeypatch.delenv("RALLYPOINT_TOKEN", raising=False)
    monkeypatch.delenv("RALLYPOINT_JOB", raising=False)
    jobs = {"llama": JobConfig(token=LLAMA)} if setup == "job-token" else (
        {"default": JobConfig(open=True)} if setup == "open-job" else None)
    lh = lighthouse(min_replicas=2, token=OPERATOR, jobs=jobs, http_bind="127.0.0.1:0", heartbeat_timeout_ms=5000)
    token, job = {"operator-token": (OPERATOR, None), "job-token": (LLAMA, "llama"), "open-job": (None, None)}[setup]
    env = {**({"RALLYPOINT_TOKEN": token} if token else {}), **({"RALLYPOINT_JOB": job} if job else {})}
    stop = tmp_path / "stop"
    procs = _training(lh, spawn_python, stop, env)
    victim = "victim:0a1b"
    with _http(lh) as http:
        status = lh.status() if job is None else http.get("/status", params={"job": job},
                                                          headers={"Authorization": f"Bearer {OPERATOR}"}).json()
        before = replica_row(status, victim)
        assert before is not None and before["address"] == "http://127.0.0.1:40001"
        refused0 = _rejected(http, "replica_id_taken", job)

        got = _attack(spawn_python, lh, victim, token, env, job)
        assert "PermissionError" in got["quorum"] and "registered by another process" in got["quorum"], got
        assert "PermissionError" in got["heartbeat"] or "PERMISSION_DENIED" in got["heartbeat"], got
        assert got["attach"] == "not welcomed", got
        assert got["raw_quorum"] == "PERMISSION_DENIED" and got["raw_attach"] == "PERMISSION_DENIED", json.dumps(got)
        assert _rejected(http, "replica_id_taken", job) >= refused0 + 5

        # The victim keeps training with its peer: more quorums of both, same address, no PeerDown.
        seen = {rid: len(_quorums(p)) for rid, p in procs.items()}
        for rid, p in procs.items():
            wait_until(lambda: len(_quorums(p)) >= seen[rid] + 5, 20.0, what=f"{rid} keeps training")
        for p in procs.values():
            assert all(len(q["members"]) == 2 for q in _quorums(p)[-3:]), _quorums(p)[-3:]
            assert not [e for e in _lines(p) if "peer_down" in e], _lines(p)
        status = lh.status() if job is None else http.get("/status", params={"job": job},
                                                          headers={"Authorization": f"Bearer {OPERATOR}"}).json()
        after = replica_row(status, victim)
        assert after is not None and after["address"] == before["address"] and after["attached"], after
        events = lh.job_core(job or "default").store.events(limit=1000, replica_id=victim)
        assert [e.kind for e in events] == ["join"], [(e.kind, e.detail) for e in events]

    # The victim leaves: its id is free again.
    stop.write_text("")
    for p in procs.values():
        p.wait_line(lambda line: '"left"' in line, 20.0)
    with LighthouseClient(lh.local_address(), token=token, job=job) as c:
        wait_until(lambda: _heartbeat_ok(c, victim), 10.0, what="the id is free after its owner left")


def _heartbeat_ok(c: LighthouseClient, rid: str) -> bool:
    try:
        c.heartbeat(rid, timeout=2.0)
        return True
    except Exception:
        return False


def test_legit_reconnects_still_work(lighthouse, spawn_python, tmp_path: Path) -> None:
    """A stream that reconnects after a lighthouse restart (the bindings are in memory: the
    owner binds again) and a second stream of the same process are welcomed; the attacker
    is still refused after the restart."""
    lh = lighthouse(min_replicas=1, token=OPERATOR, heartbeat_timeout_ms=5000, state=str(tmp_path / "state.json"))
    addr = lh.local_address()
    downs: list[tuple[str, str]] = []
    stream = LivenessStream(addr, "solo:1", "http://127.0.0.1:40003", token=OPERATOR,
                            on_peer_down=lambda r, why: downs.append((r, why)))
    again: LivenessStream | None = None
    try:
        assert stream.start(T)
        # The same process, a second stream over the first (a half-open one it gave up on).
        again = LivenessStream(addr, "solo:1", "http://127.0.0.1:40003", token=OPERATOR)
        assert again.start(T)
        again.close()
        again = None

        port = int(addr.rsplit(":", 1)[1])
        lh.shutdown(timeout=10)
        wait_until(lambda: not stream.connected, 10.0, what="stream notices the restart")
        lh2 = _restart(lighthouse, port, tmp_path)
        wait_until(lambda: stream.connected, 15.0, what="stream re-attaches to the restarted lighthouse")
        row = replica_row(lh2.status(), "solo:1")
        assert row is not None and row["attached"] and row["address"] == "http://127.0.0.1:40003", row
        got = _attack(spawn_python, lh2, "solo:1", OPERATOR, {"RALLYPOINT_TOKEN": OPERATOR})
        assert got["attach"] == "not welcomed" and "PermissionError" in got["quorum"], got
        with LighthouseClient(addr, token=OPERATOR) as c:  # its own process still speaks for it
            assert list(c.quorum("solo:1", T, address="http://127.0.0.1:40003").replica_ids) == ["solo:1"]
        assert not downs
    finally:
        if again is not None:
            again.close()
        stream.close()


def _restart(lighthouse: Callable[..., Any], port: int, tmp_path: Path) -> Any:
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return lighthouse(bind=f"127.0.0.1:{port}", min_replicas=1, token=OPERATOR, heartbeat_timeout_ms=5000,
                              state=str(tmp_path / "state.json"))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_torchft_style_caller_is_bound_to_its_host(lighthouse) -> None:
    """A session-less (torchft) replica keeps its id against a caller that sends a session,
    and against itself the id works as before (no binding change for torchft clients)."""
    lh = lighthouse(min_replicas=1, token=OPERATOR)
    md = [("authorization", f"Bearer {OPERATOR}")]
    with grpc.insecure_channel(lh.local_address().split("://")[-1], options=[("grpc.enable_http_proxy", 0)]) as ch:
        beat = ch.unary_unary("/torchft.LighthouseService/Heartbeat")
        req = pb.LighthouseHeartbeatRequest(replica_id="tf:1").SerializeToString()
        beat(req, timeout=T, metadata=md)
        beat(req, timeout=T, metadata=md)  # itself, again
        with pytest.raises(grpc.RpcError) as e:
            beat(req, timeout=T, metadata=md + [(SESSION_HEADER, "someone-else")])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        hello = rpb.AttachRequest(hello=rpb.AttachHello(replica_id="tf:1", address="http://x:1")).SerializeToString()
        with pytest.raises(grpc.RpcError) as e:
            list(ch.stream_stream("/rallypoint.RallypointLighthouse/Attach")(
                iter([hello]), timeout=T, metadata=md + [(SESSION_HEADER, "someone-else")]))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


# ------------------------------------------------------------------ ManagerServer rank keys
@pytest.mark.parametrize("published, key, refused", [
    (None, None, None),  # torchft's client (no key): torchft's rules
    (None, "k1", "has published no rank key"),  # the rank never wrote one: nobody may bind it
    ("DIGEST(k1)", "k1", None),  # the key its rank published
    ("DIGEST(k1)", "k2", "not the one group rank 1 published"),  # a token holder's own key
    ("garbage", "k1", "not the one"),
])
def test_confirm_rank(published: str | None, key: str | None, refused: str | None) -> None:
    from rallypoint.manager._votes import confirm_rank, rank_key_digest

    if published == "DIGEST(k1)":
        published = rank_key_digest("k1")
    why = confirm_rank(published, 1, key)
    assert (why is None) if refused is None else (why is not None and refused in why), why
    assert "k1" not in rank_key_digest("k1")


def test_a_token_holder_calling_first_cannot_take_a_rank_the_store_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before rank 1 ever called, a token holder's Quorum and ShouldCommit for rank 1 (its
    own key) are refused: the server binds rank 1 only to the key whose digest rank 1 wrote
    in the group's store. Rank 1 then binds and trains; rank 0 is in-process."""
    import concurrent.futures as cf
    from datetime import timedelta

    from rallypoint.lighthouse.server import LighthouseServer
    from rallypoint.manager._votes import new_rank_key, rank_key_digest
    from rallypoint.manager.client import ManagerClient
    from rallypoint.manager.server import ManagerServer

    monkeypatch.setenv("RALLYPOINT_TOKEN", OPERATOR)
    ten = timedelta(seconds=10)
    store: dict[int, str] = {}  # the group's store, as the server reads it
    key1 = new_rank_key()
    store[1] = rank_key_digest(key1)  # rank 1 writes it before its first call (manager/_connect.py)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, token=OPERATOR)
    server = ManagerServer(replica_id="g:1", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                           store_addr="127.0.0.1:29500", world_size=2, connect_timeout=ten, on_kill=lambda _m: None,
                           published_rank_key=store.get)
    try:
        with ManagerClient(server.address(), connect_timeout=ten) as forger:
            with pytest.raises(PermissionError, match="not the one group rank 1 published"):
                forger._quorum(1, 0, "http://evil:1", False, timedelta(seconds=2))
            with pytest.raises(PermissionError, match="not the one group rank 1 published"):
                forger.should_commit(1, 0, True, timedelta(seconds=2))
        assert not server._rounds and not server._rank_keys
        from rallypoint.manager._local import LocalManagerClient

        rank0 = LocalManagerClient(server)
        with ManagerClient(server.address(), connect_timeout=ten, rank_key=key1) as rank1, cf.ThreadPoolExecutor(2) as pool:
            a = pool.submit(rank0._quorum, 0, 0, "http://rank0:1", False, ten)
            b = pool.submit(rank1._quorum, 1, 0, "http://rank1:1", False, ten)
            assert a.result(20).quorum_id == b.result(20).quorum_id
            v0 = pool.submit(rank0.should_commit, 0, 0, True, ten)
            v1 = pool.submit(rank1.should_commit, 1, 0, True, ten)
            assert (v0.result(20), v1.result(20)) == (True, True)
            assert rank1._checkpoint_metadata(1, ten) == "http://rank1:1"
    finally:
        server.shutdown()
        lh.shutdown()
