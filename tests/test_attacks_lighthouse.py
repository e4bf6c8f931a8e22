"""Issue 37, items 1, 2 and 8, as an attacker on loopback would try them against the setup
README recommends for torchft clients: a lighthouse with the operator's ``--token`` and a
jobs file where ``default`` is open and ``llama`` has its own token.

1. An anonymous caller registers a replica of the open job at its own server and asks the
   lighthouse to kill it (gRPC and HTTP): the kill reaches it without any credential; an
   operator's kill of a token job carries that job's token, never the operator's.
2. Fault injection is off unless the lighthouse was started with ``--allow-inject`` (and a
   Manager with ``RALLYPOINT_ALLOW_INJECT=1``); when on, an open job's anonymous callers may
   not inject, and ``lighthouse-restart`` needs the operator's token. Refusals are counted.
3. (item 8) The token comes from ``--token-file`` or the environment; ``--token`` warns;
   a restart's command line holds no token and nothing logs it; ``/openapi.json`` is off.

Each attack asserts what it could have changed did not change: the victim job's quorum,
addresses and events, and the injections waiting for a replica.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx
import pytest

from rallypoint._net.inject import Injection, inject_allowed
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.cli import lighthouse_token, main, without_token
from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.injections import (INJECT_NEEDS_OPERATOR, INJECT_NEEDS_TOKEN, INJECT_OFF,
                                              inject_refusal)
from rallypoint.lighthouse.jobs import JobConfig, kill_credential
from rallypoint.manager._inject import Injector

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = "operator-s3cret-0123456789"
LLAMA = "llama-s3cret-abcdef"
JOBS = {"default": JobConfig(open=True), "llama": JobConfig(token=LLAMA)}
T = 10.0  # every network wait


class Listener:
    """A ManagerService of our own that implements only Kill and records each call's
    message and ``authorization`` metadata: the attacker's server (or a real replica's)."""

    def __init__(self) -> None:
        self.kills: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._pool = cf.ThreadPoolExecutor(2)
        self.server = grpc.server(self._pool)
        handler = grpc.method_handlers_generic_handler("torchft.ManagerService", {
            "Kill": grpc.unary_unary_rpc_method_handler(
                self._kill, request_deserializer=pb.KillRequest.FromString,
                response_serializer=pb.KillResponse.SerializeToString)})
        self.server.add_generic_rpc_handlers((handler,))
        self.address = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _kill(self, request: pb.KillRequest, context: grpc.ServicerContext) -> pb.KillResponse:
        auth = next((str(v) for k, v in context.invocation_metadata() if k == "authorization"), None)
        self.kills.put((request.msg, auth))
        return pb.KillResponse()

    def received(self) -> list[tuple[str, str | None]]:
        out = []
        while not self.kills.empty():
            out.append(self.kills.get_nowait())
        return out

    def stop(self) -> None:
        self.server.stop(None)
        self._pool.shutdown(wait=False)


@pytest.fixture
def listeners() -> Iterator[Any]:
    made: list[Listener] = []

    def make() -> Listener:
        made.append(Listener())
        return made[-1]

    yield make
    for m in made:
        m.stop()


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker has no token and nothing is turned on by the environment."""
    for k in ("RALLYPOINT_TOKEN", "RALLYPOINT_JOB", "RALLYPOINT_ALLOW_INJECT"):
        monkeypatch.delenv(k, raising=False)


def _http(lh: Any) -> httpx.Client:
    addr = lh.http_address()
    return httpx.Client(base_url=addr if "://" in addr else f"http://{addr}", timeout=T)


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _rejected(http: httpx.Client, reason: str, job: str | None = None) -> float:
    """``rallypoint_lighthouse_rejected_requests_total{reason=...}`` of a job (the operator reads it)."""
    text = http.get("/metrics", headers=_bearer(OPERATOR)).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("rallypoint_lighthouse_rejected_requests_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if labels.get("reason") == reason and labels.get("rallypoint_job") == job:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _snapshot(http: httpx.Client, job: str) -> tuple[Any, Any, list]:
    """What an attack on ``job`` must not change: its quorum, its replicas' addresses, its events."""
    s = http.get("/status", params={"job": job}, headers=_bearer(OPERATOR)).json()
    events = http.get("/events", params={"job": job, "limit": 1000}, headers=_bearer(OPERATOR)).json()
    replicas = sorted((r["replica_id"], r.get("address"), r.get("step")) for r in s.get("replicas", []))
    return s.get("quorum_id"), replicas, events


def _victims(lh: Any, listeners: Any) -> tuple[Listener, Listener]:
    """A llama replica (its job's token) and a torchft-style replica of the open job (no token)."""
    llama, torchft = listeners(), listeners()
    with LighthouseClient(lh.local_address(), token=LLAMA, job="llama") as c:
        c.quorum("llama_0", T, address=llama.address, step=3)
    with LighthouseClient(lh.local_address()) as c:
        c.quorum("torchft_0", T, address=torchft.address, step=3)
    return llama, torchft


def _pending_quorum(c: LighthouseClient, rid: str, address: str) -> None:
    """A Quorum request that registers ``address`` for ``rid`` (a pending request does);
    the quorum need not form (the open job's real replica is healthy and not asking)."""
    try:
        c.quorum(rid, 1.0, address=address, step=3)
    except (TimeoutError, ConnectionError):
        pass


# ------------------------------------------------------------------ the rules, as tables
@pytest.mark.parametrize("job, lighthouse, jobs, want", [
    ("default", OPERATOR, JOBS, None),  # open: anyone may have registered the address
    ("llama", OPERATOR, JOBS, LLAMA),  # the job's own token, never the operator's
    ("other", OPERATOR, JOBS, OPERATOR),  # guarded by --token alone: every member presented it
    ("default", OPERATOR, {}, OPERATOR),  # one token, no jobs file: the job's credential
    ("default", None, {}, None),  # no credential anywhere
    ("llama", None, {"llama": JobConfig(token=LLAMA)}, LLAMA),
])
def test_kill_credential_is_the_jobs_own(job: str, lighthouse: str | None, jobs: dict, want: str | None) -> None:
    assert kill_credential(job, lighthouse, jobs) == want


@pytest.mark.parametrize("kind, header, allowed, job_token, secured, want", [
    ("kill", f"Bearer {OPERATOR}", False, None, True, INJECT_OFF),  # off, whoever asks
    ("kill", None, True, None, True, INJECT_NEEDS_TOKEN),  # an open job's anonymity is not enough
    ("kill", "Bearer guess", True, None, True, INJECT_NEEDS_TOKEN),
    ("kill", f"Bearer {OPERATOR}", True, None, True, None),
    ("slow", f"Bearer {LLAMA}", True, LLAMA, True, None),  # the job's own token
    ("lighthouse-restart", f"Bearer {LLAMA}", True, LLAMA, True, INJECT_NEEDS_OPERATOR),
    ("lighthouse-restart", None, True, None, True, INJECT_NEEDS_OPERATOR),
    ("lighthouse-restart", f"Bearer {OPERATOR}", True, None, True, None),
    ("kill", None, True, None, False, None),  # no credential anywhere: the operator turned it on
])
def test_inject_refusal_rules(kind: str, header: str | None, allowed: bool, job_token: str | None, secured: bool,
                              want: str | None) -> None:
    assert inject_refusal(kind, "default", header, allowed, OPERATOR, job_token, secured) == want


def test_injection_is_off_unless_turned_on_by_flag_or_environment() -> None:
    assert not inject_allowed(None, {}) and not inject_allowed(None, {"RALLYPOINT_ALLOW_INJECT": "yes"})
    assert inject_allowed(None, {"RALLYPOINT_ALLOW_INJECT": "1"}) and inject_allowed(True, {})
    assert not inject_allowed(False, {"RALLYPOINT_ALLOW_INJECT": "1"})


def test_token_file_env_and_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "token"
    f.write_text(OPERATOR + "\n")
    assert lighthouse_token(None, str(f)) == OPERATOR and not caplog.records
    monkeypatch.setenv("RALLYPOINT_TOKEN", LLAMA)
    assert lighthouse_token(None, None) == LLAMA and not caplog.records
    assert lighthouse_token(OPERATOR, None) == OPERATOR
    assert "--token puts the token on the command line" in caplog.text and OPERATOR not in caplog.text
    for bad, match in [((OPERATOR, str(f)), "not both"), ((None, str(tmp_path / "none")), "cannot read"),
                       ((None, str(tmp_path / "empty")), "empty")]:
        (tmp_path / "empty").write_text("\n")
        with pytest.raises(ValueError, match=match):
            lighthouse_token(*bad)
    assert without_token(["--min-replicas", "1", "--token", "x", "--token=y", "--token-file", "p"]) == \
        ["--min-replicas", "1", "--token-file", "p"]


# ------------------------------------------------------------------ 1: the kill path
def test_attack_kill_through_an_open_job_never_receives_the_operator_token(lighthouse, listeners) -> None:
    lh = lighthouse(token=OPERATOR, jobs=JOBS, http_bind="127.0.0.1:0")
    llama, torchft = _victims(lh, listeners)
    evil = listeners()
    with _http(lh) as http:
        before = _snapshot(http, "llama")
        refused_before = _rejected(http, "unauthenticated", "llama")

        # The attacker, without any token: a replica of the open job at its own server...
        with LighthouseClient(lh.local_address()) as c:
            _pending_quorum(c, "evil", evil.address)
            assert c.kill("evil", reason="grpc") == evil.address  # ...killed over gRPC...
        r = http.post("/replica/evil/kill", json={"reason": "http"})  # ...and over HTTP
        assert r.status_code == 200, r.text
        got = [evil.kills.get(timeout=T), evil.kills.get(timeout=T)]
        assert sorted(got) == [("grpc", None), ("http", None)]  # no credential at all came with them

        # It cannot reach the token job: refused, counted, and llama's manager hears nothing.
        with LighthouseClient(lh.local_address(), job="llama") as c:
            with pytest.raises(Exception, match="(?i)token"):
                c.kill("llama_0")
        r = http.post("/replica/llama_0/kill", params={"job": "llama"}, json={"reason": "x"})
        assert r.status_code == 401
        r = http.post("/replica/llama_0/kill", params={"job": "llama"}, headers=_bearer("guess"), json={})
        assert r.status_code == 401
        assert _rejected(http, "unauthenticated", "llama") == refused_before + 3  # gRPC and both HTTP refusals
        assert _snapshot(http, "llama") == before and llama.received() == []

        # An operator's kill of the open job's replica carries nothing either (it may be re-pointed).
        r = http.post("/replica/torchft_0/kill", headers=_bearer(OPERATOR), json={"reason": "op"})
        assert r.status_code == 200, r.text
        assert torchft.kills.get(timeout=T) == ("op", None)

        # The positive path: the operator's kill of llama's replica reaches it with llama's token.
        r = http.post("/replica/llama_0/kill", params={"job": "llama"}, headers=_bearer(OPERATOR),
                      json={"reason": "drain"})
        assert r.status_code == 200 and r.json()["address"] == llama.address, r.text
        assert llama.kills.get(timeout=T) == ("drain", f"Bearer {LLAMA}")
        with LighthouseClient(lh.local_address(), token=LLAMA, job="llama") as c:
            assert c.kill("llama_0", reason="by its job") == llama.address
        assert llama.kills.get(timeout=T) == ("by its job", f"Bearer {LLAMA}")
    everything = evil.received() + torchft.received() + llama.received()
    assert not [k for k in everything if k[1] and OPERATOR in k[1]], everything


def test_attack_repointing_an_open_replica_gets_no_credential(lighthouse, listeners) -> None:
    """The attacker re-points the open job's replica at its own server and waits for an
    operator's kill: what arrives carries no token."""
    lh = lighthouse(token=OPERATOR, jobs=JOBS, http_bind="127.0.0.1:0")
    _llama, torchft = _victims(lh, listeners)
    evil = listeners()
    with LighthouseClient(lh.local_address()) as c:
        c.quorum("torchft_0", T, address=evil.address, step=3)
    with _http(lh) as http:
        r = http.post("/replica/torchft_0/kill", headers=_bearer(OPERATOR), json={"reason": "op"})
        assert r.status_code == 200 and r.json()["address"] == evil.address, r.text
    assert evil.kills.get(timeout=T) == ("op", None) and torchft.received() == []


# ------------------------------------------------------------------ 2: fault injection
def _pending(lh: Any, job: str = "default") -> dict:
    return lh._call(lambda: lh.job_core(job).injections.pending(), T)  # type: ignore[no-any-return]


def test_attack_anonymous_injection_into_an_open_job_is_refused_and_counted(lighthouse, listeners) -> None:
    lh = lighthouse(token=OPERATOR, jobs=JOBS, http_bind="127.0.0.1:0", allow_inject=True)
    _victims(lh, listeners)
    with _http(lh) as http:
        before, llama_before = _snapshot(http, "default"), _snapshot(http, "llama")
        for body, headers in [({"kind": "lighthouse-restart"}, {}),
                              ({"kind": "kill", "replica": "torchft_0"}, {}),
                              ({"kind": "bitflip-param", "replica": "torchft_0"}, _bearer("guess")),
                              ({"kind": "lighthouse-restart"}, _bearer(LLAMA))]:  # a job's token: not the operator's
            r = http.post("/inject", json=body, headers=headers)
            assert r.status_code == 403, (body, r.text)
        with LighthouseClient(lh.local_address()) as c:
            with pytest.raises(Exception, match="(?i)token"):
                c.inject({"kind": "hang", "replica": "torchft_0"})
        assert _rejected(http, "inject_refused") == 5
        assert _snapshot(http, "default") == before and _snapshot(http, "llama") == llama_before
        assert _pending(lh) == {} and _pending(lh, "llama") == {}

        # The positive paths: the operator (any job) and a job's own token (its job).
        r = http.post("/inject", json={"kind": "slow", "replica": "torchft_0"}, headers=_bearer(OPERATOR))
        assert r.status_code == 200 and r.json()["replica_id"] == "torchft_0", r.text
        with LighthouseClient(lh.local_address(), token=LLAMA, job="llama") as c:
            assert c.inject({"kind": "nan-grad", "replica": "llama_0"})[1] == "llama_0"
        r = http.post("/inject", json={"kind": "lighthouse-restart"}, headers=_bearer(OPERATOR))
        assert r.status_code == 409 and "cannot restart itself" in r.text  # past the gate; embedded: no restart
        assert [i["kind"] for i in _pending(lh)["torchft_0"]] == ["slow"]
        assert [i["kind"] for i in _pending(lh, "llama")["llama_0"]] == ["nan-grad"]


def test_attack_injection_is_off_without_allow_inject(lighthouse, listeners, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    lh = lighthouse(token=OPERATOR, jobs=JOBS, http_bind="127.0.0.1:0")
    _victims(lh, listeners)
    with _http(lh) as http:
        events = _snapshot(http, "default")
        for headers in ({}, _bearer(OPERATOR)):  # not even the operator
            r = http.post("/inject", json={"kind": "lighthouse-restart"}, headers=headers)
            assert r.status_code == 403 and "--allow-inject" in r.text, r.text
        with LighthouseClient(lh.local_address(), token=OPERATOR) as c:
            with pytest.raises(ValueError, match="allow-inject"):
                c.inject({"kind": "kill", "replica": "torchft_0"})
        monkeypatch.setenv("RALLYPOINT_TOKEN", OPERATOR)
        assert main(["inject", "kill", "--replica", "torchft_0", "--lighthouse", lh.local_address()]) == 1
        err = capsys.readouterr().err
        assert "refused by the lighthouse" in err and "--allow-inject" in err, err
        assert _rejected(http, "inject_refused") == 4
        assert _snapshot(http, "default") == events and _pending(lh) == {}


def test_a_manager_drops_injections_unless_turned_on() -> None:
    """Whoever answers a group's quorum (a lighthouse turned on, or one impersonated) cannot
    make a Manager corrupt a gradient unless its own operator set RALLYPOINT_ALLOW_INJECT=1."""
    import torch

    off = Injector("r", dict, threading.Event())
    off.add([Injection("1", "nan-grad")])
    assert off.at_step_start(1, None) == {}
    g = torch.ones(3)
    assert off.on_collective(g) is None and torch.equal(g, torch.ones(3))
    on = Injector("r", dict, threading.Event(), allowed=True)
    on.add([Injection("1", "nan-grad")])
    assert on.at_step_start(1, None) == {"injected": ["nan-grad"]}
    on.on_collective(g)
    assert torch.isnan(g[0])


# ------------------------------------------------------------------ 8: token handling
def _start(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Any, Path]:
    log = tmp_path / "lighthouse.log"
    child_env = {k: v for k, v in os.environ.items() if k not in ("RALLYPOINT_TOKEN", "RALLYPOINT_ALLOW_INJECT")}
    proc = subprocess.Popen([sys.executable, "-m", "rallypoint", "lighthouse", "--min-replicas", "1",
                             "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0", "--join-timeout-ms", "100",
                             "--state", str(tmp_path / "lh.db"), *args], stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, cwd=ROOT, env={**child_env, **(env or {})})
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout or ():
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines, log


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc/PID/cmdline")
def test_attack_token_from_argv_and_restart_log(tmp_path: Path) -> None:
    """``--token`` warns; a restart runs a command line without it (the token moves to the
    environment) and logs neither the command line nor the token; the restarted lighthouse
    still asks for it; ``/openapi.json`` answers nobody."""
    proc, lines, log = _start(tmp_path, "--token", OPERATOR, "--allow-inject")
    try:
        first = json.loads(lines.get(timeout=30))
        with LighthouseClient(first["lighthouse"], token=OPERATOR) as c:
            q1 = c.quorum("solo", timeout=T, step=1).quorum_id
        with httpx.Client(base_url=first["http"], timeout=T) as http:
            for headers in ({}, _bearer(OPERATOR)):
                assert http.get("/openapi.json", headers=headers).status_code == 404
            r = http.post("/inject", json={"kind": "lighthouse-restart"})
            assert r.status_code == 401  # no token: not even admitted to the (closed) default job
        with LighthouseClient(first["lighthouse"], token=OPERATOR) as c:
            c.inject({"kind": "lighthouse-restart"})
        again = json.loads(lines.get(timeout=30))
        assert proc.poll() is None and again["lighthouse"] == first["lighthouse"]
        assert OPERATOR not in _cmdline(proc.pid)  # the same pid, a command line without the token
        with LighthouseClient(again["lighthouse"], token=OPERATOR) as c:
            assert c.quorum("solo", timeout=T, step=2).quorum_id == q1
        with LighthouseClient(again["lighthouse"]) as c:
            with pytest.raises(Exception, match="(?i)token"):
                c.status()
    finally:
        proc.kill()
        proc.wait(10)
    text = log.read_text()
    assert "--token puts the token on the command line" in text and "restarting the lighthouse" in text, text
    assert OPERATOR not in text and "--min-replicas" not in text, text  # no token, no argv


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc/PID/cmdline")
def test_token_file_keeps_the_token_out_of_argv_and_logs(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(OPERATOR + "\n")
    f.chmod(0o600)
    proc, lines, log = _start(tmp_path, "--token-file", str(f))
    try:
        first = json.loads(lines.get(timeout=30))
        assert OPERATOR not in _cmdline(proc.pid)
        with LighthouseClient(first["lighthouse"], token=OPERATOR) as c:
            c.quorum("solo", timeout=T, step=1)
        with LighthouseClient(first["lighthouse"], token="guess") as c:
            with pytest.raises(Exception, match="(?i)token"):
                c.status()
        with httpx.Client(base_url=first["http"], timeout=T) as http:
            assert http.get("/status").status_code == 401
            assert http.get("/status", headers=_bearer(OPERATOR)).status_code == 200
    finally:
        proc.kill()
        proc.wait(10)
    text = log.read_text()
    assert OPERATOR not in text and "--token puts" not in text, text
