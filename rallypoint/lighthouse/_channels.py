"""The lighthouse clients' shared plumbing: the address list, one channel per lighthouse
(with keepalive pings), the job token's metadata, and the rule for moving on to the next
lighthouse (UNAVAILABLE). Used by :mod:`client` and :mod:`liveness`."""

from __future__ import annotations

from typing import Any

import grpc

from rallypoint._net import addr as addrs
from rallypoint._net.auth import bearer_metadata, job_token
from rallypoint._net.job import job_metadata, job_name
from rallypoint.lighthouse.owners import SESSION_HEADER, session_nonce
from rallypoint._net.rpc import keepalive_channel_options
from rallypoint._net.tls import TlsConfig
from rallypoint._net.tls import channel as tls_channel
from rallypoint._proto import rallypoint_pb2 as rpb

_ATTACH = "/rallypoint.RallypointLighthouse/Attach"


def split_addresses(addr: str) -> list[str]:
    """``"http://a:1, http://b:2"`` -> ``["http://a:1", "http://b:2"]`` (stripped, empty
    parts dropped, order kept: the first is tried first). ValueError naming ``addr`` when
    no address is left, so an empty ``RALLYPOINT_LIGHTHOUSE`` fails at start-up."""
    parts = [a.strip() for a in addr.split(",")]
    found = [a for a in parts if a]
    if not found:
        raise ValueError(f"no lighthouse address in {addr!r}: expected host:port, http://host:port "
                         "or a comma-separated list of them")
    return found


def _metadata(token: str | None, job: str | None = None) -> list[tuple[str, str]] | None:
    """The call metadata of the job token (the argument, else RALLYPOINT_TOKEN) and the job
    name (the argument, else RALLYPOINT_JOB; nothing for the default job), and this
    process's session nonce."""
    found = (bearer_metadata(job_token(token)) or []) + job_metadata(job_name(job))
    # The process's session nonce: the lighthouse binds a replica id to the process that
    # registered it (owners.py); the same nonce on every call and reconnect keeps it ours.
    return found + [(SESSION_HEADER, session_nonce())]


def _not_leader(e: grpc.RpcError) -> bool:
    """Whether a failed call should go to the next lighthouse: UNAVAILABLE is what a
    standby, a leader that just lost its lease and a dead address all answer."""
    return e.code() == grpc.StatusCode.UNAVAILABLE


class _Endpoint:
    """One lighthouse of the list: its address, its channel and the stubs made on it
    (made once: a stub per call would cost an allocation on every heartbeat)."""

    def __init__(self, addr: str, tls: TlsConfig) -> None:
        self.addr = addr
        self.channel = tls_channel(addrs.grpc_target(addr), addr, tls, keepalive_channel_options())
        self._stubs: dict[str, Any] = {}

    def unary(self, method: str, request: Any, response: Any) -> Any:
        stub = self._stubs.get(method)
        if stub is None:
            stub = self.channel.unary_unary(method, request_serializer=request.SerializeToString,
                                            response_deserializer=response.FromString)
            self._stubs[method] = stub  # a race makes two equal stubs: harmless
        return stub

    def attach(self) -> Any:
        stub = self._stubs.get(_ATTACH)
        if stub is None:
            stub = self._stubs[_ATTACH] = self.channel.stream_stream(
                _ATTACH, request_serializer=rpb.AttachRequest.SerializeToString,
                response_deserializer=rpb.AttachResponse.FromString)
        return stub


def _endpoints(addresses: list[str], tls: TlsConfig) -> list[_Endpoint]:
    """One endpoint per address; if one cannot be made (a bad address, clear text where
    TLS is required), the channels already opened are closed before the error goes up."""
    made: list[_Endpoint] = []
    try:
        for a in addresses:
            made.append(_Endpoint(a, tls))
    except BaseException:
        for ep in made:
            ep.channel.close()
        raise
    return made
