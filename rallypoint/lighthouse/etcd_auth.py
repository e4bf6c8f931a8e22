"""TLS and user/password authentication for the lighthouse's etcd connection.

Why: whoever can write the lighthouse's keys in etcd decides who leads (``<prefix>/leader``)
and which quorum id comes next (``quorum_id``): an open etcd is an open lighthouse. So the
etcd state backend speaks TLS (``--etcd-ca``, and ``--etcd-cert``/``--etcd-key`` for an etcd
that demands client certificates) and authenticates as an etcd user (``--etcd-user`` with
``--etcd-password-file``; a password never goes on the command line). Each flag has an
environment twin (``RALLYPOINT_ETCD_CA``, ``..._CERT``, ``..._KEY``, ``..._USER``,
``..._PASSWORD_FILE``).

The rules (:func:`check_etcd_security`, a pure function):

* ``--require-tls`` refuses a clear-text etcd connection (no ``--etcd-ca``/``--etcd-cert``):
  the lighthouse does not start.
* a certificate without its key (or the reverse), a user without a password (or the
  reverse) is an error;
* a password sent in clear text to an etcd that is not on loopback is a warning.

The client is ``aetcd``, which only dials in clear text: :func:`make_client` gives it a
TLS channel when the settings ask for one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint._net.addr import is_loopback
from rallypoint._net.tls import REQUIRE_ENV, _read_pem, setting

log = logging.getLogger("rallypoint.lighthouse.etcd")

CA_ENV = "RALLYPOINT_ETCD_CA"
CERT_ENV = "RALLYPOINT_ETCD_CERT"
KEY_ENV = "RALLYPOINT_ETCD_KEY"
USER_ENV = "RALLYPOINT_ETCD_USER"
PASSWORD_FILE_ENV = "RALLYPOINT_ETCD_PASSWORD_FILE"
#: Longest password file read (etcd passwords are short; anything bigger is a wrong path).
MAX_PASSWORD_BYTES = 4096


class EtcdSecurityError(ValueError):
    """An etcd security setting that cannot work, or clear text where TLS is required;
    the message names the flag."""


@dataclass(frozen=True)
class EtcdSecurity:
    """How the lighthouse connects to etcd: PEM bytes of the CA that signed etcd's
    certificate and of its own client certificate and key, and the etcd user."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        """Whether etcd is dialled over TLS."""
        return self.ca is not None or self.cert is not None

    def credentials(self) -> Any:
        """gRPC channel credentials for a TLS connection (the system's CAs without ``ca``)."""
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _read_password(path: str, source: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PASSWORD_BYTES + 1)
    except OSError as e:
        raise EtcdSecurityError(f"{source}={path!r} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_PASSWORD_BYTES:
        raise EtcdSecurityError(f"{source}={path!r} is over {MAX_PASSWORD_BYTES} bytes: not a password file")
    text = raw.decode("utf-8", "replace").rstrip("\r\n")
    if not text or "\n" in text:
        raise EtcdSecurityError(f"{source}={path!r} must hold the password on one line (it is empty or has several)")
    return text


def etcd_security(ca: str | None = None, cert: str | None = None, key: str | None = None,
                  user: str | None = None, password_file: str | None = None,
                  environ: Mapping[str, str] | None = None) -> EtcdSecurity:
    """The etcd connection settings: each argument if given, else its environment
    variable. Files are read now, so a bad path fails at start-up naming the setting."""
    env = os.environ if environ is None else environ

    def pick(value: str | None, name: str, flag: str) -> tuple[str | None, str]:
        return setting(value, env, name, flag)

    ca_p, ca_src = pick(ca, CA_ENV, "--etcd-ca")
    cert_p, cert_src = pick(cert, CERT_ENV, "--etcd-cert")
    key_p, key_src = pick(key, KEY_ENV, "--etcd-key")
    user_v, user_src = pick(user, USER_ENV, "--etcd-user")
    pw_p, pw_src = pick(password_file, PASSWORD_FILE_ENV, "--etcd-password-file")
    if (cert_p is None) != (key_p is None):
        given, missing = (cert_src, key_src) if cert_p is not None else (key_src, cert_src)
        raise EtcdSecurityError(f"{given} is set but {missing} is not: an etcd client certificate needs its key")
    if (user_v is None) != (pw_p is None):
        given, missing = (user_src, pw_src) if user_v is not None else (pw_src, user_src)
        raise EtcdSecurityError(f"{given} is set but {missing} is not: etcd authentication needs both")
    try:
        return EtcdSecurity(
            ca=_read_pem(ca_p, ca_src) if ca_p else None,
            cert=_read_pem(cert_p, cert_src) if cert_p else None,
            key=_read_pem(key_p, key_src) if key_p else None,
            user=user_v,
            password=_read_password(pw_p, pw_src) if pw_p else None,
        )
    except ValueError as e:  # TlsError: a missing or unreadable PEM file
        raise EtcdSecurityError(str(e)) from None


def check_etcd_security(endpoints: Sequence[tuple[str, int]], sec: EtcdSecurity, require_tls: bool) -> str | None:
    """Refuse (EtcdSecurityError) clear text to etcd when TLS is required; a warning (the
    text, or None) for a password that would cross the network in clear text."""
    where = ", ".join(f"{h}:{p}" for h, p in endpoints)
    if sec.tls:
        return None
    if require_tls:
        raise EtcdSecurityError(
            f"TLS is required (--require-tls / {REQUIRE_ENV}) but the etcd state backend ({where}) would be "
            f"dialled in plain http: pass --etcd-ca (and --etcd-cert/--etcd-key if etcd demands client "
            f"certificates), or {CA_ENV}")
    remote = [h for h, _ in endpoints if not is_loopback(h)]
    if sec.user is not None and remote:
        return (f"the etcd password of user {sec.user!r} crosses the network to {', '.join(remote)} in clear "
                f"text: pass --etcd-ca to reach etcd over TLS")
    return None


def make_client(host: str, port: int, sec: EtcdSecurity | None, timeout: float) -> Any:
    """An ``aetcd.Client`` for ``host:port`` with ``sec``'s user and, when ``sec.tls``,
    a TLS channel."""
    import aetcd

    sec = sec or EtcdSecurity()
    kw: dict[str, Any] = {"username": sec.user, "password": sec.password, "timeout": timeout}
    if not sec.tls:
        return aetcd.Client(host=host, port=port, **kw)
    return _tls_client_class()(host=host, port=port, credentials=sec.credentials(), **kw)


_TLS_CLIENT: Any = None


def _tls_client_class() -> Any:
    """``aetcd.Client`` whose ``connect`` opens a TLS channel (aetcd 1.x only has clear
    text); otherwise as aetcd's own ``connect``."""
    global _TLS_CLIENT
    if _TLS_CLIENT is not None:
        return _TLS_CLIENT
    import aetcd
    from aetcd import rpc, watcher
    from aetcd.client import _handle_errors

    class TlsClient(aetcd.Client):  # type: ignore[misc]
        def __init__(self, *args: Any, credentials: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._credentials = credentials

        @_handle_errors  # type: ignore[misc]
        async def connect(self) -> None:
            if self._connected.is_set():
                return
            if self._is_connecting:  # type: ignore[has-type]
                import asyncio

                await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
                return
            try:
                self._is_connecting = True
                target = f"{self._host}:{self._port}"
                self.channel = rpc.secure_channel(target, self._credentials, options=self._options.items())
                if self._username is not None and self._password is not None:
                    self.auth_stub = rpc.AuthStub(self.channel)
                    resp = await self.auth_stub.Authenticate(
                        rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                    self.metadata = (("token", resp.token),)
                self.kvstub = rpc.KVStub(self.channel)
                self.clusterstub = rpc.ClusterStub(self.channel)
                self.leasestub = rpc.LeaseStub(self.channel)
                self.maintenancestub = rpc.MaintenanceStub(self.channel)
                self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                                metadata=self.metadata)
                self._connected.set()
            finally:
                self._is_connecting = False

    _TLS_CLIENT = TlsClient
    return TlsClient


def refused_credentials(error: BaseException) -> bool:
    """Whether an etcd call failed because etcd refused who we are (a wrong user or
    password, or no permission): retrying another endpoint will not help."""
    text = str(error).lower()
    return any(s in text for s in ("authentication failed", "permission denied", "user name is empty",
                                   "user name not found"))


def stale_token(error: BaseException) -> bool:
    """Whether an etcd call was refused because our auth token expired (etcd's
    ``--auth-token-ttl``, or a restarted member forgot it) or predates a change of users:
    etcd refused it before applying anything, so authenticating again and repeating the
    call is safe, even for a transaction."""
    text = str(error).lower()
    return "invalid auth token" in text or "revision of auth store is old" in text


__all__ = ["CA_ENV", "CERT_ENV", "KEY_ENV", "PASSWORD_FILE_ENV", "USER_ENV", "EtcdSecurity", "EtcdSecurityError",
           "check_etcd_security", "etcd_security", "make_client", "refused_credentials", "stale_token"]
