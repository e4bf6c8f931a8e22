"""TLS for every socket rallypoint opens: one configuration (``--tls-cert/--tls-key``,
``RALLYPOINT_TLS_*``), turned into gRPC credentials and ``ssl`` contexts for servers and
clients.

Why one place: the lighthouse, every ManagerServer and the checkpoint server are one job.
A job either runs TLS everywhere or nowhere; a client that guessed per connection would
fall back to clear text exactly where an attacker wants it to.

The rules:

* A server serves TLS when it has a certificate and key. With a client CA it also
  demands a client certificate signed by that CA (mutual TLS).
* A client uses TLS when the job names a CA (``RALLYPOINT_TLS_CA``) or the address says
  ``https://``; it then verifies the server against that CA (the system's CAs without
  one) and the host name it dials. Its own certificate and key, when set, are presented
  as the client certificate (for mutual TLS), so one certificate per host serves both
  roles (it needs both the serverAuth and clientAuth key usages, or none).
* ``require`` (``--require-tls`` / ``RALLYPOINT_REQUIRE_TLS=1``): a server without a
  certificate refuses to start, and a client refuses a clear-text address.
* A token on a non-loopback bind without TLS is a warning: the token crosses the network
  in clear text.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import grpc

log = logging.getLogger("rallypoint.tls")

CERT_ENV = "RALLYPOINT_TLS_CERT"
KEY_ENV = "RALLYPOINT_TLS_KEY"
CA_ENV = "RALLYPOINT_TLS_CA"
CLIENT_CA_ENV = "RALLYPOINT_TLS_CLIENT_CA"
REQUIRE_ENV = "RALLYPOINT_REQUIRE_TLS"
#: A PEM file larger than this is not a certificate chain or a key (refused unread).
MAX_PEM_BYTES = 1 << 20

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class TlsError(ValueError):
    """A TLS setting that cannot work (a missing or unreadable file, a key without a
    certificate, clear text where TLS is required); the message names the setting."""


def _read_pem(path: str, source: str) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > MAX_PEM_BYTES:
            raise TlsError(f"{source}={path!r} is {size} bytes; a PEM file over {MAX_PEM_BYTES} bytes is refused")
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise TlsError(f"{source}={path!r} cannot be read: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{source}={path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def parse_bool(raw: str, source: str) -> bool:
    """An environment flag: 1/true/yes/on or 0/false/no/off/empty (ValueError otherwise)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise TlsError(f"{source}={raw!r} is not a yes/no value (use 1 or 0)")


@dataclass(frozen=True)
class TlsConfig:
    """The job's TLS settings (paths) and the PEM bytes read from them."""

    cert_path: str | None = None
    key_path: str | None = None
    ca_path: str | None = None
    client_ca_path: str | None = None
    require: bool = False
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    client_ca: bytes | None = None

    @property
    def serving(self) -> bool:
        """Whether a server with this configuration speaks TLS."""
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        """Whether servers demand a client certificate."""
        return self.client_ca is not None

    def client_tls(self, address: str) -> bool:
        """Whether a client dials ``address`` over TLS (a CA is set, or ``https://``)."""
        if self.ca is not None or address.strip().lower().startswith("https://"):
            return True
        if self.require:
            raise TlsError(
                f"TLS is required ({REQUIRE_ENV}) but {address!r} would be dialled in clear text: "
                f"set {CA_ENV} to the CA that signed the job's certificates, or use an https:// address"
            )
        return False

    def scheme(self) -> str:
        """The URL scheme a server with this configuration advertises."""
        return "https" if self.serving else "http"


def setting(value: str | None, env: Mapping[str, str], name: str, flag: str) -> tuple[str | None, str]:
    """A file setting given as a flag (``value``, when not None; empty means unset) or else
    by the environment variable ``name``, and how to name its source in an error message."""
    if value is not None:
        return (value or None), flag
    raw = env.get(name)
    return (raw or None), (name if raw else f"{flag} ({name})")


def tls_config(
    cert: str | None = None,
    key: str | None = None,
    ca: str | None = None,
    client_ca: str | None = None,
    require: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> TlsConfig:
    """The TLS configuration: each argument if given, else its ``RALLYPOINT_TLS_*``
    variable. Files are read (and size-checked) now, so a bad path fails at start-up,
    naming the setting, not at the first connection."""
    env = os.environ if environ is None else environ

    def pick(value: str | None, name: str, flag: str) -> tuple[str | None, str]:
        return setting(value, env, name, flag)

    cert_p, cert_src = pick(cert, CERT_ENV, "--tls-cert")
    key_p, key_src = pick(key, KEY_ENV, "--tls-key")
    ca_p, ca_src = pick(ca, CA_ENV, "--tls-ca")
    cca_p, cca_src = pick(client_ca, CLIENT_CA_ENV, "--tls-client-ca")
    if require is None:
        require = parse_bool(env.get(REQUIRE_ENV, ""), REQUIRE_ENV)
    if (cert_p is None) != (key_p is None):
        given, missing = (cert_src, key_src) if cert_p is not None else (key_src, cert_src)
        raise TlsError(f"{given} is set but {missing} is not: a TLS server needs both its certificate and its key")
    if cca_p is not None and cert_p is None:
        raise TlsError(f"{cca_src} (mutual TLS) needs a server certificate too: set {cert_src} and {key_src}")
    return TlsConfig(
        cert_path=cert_p,
        key_path=key_p,
        ca_path=ca_p,
        client_ca_path=cca_p,
        require=bool(require),
        cert=_read_pem(cert_p, cert_src) if cert_p else None,
        key=_read_pem(key_p, key_src) if key_p else None,
        ca=_read_pem(ca_p, ca_src) if ca_p else None,
        client_ca=_read_pem(cca_p, cca_src) if cca_p else None,
    )


# ---------------------------------------------------------------- servers


def check_server(cfg: TlsConfig, what: str, host: str, token: str | None, loopback: bool) -> None:
    """Refuse (``require`` without a certificate) or warn (a token on a non-loopback
    bind in clear text) before ``what`` starts listening on ``host``."""
    if cfg.serving:
        return
    if cfg.require:
        raise TlsError(
            f"{what}: TLS is required (--require-tls / {REQUIRE_ENV}) but no certificate is set: "
            f"pass --tls-cert and --tls-key (or {CERT_ENV} and {KEY_ENV})"
        )
    if token is not None and not loopback:
        log.warning(
            "%s binds %s with a token but without TLS: the token crosses the network in clear text "
            "(set --tls-cert/--tls-key, or %s/%s)", what, host or "all interfaces", CERT_ENV, KEY_ENV,
        )


def add_port(server: Any, bind: str, cfg: TlsConfig) -> int:
    """Bind a ``grpc.aio`` server to ``bind``, over TLS when ``cfg`` serves it; the port."""
    if not cfg.serving:
        return int(server.add_insecure_port(bind))
    assert cfg.key is not None and cfg.cert is not None
    creds = grpc.ssl_server_credentials(
        [(cfg.key, cfg.cert)], root_certificates=cfg.client_ca, require_client_auth=cfg.mutual
    )
    return int(server.add_secure_port(bind, creds))


def server_ssl_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """The ``ssl`` context an HTTP server (uvicorn) serves with, or None for clear text."""
    if not cfg.serving:
        return None
    assert cfg.cert_path is not None and cfg.key_path is not None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cfg.cert_path, cfg.key_path)
        if cfg.client_ca is not None:
            ctx.load_verify_locations(cadata=cfg.client_ca.decode("ascii", "replace"))
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, ValueError) as e:
        raise TlsError(f"the TLS certificate {cfg.cert_path!r} and key {cfg.key_path!r} cannot be used: {e}") from None
    return ctx


def uvicorn_ssl_kwargs(cfg: TlsConfig) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that serve ``cfg``'s TLS (none for clear text)."""
    if not cfg.serving:
        return {}
    server_ssl_context(cfg)  # fail here, naming the files, rather than inside uvicorn
    kw: dict[str, Any] = {"ssl_certfile": cfg.cert_path, "ssl_keyfile": cfg.key_path}
    if cfg.client_ca_path is not None:
        kw["ssl_ca_certs"] = cfg.client_ca_path
        kw["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return kw


# ---------------------------------------------------------------- clients


def client_ssl_context(cfg: TlsConfig) -> ssl.SSLContext:
    """The ``ssl`` context an HTTP client verifies servers with (and presents the job's
    certificate from, for mutual TLS)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if cfg.ca is not None:
        ctx.load_verify_locations(cadata=cfg.ca.decode("ascii", "replace"))
    if cfg.cert_path is not None and cfg.key_path is not None:
        ctx.load_cert_chain(cfg.cert_path, cfg.key_path)
    return ctx


def channel_credentials(cfg: TlsConfig) -> grpc.ChannelCredentials:
    """gRPC credentials that verify the server against the job's CA (the system's without
    one) and present the job's certificate when it has one."""
    return grpc.ssl_channel_credentials(root_certificates=cfg.ca, private_key=cfg.key, certificate_chain=cfg.cert)


def channel(target: str, address: str, cfg: TlsConfig, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A blocking gRPC channel to ``target`` (the ``host:port`` of ``address``)."""
    if cfg.client_tls(address):
        return grpc.secure_channel(target, channel_credentials(cfg), options=list(options))
    return grpc.insecure_channel(target, options=list(options))


def aio_channel(target: str, address: str, cfg: TlsConfig, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    """An asyncio gRPC channel to ``target`` (the ``host:port`` of ``address``)."""
    if cfg.client_tls(address):
        return grpc.aio.secure_channel(target, channel_credentials(cfg), options=list(options))
    return grpc.aio.insecure_channel(target, options=list(options))


__all__ = [
    "CA_ENV", "CERT_ENV", "CLIENT_CA_ENV", "KEY_ENV", "MAX_PEM_BYTES", "REQUIRE_ENV", "TlsConfig", "TlsError",
    "add_port", "aio_channel", "channel", "channel_credentials", "check_server", "client_ssl_context",
    "parse_bool", "server_ssl_context", "setting", "tls_config", "uvicorn_ssl_kwargs",
]
