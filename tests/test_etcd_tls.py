"""Issue 37, attack 6: etcd had no TLS and no credentials, and ``--require-tls`` ignored it,
so whoever reached etcd could hold ``<prefix>/leader`` or roll ``quorum_id`` back.

The etcd state backend now speaks TLS (``--etcd-ca``, ``--etcd-cert``/``--etcd-key``) and
authenticates as an etcd user (``--etcd-user``, ``--etcd-password-file``); ``--require-tls``
refuses a clear-text etcd. The live tests run a real etcd (tests/etcd_cluster.py) serving
https only, demanding client certificates (trustme's) and with authentication on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from etcd_cluster import EtcdTls, etcd_cluster  # noqa: F401  (fixture)

from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.etcd_auth import (EtcdSecurity, EtcdSecurityError, check_etcd_security, etcd_security,
                                             make_client)
from rallypoint.lighthouse.etcd_state import EtcdUnavailable
from rallypoint.lighthouse.server import LighthouseServer

PREFIX = "/rallypoint/"
LOCAL = ((("127.0.0.1", 2379),))
REMOTE = ((("etcd.example", 2379), ("127.0.0.1", 2379)))
TLS = EtcdSecurity(ca=b"-----BEGIN CERTIFICATE-----")
USER = EtcdSecurity(user="lh", password="pw")


# ------------------------------------------------------------------ the pure rules


@pytest.mark.parametrize("endpoints, sec, require, error, warning", [
    (LOCAL, EtcdSecurity(), False, None, None),                     # as before: clear text allowed
    (LOCAL, EtcdSecurity(), True, "etcd state backend .* plain http: pass --etcd-ca", None),
    (REMOTE, USER, True, "TLS is required", None),
    (REMOTE, TLS, True, None, None),
    (LOCAL, EtcdSecurity(cert=b"c", key=b"k"), True, None, None),   # a client certificate means TLS too
    (REMOTE, USER, False, None, "password of user 'lh' crosses the network to etcd.example in clear text"),
    (LOCAL, USER, False, None, None),                               # loopback: no warning
    (REMOTE, EtcdSecurity(ca=b"x", user="lh", password="pw"), False, None, None),
])
def test_check_etcd_security(endpoints: Any, sec: EtcdSecurity, require: bool, error: str | None,
                             warning: str | None) -> None:
    if error:
        with pytest.raises(EtcdSecurityError, match=error):
            check_etcd_security(endpoints, sec, require)
        return
    got = check_etcd_security(endpoints, sec, require)
    assert (got is None) if warning is None else (got is not None and warning in got), got


@pytest.fixture
def pki(tmp_path: Path) -> EtcdTls:
    pytest.importorskip("trustme", reason="trustme (a test extra) makes the certificates")
    return EtcdTls.make(tmp_path / "pki")


def _password_file(tmp_path: Path, text: str) -> str:
    p = tmp_path / "pw"
    p.write_text(text)
    return str(p)


def test_etcd_security_reads_flags_and_environment(tmp_path: Path, pki: EtcdTls) -> None:
    pw = _password_file(tmp_path, "s3cret\n")
    sec = etcd_security(str(pki.ca), str(pki.client_cert), str(pki.client_key), "lh", pw, environ={})
    assert sec.tls and sec.user == "lh" and sec.password == "s3cret" and sec.ca == pki.ca.read_bytes()
    assert "s3cret" not in repr(sec)
    env = {"RALLYPOINT_ETCD_CA": str(pki.ca), "RALLYPOINT_ETCD_USER": "u", "RALLYPOINT_ETCD_PASSWORD_FILE": pw}
    sec = etcd_security(environ=env)
    assert sec.ca == pki.ca.read_bytes() and sec.cert is None and sec.user == "u" and sec.password == "s3cret"
    assert etcd_security(environ={}) == EtcdSecurity()


@pytest.mark.parametrize("kw, env, error", [
    ({"cert": "CERT"}, {}, "--etcd-cert is set but --etcd-key"),
    ({}, {"RALLYPOINT_ETCD_KEY": "KEY"}, "RALLYPOINT_ETCD_KEY is set but --etcd-cert"),
    ({"user": "lh"}, {}, "--etcd-user is set but --etcd-password-file"),
    ({"password_file": "PW"}, {}, "--etcd-password-file is set but --etcd-user"),
    ({"ca": "/nonexistent/ca.pem"}, {}, "--etcd-ca='/nonexistent/ca.pem' cannot be read"),
    ({"user": "lh", "password_file": "EMPTY"}, {}, "one line"),
    ({"user": "lh", "password_file": "TWO"}, {}, "one line"),
])
def test_etcd_security_errors_name_the_setting(tmp_path: Path, pki: EtcdTls, kw: dict, env: dict, error: str) -> None:
    files = {"CERT": str(pki.client_cert), "KEY": str(pki.client_key), "PW": _password_file(tmp_path, "x"),
             "EMPTY": str(tmp_path / "empty"), "TWO": str(tmp_path / "two")}
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "two").write_text("a\nb\n")
    kw = {k: files.get(v, v) for k, v in kw.items()}
    env = {k: files.get(v, v) for k, v in env.items()}
    with pytest.raises(EtcdSecurityError, match=error):
        etcd_security(environ=env, **kw)


# ------------------------------------------------------------------ a real etcd with TLS and auth

ROOT_PW, LH_PW = "root-pw-1", "lighthouse-pw-2"


@pytest.fixture
def secured(etcd_cluster: Any, pki: EtcdTls) -> Any:
    cluster = etcd_cluster(members=1, tls=pki, root_password=ROOT_PW)
    cluster.add_user("lighthouse", LH_PW, PREFIX)
    return cluster


def _try(port: int, sec: EtcdSecurity | None, key: bytes = b"/rallypoint/probe") -> str:
    """Put and get ``key`` as ``sec``: "ok" or the error's text."""

    async def go() -> str:
        client = make_client("127.0.0.1", port, sec, 2.0)
        try:
            await asyncio.wait_for(client.put(key, b"x"), 4)
            got = await asyncio.wait_for(client.get(key), 4)
            return "ok" if got is not None and got.value == b"x" else f"read back {got!r}"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        finally:
            try:
                await asyncio.wait_for(client.close(), 4)
            except Exception:  # noqa: BLE001
                pass

    return asyncio.run(go())


def test_etcd_refuses_clients_without_the_certificate_or_the_password(secured: Any, pki: EtcdTls) -> None:
    port = secured.port(0)
    assert _try(port, pki.security(user="lighthouse", password=LH_PW)) == "ok"
    refused = {
        "plain http": _try(port, EtcdSecurity(user="lighthouse", password=LH_PW)),
        "no client certificate": _try(port, pki.security(client_cert=False, user="lighthouse", password=LH_PW)),
        "wrong password": _try(port, pki.security(user="lighthouse", password="guess")),
        "no user": _try(port, pki.security()),
        "outside its prefix": _try(port, pki.security(user="lighthouse", password=LH_PW), b"/other/leader"),
    }
    assert all(v != "ok" for v in refused.values()), refused
    assert "authentication failed" in refused["wrong password"], refused
    assert "permission denied" in refused["outside its prefix"].lower(), refused


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


def test_lighthouses_with_the_right_settings_lead_and_form_quorums(secured: Any, pki: EtcdTls) -> None:
    spec = secured.spec("/rallypoint/tls")
    sec = pki.security(user="lighthouse", password=LH_PW)
    a = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1, etcd=sec)
    b = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1, etcd=sec)
    c = None
    try:
        la, lb = a.leadership, b.leadership
        assert la is not None and lb is not None
        _wait(lambda: la.leads() or lb.leads(), 10, "a leader")
        (leader, standby), standby_leads = ((a, b), lb.leads) if la.leads() else ((b, a), la.leads)
        assert not standby_leads()
        c = LighthouseClient(f"{leader.local_address()},{standby.local_address()}", connect_timeout=5)
        ids = [c.quorum("r1", timeout=5, step=1).quorum_id, c.quorum("r1", timeout=5, step=2, commit_failures=1).quorum_id]
        assert ids == [1, 2], ids

        async def read(key: bytes) -> Any:
            client = make_client("127.0.0.1", secured.port(0), sec, 2.0)
            try:
                return await client.get(key)
            finally:
                await client.close()

        assert asyncio.run(read(b"/rallypoint/tls/quorum_id")).value == b"2"  # written through TLS and auth
        leader.shutdown()
        _wait(standby_leads, 10, "the standby to take over")
        assert c.quorum("r1", timeout=10, step=3, commit_failures=1).quorum_id == 3
    finally:
        if c is not None:
            c.close()
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("what", ["wrong password", "no client certificate", "plain http"])
def test_a_lighthouse_without_the_right_settings_does_not_start(secured: Any, pki: EtcdTls, what: str) -> None:
    sec = {
        "wrong password": pki.security(user="lighthouse", password="guess"),
        "no client certificate": pki.security(client_cert=False, user="lighthouse", password=LH_PW),
        "plain http": EtcdSecurity(user="lighthouse", password=LH_PW),
    }[what]
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailable) as e:
        LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=secured.spec("/rallypoint/bad"), etcd=sec,
                         startup_timeout=10)
    if what == "wrong password":
        assert "refused the lighthouse's credentials" in str(e.value) and "--etcd-password-file" in str(e.value)
        assert time.monotonic() - t0 < 3, "a refused password is not retried until the deadline"
    else:
        assert "unreachable" in str(e.value)


def test_require_tls_with_a_plain_http_etcd_is_a_startup_error(rallypoint_cli: Any, tmp_path: Path, pki: EtcdTls) -> None:
    """The command refuses before it binds or dials anything, naming the etcd endpoint and
    the flag to add; the same command with --etcd-ca gets past that check."""
    p = rallypoint_cli("lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off",
                       "--state", "etcd://127.0.0.1:9/rallypoint/x", "--require-tls",
                       "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    assert p.wait(30) == 2
    err = p.stderr_text()
    assert "TLS is required" in err and "127.0.0.1:9" in err and "plain http" in err and "--etcd-ca" in err, err
    with pytest.raises(EtcdSecurityError, match="plain http"):
        from rallypoint._net.tls import tls_config

        LighthouseServer(bind="127.0.0.1:0", state="etcd://127.0.0.1:9/rallypoint/x",
                         tls=tls_config(str(pki.server_cert), str(pki.server_key), require=True, environ={}),
                         etcd=EtcdSecurity())


def test_leadership_outlives_etcds_auth_token(etcd_cluster: Any, pki: EtcdTls) -> None:
    """etcd's auth tokens expire (``--auth-token-ttl``, 1 s here): a leader keeps leading
    and forming quorums well past it, and a standby still takes over."""
    cluster = etcd_cluster(members=1, tls=pki, root_password=ROOT_PW, extra_args=("--auth-token-ttl", "1"))
    cluster.add_user("lighthouse", LH_PW, PREFIX)
    sec = pki.security(user="lighthouse", password=LH_PW)
    spec = cluster.spec("/rallypoint/ttl")
    a = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1, etcd=sec)
    b = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, state=spec, ha_ttl_s=1, etcd=sec)
    c = None
    try:
        la, lb = a.leadership, b.leadership
        assert la is not None and lb is not None
        _wait(lambda: la.leads() or lb.leads(), 10, "a leader")
        (leader, standby), leads, standby_leads = ((a, b), la.leads, lb.leads) if la.leads() else ((b, a), lb.leads, la.leads)
        c = LighthouseClient(f"{leader.local_address()},{standby.local_address()}", connect_timeout=5)
        ids = []
        for step in range(4):
            ids.append(c.quorum("r1", timeout=5, step=step, commit_failures=1).quorum_id)
            time.sleep(1.5)  # longer than the token's TTL, with no call of ours in between
            assert leads(), f"lost leadership after step {step}"
        leader.shutdown()
        _wait(standby_leads, 10, "the standby to take over")
        ids.append(c.quorum("r1", timeout=10, step=9, commit_failures=1).quorum_id)
        assert ids == [1, 2, 3, 4, 5], ids
    finally:
        if c is not None:
            c.close()
        a.shutdown()
        b.shutdown()


def test_the_command_takes_the_etcd_flags_and_leads(secured: Any, pki: EtcdTls, cli_lighthouse: Any,
                                                    tmp_path: Path) -> None:
    """``rallypoint lighthouse --etcd-ca/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file``
    (flags, not the environment) against the secured etcd: it leads and forms quorums."""
    pw = _password_file(tmp_path, LH_PW + "\n")
    lh = cli_lighthouse(state=secured.spec("/rallypoint/cli"), extra=[
        "--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert), "--etcd-key", str(pki.client_key),
        "--etcd-user", "lighthouse", "--etcd-password-file", pw, "--etcd-ttl-s", "1"])
    c = LighthouseClient(lh.address, connect_timeout=10)
    got: list[int] = []

    def quorum() -> bool:  # a standby (UNAVAILABLE) until it wins the election
        try:
            got.append(c.quorum("r1", timeout=5, step=1).quorum_id)
            return True
        except ConnectionError:
            return False

    try:
        _wait(quorum, 15, "the command's lighthouse to lead and answer")
        assert got == [1]
    finally:
        c.close()
    assert LH_PW not in " ".join(lh.proc.rest_of_stdout(0.1)) + lh.proc.stderr_text()
