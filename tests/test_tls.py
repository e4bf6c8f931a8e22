"""TLS (issue 13, item 3): the lighthouse (gRPC and HTTP), the manager servers and the
checkpoint server serve TLS from one configuration; clients verify them against the
job's CA; mutual TLS refuses a client without a certificate; ``--require-tls`` refuses
to start without one; and a two-group training run over TLS with a token survives a
kill and a heal with identical parameters.

Certificates are made at run time with ``trustme`` (a test extra): a CA, and one
certificate per "host" valid for localhost, 127.0.0.1, ::1 and this machine's name
(the address a wildcard-bound server advertises), usable as server and client.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import httpx
import pytest

trustme = pytest.importorskip("trustme", reason="trustme (a test extra: pip install -e '.[test]') makes the certificates")

from rallypoint._net import tls as tlsmod  # noqa: E402
from rallypoint._net.tls import TlsConfig, TlsError, tls_config  # noqa: E402
from rallypoint._proto import torchft_pb2 as pb  # noqa: E402
from rallypoint.lighthouse.client import LighthouseClient  # noqa: E402
from rallypoint.lighthouse.server import LighthouseServer  # noqa: E402

TOKEN = "tls-test-token"
TEN = timedelta(seconds=10)


@dataclass
class Pki:
    ca: str
    cert: str
    key: str
    other_ca: str  # a CA that signed nothing of ours
    other_cert: str  # a client certificate from that other CA
    other_key: str

    def server(self, mutual: bool = False) -> TlsConfig:
        return tls_config(self.cert, self.key, self.ca, self.ca if mutual else None, environ={})

    def client(self, with_cert: bool = True) -> TlsConfig:
        if with_cert:
            return tls_config(self.cert, self.key, self.ca, environ={})
        return tls_config(ca=self.ca, environ={})

    def env(self, mutual: bool = False) -> dict[str, str]:
        env = {tlsmod.CERT_ENV: self.cert, tlsmod.KEY_ENV: self.key, tlsmod.CA_ENV: self.ca}
        if mutual:
            env[tlsmod.CLIENT_CA_ENV] = self.ca
        return env


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1", "::1", socket.gethostname())
    stranger = other.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    leaf.private_key_pem.write_to_path(str(d / "key.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    for extra in leaf.cert_chain_pems[1:]:
        extra.write_to_path(str(d / "cert.pem"), append=True)
    stranger.private_key_pem.write_to_path(str(d / "other-key.pem"))
    stranger.cert_chain_pems[0].write_to_path(str(d / "other-cert.pem"))
    return Pki(str(d / "ca.pem"), str(d / "cert.pem"), str(d / "key.pem"), str(d / "other-ca.pem"),
               str(d / "other-cert.pem"), str(d / "other-key.pem"))


# ---------------------------------------------------------------- configuration (table tests)


@pytest.mark.parametrize("kwargs, message", [
    ({"cert": "CERT"}, "--tls-cert is set but --tls-key (RALLYPOINT_TLS_KEY) is not"),
    ({"key": "KEY"}, "--tls-key is set but --tls-cert (RALLYPOINT_TLS_CERT) is not"),
    ({"client_ca": "CA"}, "mutual TLS) needs a server certificate"),
    ({"cert": "/nonexistent/cert.pem", "key": "KEY"}, "--tls-cert='/nonexistent/cert.pem' cannot be read"),
    ({"ca": "NOTPEM"}, "is not a PEM file"),
])
def test_bad_settings_are_clear_errors(pki: Pki, tmp_path: Path, kwargs: dict, message: str) -> None:
    notpem = tmp_path / "not.pem"
    notpem.write_text("hello")
    swap = {"CERT": pki.cert, "KEY": pki.key, "CA": pki.ca, "NOTPEM": str(notpem)}
    kwargs = {k: swap.get(v, v) for k, v in kwargs.items()}
    with pytest.raises(TlsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tls_config(environ={}, **kwargs)


@pytest.mark.parametrize("raw, expected", [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)])
def test_require_flag_from_the_environment(raw: str, expected: bool) -> None:
    assert tls_config(environ={tlsmod.REQUIRE_ENV: raw}).require is expected


def test_require_flag_rejects_nonsense() -> None:
    with pytest.raises(TlsError, match="RALLYPOINT_REQUIRE_TLS='maybe'"):
        tls_config(environ={tlsmod.REQUIRE_ENV: "maybe"})


def test_environment_is_read(pki: Pki) -> None:
    cfg = tls_config(environ=pki.env(mutual=True))
    assert cfg.serving and cfg.mutual and cfg.scheme() == "https"
    assert cfg.client_tls("http://x:1")  # a CA is set: the job runs TLS, whatever the spelling
    plain = tls_config(environ={})
    assert not plain.serving and not plain.client_tls("http://x:1") and plain.client_tls("https://x:1")


def test_oversized_pem_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.pem"
    big.write_bytes(b"-----BEGIN CERTIFICATE-----\n" + b"A" * (tlsmod.MAX_PEM_BYTES + 1))
    with pytest.raises(TlsError, match="over 1048576 bytes is refused"):
        tls_config(ca=str(big), environ={})


# ---------------------------------------------------------------- the lighthouse


def _quorum(lh_addr: str, tls: TlsConfig, rid: str = "r0") -> int:
    with LighthouseClient(lh_addr, connect_timeout=5.0, token=TOKEN, tls=tls) as c:
        return c.quorum(rid, timeout=10.0).quorum_id


def test_lighthouse_serves_grpc_and_http_over_tls(pki: Pki) -> None:
    lh = LighthouseServer(bind="127.0.0.1:0", http_bind="127.0.0.1:0", token=TOKEN, tls=pki.server())
    try:
        assert lh.address().startswith("https://") and lh.http_address().startswith("https://")  # type: ignore[union-attr]
        assert _quorum(lh.local_address(), pki.client(with_cert=False)) >= 1
        ctx = tlsmod.client_ssl_context(pki.client(with_cert=False))
        r = httpx.get(f"{lh.http_address()}/status", headers={"authorization": f"Bearer {TOKEN}"}, verify=ctx, timeout=5)
        assert r.status_code == 200 and r.json()["quorum"]["members"][0]["replica_id"] == "r0"
        assert httpx.get(f"{lh.http_address()}/status", verify=ctx, timeout=5).status_code == 401
        # Clear text to a TLS port gets nothing, over either protocol.
        with pytest.raises(ConnectionError):
            LighthouseClient(lh.local_address().replace("https", "http"), connect_timeout=1.0, tls=tls_config(environ={}))
        with pytest.raises(httpx.HTTPError):
            httpx.get(lh.http_address().replace("https", "http") + "/healthz", timeout=3)  # type: ignore[union-attr]
        # A client that trusts another CA refuses the server (the handshake fails).
        with pytest.raises(ConnectionError):
            LighthouseClient(lh.local_address(), connect_timeout=1.0, tls=tls_config(ca=pki.other_ca, environ={}))
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{lh.http_address()}/healthz", verify=tlsmod.client_ssl_context(tls_config(ca=pki.other_ca, environ={})),
                      timeout=3)
        assert lh.status()["quorum_id"] == 1, "nothing the refused clients sent changed the lighthouse"
    finally:
        lh.shutdown()


def test_mutual_tls_refuses_a_client_without_a_certificate(pki: Pki) -> None:
    lh = LighthouseServer(bind="127.0.0.1:0", http_bind="127.0.0.1:0", tls=pki.server(mutual=True))
    try:
        assert _quorum(lh.local_address(), pki.client(with_cert=True)) >= 1
        with pytest.raises(ConnectionError):  # no client certificate
            LighthouseClient(lh.local_address(), connect_timeout=1.0, tls=pki.client(with_cert=False))
        stranger = tls_config(pki.other_cert, pki.other_key, pki.ca, environ={})
        with pytest.raises(ConnectionError):  # a client certificate from another CA
            LighthouseClient(lh.local_address(), connect_timeout=1.0, tls=stranger)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{lh.http_address()}/healthz", verify=tlsmod.client_ssl_context(pki.client(with_cert=False)),
                      timeout=3).raise_for_status()
        ok = httpx.get(f"{lh.http_address()}/healthz", verify=tlsmod.client_ssl_context(pki.client()), timeout=3)
        assert ok.status_code == 200
    finally:
        lh.shutdown()


def test_require_tls_refuses_to_start_without_a_certificate(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="TLS is required"):
        LighthouseServer(bind="127.0.0.1:0", tls=TlsConfig(require=True))
    env = {**os.environ, "RALLYPOINT_TOKEN": TOKEN}
    for k in (tlsmod.CERT_ENV, tlsmod.KEY_ENV):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "rallypoint", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
                        "--http-bind", "off", "--state", ":memory:", "--require-tls"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "TLS is required" in p.stderr and "--tls-cert" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_lighthouse_with_tls_flags(pki: Pki) -> None:
    """``rallypoint lighthouse --tls-cert --tls-key`` as a user starts it; ``rallypoint
    status`` with RALLYPOINT_TLS_CA and the token reads it over TLS."""
    env = {**os.environ, "RALLYPOINT_TOKEN": TOKEN}
    p = subprocess.Popen([sys.executable, "-m", "rallypoint", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
                          "--http-bind", "127.0.0.1:0", "--state", ":memory:", "--tls-cert", pki.cert, "--tls-key", pki.key,
                          "--require-tls"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = json.loads(p.stdout.readline())
        assert line["local"].startswith("https://") and line["http"].startswith("https://")
        _quorum(line["local"], pki.client(with_cert=False))
        st = subprocess.run([sys.executable, "-m", "rallypoint", "status", "--lighthouse", line["http"], "--json"],
                            env={**env, tlsmod.CA_ENV: pki.ca}, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["quorum"]["members"][0]["replica_id"] == "r0"
    finally:
        p.terminate()
        try:
            p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate(timeout=5)


def test_a_token_in_clear_text_on_the_network_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rallypoint.tls"):
        lh = LighthouseServer(bind="0.0.0.0:0", token=TOKEN, tls=tls_config(environ={}))
        lh.shutdown()
    assert any("token crosses the network in clear text" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rallypoint.tls"):
        lh = LighthouseServer(bind="127.0.0.1:0", token=TOKEN, tls=tls_config(environ={}))
        lh.shutdown()
    assert not any("clear text" in r.getMessage() for r in caplog.records), "loopback is not the network"


# ---------------------------------------------------------------- manager server and checkpoint server


def test_a_tls_manager_server_serves_no_plain_vote_socket(pki: Pki) -> None:
    """The vote socket is plain TCP: over TLS, ranks > 0 keep voting over gRPC (TLS), and the
    answers name no socket, so no vote leaves the encrypted channel."""
    import concurrent.futures as cf

    from rallypoint.manager.client import ManagerClient
    from rallypoint.manager.server import ManagerServer

    lh = LighthouseServer(bind="127.0.0.1:0", token=TOKEN, tls=pki.server(mutual=True))
    ms = ManagerServer("g0", lh.local_address(), "localhost", "127.0.0.1:0", "store:1", world_size=2, token=TOKEN,
                       tls=pki.server(mutual=True))
    try:
        assert ms._vote_socket is None
        with (ManagerClient(ms.address(), connect_timeout=TEN, token=TOKEN, tls=pki.client()) as c,
              ManagerClient(ms.address(), connect_timeout=TEN, token=TOKEN, tls=pki.client()) as c1,
              cf.ThreadPoolExecutor(2) as pool):
            for step in (1, 2):  # after the first answer a client would have learnt a named socket
                votes = [pool.submit(c.should_commit, 0, step, True, TEN),
                         pool.submit(c1.should_commit, 1, step, True, TEN)]
                assert [f.result(timeout=30) for f in votes] == [True, True]
            # Both sides refuse: the server has no socket to name, a TLS client would not use one.
            assert ms._vote_socket is None
            assert not c._fast_allowed and not c1._fast_allowed and c._fast is None and c1._fast is None
    finally:
        ms.shutdown()
        lh.shutdown()


def test_manager_server_over_mutual_tls(pki: Pki) -> None:
    from rallypoint.manager.client import ManagerClient
    from rallypoint.manager.server import ManagerServer

    lh = LighthouseServer(bind="127.0.0.1:0", token=TOKEN, tls=pki.server(mutual=True))
    kills: list[str] = []
    ms = ManagerServer("g0", lh.local_address(), "localhost", "127.0.0.1:0", "store:1", world_size=1, token=TOKEN,
                       tls=pki.server(mutual=True), on_kill=kills.append)
    try:
        assert ms.address().startswith("https://localhost:")
        with ManagerClient(ms.address(), connect_timeout=TEN, token=TOKEN, tls=pki.client()) as c:
            q = c._quorum(0, 0, "meta", False, TEN)
            assert q.replica_ids == ["g0"]
            assert c.should_commit(0, 0, True, TEN) is True
        # The lighthouse forwards a kill to the manager over mutual TLS too.
        with LighthouseClient(lh.local_address(), connect_timeout=5.0, token=TOKEN, tls=pki.client()) as lc:
            assert lc.kill("g0", "maintenance", timeout=10.0) == ms.address()
        assert kills == ["maintenance"]
        with pytest.raises(ConnectionError):
            ManagerClient(ms.address(), connect_timeout=1.0, token=TOKEN, tls=pki.client(with_cert=False))
        ch = grpc.insecure_channel(ms.address().split("://")[1])
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/torchft.ManagerService/Kill", request_serializer=pb.KillRequest.SerializeToString,
                           response_deserializer=pb.KillResponse.FromString)(pb.KillRequest(msg="x"), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()
    finally:
        ms.shutdown()
        lh.shutdown()


def test_checkpoint_server_over_tls(pki: Pki) -> None:
    import torch

    from rallypoint.transports import HTTPTransport
    from rallypoint.transports._http_util import TransferError

    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": 7}
    sender = HTTPTransport(bind="127.0.0.1:0", token=TOKEN, tls=pki.server(mutual=True), num_chunks=2)
    receiver = HTTPTransport(bind="127.0.0.1:0", token=TOKEN, tls=pki.client(), num_chunks=2)
    stranger = HTTPTransport(bind="127.0.0.1:0", token=TOKEN, tls=pki.client(with_cert=False), num_chunks=2)
    plain = HTTPTransport(bind="127.0.0.1:0", token=TOKEN, tls=tls_config(environ={}), num_chunks=2)
    try:
        assert sender.metadata().startswith("https://")
        sender.send_checkpoint([1], 3, state, TEN)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, TEN)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 7
        with pytest.raises(TransferError):  # no client certificate: mutual TLS refuses it
            stranger.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=3))
        with pytest.raises(TransferError):  # https with the system CAs only: our CA is unknown
            plain.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=3))
    finally:
        for t in (sender, receiver, stranger, plain):
            t.shutdown()


def test_tls_connections_that_never_handshake_cannot_lock_a_receiver_out(pki: Pki) -> None:
    """Every slot of a TLS checkpoint server held by clients that connect and never start
    the handshake: a receiver with the certificate and the token still heals."""
    import time

    import torch

    from rallypoint.transports import HTTPTransport

    class Capped(HTTPTransport):
        MAX_CONNECTIONS = 4

    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    sender = Capped(bind="127.0.0.1:0", token=TOKEN, tls=pki.server(mutual=True), num_chunks=2)
    receiver = HTTPTransport(bind="127.0.0.1:0", token=TOKEN, tls=pki.client(), num_chunks=2)
    held: list[socket.socket] = []
    try:
        sender.send_checkpoint([1], 3, state, TEN)
        held = [socket.create_connection(("127.0.0.1", sender.port), timeout=5) for _ in range(Capped.MAX_CONNECTIONS)]
        deadline = time.monotonic() + 5
        while len(sender._server._conns) < Capped.MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)  # the acceptor registers them; there is no event to await
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, TEN)
        assert torch.equal(got["w"], state["w"])
    finally:
        for s in held:
            s.close()
        sender.shutdown()
        receiver.shutdown()


def test_require_tls_refuses_a_clear_text_source(pki: Pki) -> None:
    from rallypoint.transports import HTTPTransport
    from rallypoint.transports._http_util import TransferError

    receiver = HTTPTransport(bind="127.0.0.1:0", tls=TlsConfig(require=True, cert=b"x", key=b"x", cert_path=pki.cert,
                                                              key_path=pki.key))
    try:
        with pytest.raises(TransferError, match="TLS is required"):
            receiver.recv_checkpoint(0, "http://127.0.0.1:1", 3, timedelta(seconds=2))
    finally:
        receiver.shutdown()


# ---------------------------------------------------------------- a training run over TLS


@pytest.mark.slow
def test_two_groups_over_mutual_tls_with_a_token_kill_and_heal(pki: Pki, lighthouse, replicas_factory,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Three replica groups (plain python processes), every socket over mutual TLS with the
    job token: one is SIGKILLed mid-allreduce, the survivors go on, it comes back, heals
    over HTTPS from a peer, and all end at the same step with identical parameters."""
    from test_manager_faults import run_kill_and_rejoin

    for k, v in {**pki.env(mutual=True), "RALLYPOINT_TOKEN": TOKEN, tlsmod.REQUIRE_ENV: "1"}.items():
        monkeypatch.setenv(k, v)
    made = []

    def tls_lighthouse(**kw):  # the fixture's server, which reads the env like every other part
        lh = lighthouse(**kw)
        assert lh.address().startswith("https://")
        made.append(lh)
        return lh

    r = run_kill_and_rejoin(tls_lighthouse, replicas_factory, [{"at": "mid_allreduce", "step": 3}])
    logs = "".join(f.read_text() for f in sorted(r.tmp.glob("*.log")))  # whole files: r.logs() keeps tails
    assert "healing to step" in logs and "https://" in logs, logs[-3000:]
    assert made[0].status()["quorum"] is not None
