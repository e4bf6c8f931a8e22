"""Clients of the lighthouse: the torchft-compatible Quorum/Heartbeat client and the
liveness stream a replica holds open for its whole life.

This is the only part of ``rallypoint.lighthouse`` that the manager imports. Every
call has a timeout; the liveness stream reconnects by itself until closed.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator

import grpc

from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint._net import addr as addrs
from rallypoint._net.auth import bearer_metadata, job_token
from rallypoint._net.rpc import channel_options, seconds, translate_rpc_error
from rallypoint._net.tls import TlsConfig, tls_config
from rallypoint._net.tls import channel as tls_channel
from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.lighthouse.validate import member_from_pb

log = logging.getLogger("rallypoint.lighthouse.client")

grpc_target = addrs.grpc_target


def _metadata(token: str | None) -> list[tuple[str, str]] | None:
    """The call metadata of the job token (the argument, else RALLYPOINT_TOKEN)."""
    return bearer_metadata(job_token(token))


def quorum_from_pb(msg: pb.Quorum) -> Quorum:
    created = msg.created.seconds + msg.created.nanos / 1e9
    return Quorum(msg.quorum_id, tuple(member_from_pb(p) for p in msg.participants), created)


class LighthouseClient:
    """Quorum and Heartbeat against a lighthouse (ours or torchft's).

    Mirrors torchft's ``LighthouseClient(addr, connect_timeout)``: ``quorum()`` blocks
    until a quorum containing ``replica_id`` forms or ``timeout`` passes (then raises
    ``TimeoutError`` naming the replica and the lighthouse).
    """

    def __init__(self, addr: str, connect_timeout: float | timedelta = 10.0, token: str | None = None,
                 *, tls: TlsConfig | None = None) -> None:
        """``token``: the job token (default ``RALLYPOINT_TOKEN``); ``tls``: the job's TLS
        settings (default ``RALLYPOINT_TLS_*``; TLS when a CA is set or ``addr`` is https)."""
        self.addr = addr
        self._target = addrs.grpc_target(addr)
        self._connect_timeout = seconds(connect_timeout)
        self._metadata = _metadata(token)
        self._channel = tls_channel(self._target, addr, tls or tls_config(), channel_options())
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self._connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ConnectionError(
                f"could not connect to the lighthouse at {addr} within {self._connect_timeout:.1f}s; "
                "is `rallypoint lighthouse` running there?"
            ) from None
        self._quorum = self._channel.unary_unary(
            "/torchft.LighthouseService/Quorum",
            request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
            response_deserializer=pb.LighthouseQuorumResponse.FromString,
        )
        self._heartbeat = self._channel.unary_unary(
            "/torchft.LighthouseService/Heartbeat",
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )

    def quorum(
        self,
        replica_id: str,
        timeout: float | timedelta,
        address: str | None = None,
        store_address: str | None = None,
        step: int | None = None,
        world_size: int | None = None,
        shrink_only: bool | None = None,
        data: dict | str | None = None,
        commit_failures: int = 0,
        on_trailing: Callable[[Any], None] | None = None,
    ) -> Quorum:
        """Ask for a quorum; blocks until one that contains ``replica_id`` forms.
        ``on_trailing`` gets the answer's trailing metadata (a rallypoint lighthouse hands
        fault injections to the group there)."""
        requester = pb.QuorumMember(
            replica_id=replica_id,
            address=address or "",
            store_address=store_address or "",
            step=step or 0,
            world_size=world_size or 0,
            shrink_only=bool(shrink_only),
            commit_failures=commit_failures,
            data=data if isinstance(data, str) else (json.dumps(data) if data is not None else ""),
        )
        secs = seconds(timeout)
        try:
            resp, call = self._quorum.with_call(
                pb.LighthouseQuorumRequest(requester=requester), timeout=secs, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise _translate(e, f"quorum for replica {replica_id} at {self.addr}", secs) from None
        if on_trailing is not None:
            on_trailing(call.trailing_metadata())
        return quorum_from_pb(resp.quorum)

    def heartbeat(self, replica_id: str, timeout: float | timedelta = 5.0) -> None:
        secs = seconds(timeout)
        try:
            self._heartbeat(pb.LighthouseHeartbeatRequest(replica_id=replica_id), timeout=secs, metadata=self._metadata)
        except grpc.RpcError as e:
            raise translate_rpc_error(e, f"heartbeat for replica {replica_id} at {self.addr}", secs) from None

    def status(self, timeout: float = 5.0) -> dict:
        """The lighthouse's status document (rallypoint lighthouses only)."""
        call = self._channel.unary_unary(
            "/rallypoint.RallypointLighthouse/Status",
            request_serializer=rpb.StatusRequest.SerializeToString,
            response_deserializer=rpb.StatusResponse.FromString,
        )
        try:
            return json.loads(call(rpb.StatusRequest(), timeout=timeout, metadata=self._metadata).json)
        except grpc.RpcError as e:
            raise translate_rpc_error(e, f"status of {self.addr}", timeout) from None

    def kill(self, replica_id: str, reason: str = "killed via the lighthouse", timeout: float = 15.0) -> str:
        """Ask the lighthouse to forward Kill to ``replica_id``'s manager; returns its address.
        Raises KeyError for a replica the lighthouse does not know."""
        call = self._channel.unary_unary(
            "/rallypoint.RallypointLighthouse/KillReplica",
            request_serializer=rpb.KillReplicaRequest.SerializeToString,
            response_deserializer=rpb.KillReplicaResponse.FromString,
        )
        try:
            resp = call(rpb.KillReplicaRequest(replica_id=replica_id, reason=reason), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise KeyError(e.details()) from None
            raise translate_rpc_error(e, f"kill of replica {replica_id} via {self.addr}", timeout) from None
        return resp.address

    def inject(self, request: dict[str, Any], timeout: float = 10.0) -> tuple[str, str]:
        """Ask for a fault injection (``{"kind": ..., "replica": ..., ...}``; see
        :mod:`rallypoint.lighthouse.injections`); returns ``(injection id, replica id)``.
        Raises KeyError for an unknown replica, ValueError for a refused request."""
        call = self._channel.unary_unary(
            "/rallypoint.RallypointLighthouse/Inject",
            request_serializer=rpb.InjectRequest.SerializeToString,
            response_deserializer=rpb.InjectResponse.FromString,
        )
        try:
            resp = call(rpb.InjectRequest(json=json.dumps(request)), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise KeyError(e.details()) from None
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise ValueError(e.details()) from None
            raise translate_rpc_error(e, f"injection via {self.addr}", timeout) from None
        return resp.id, resp.replica_id

    def report_event(self, group: str, kind: str, details: dict[str, Any] | None = None, timeout: float = 5.0) -> int:
        """Record a ``rallypoint run`` event (``restart``, ``gave_up``, ``stopped``,
        ``started``) of replica group ``group`` in the lighthouse's event log; returns its
        event id. ``details``: a flat JSON object (scalars, short lists) of at most 4 KiB.

        Raises NotImplementedError when the lighthouse has no such RPC (torchft's), so a
        caller can stop trying; ValueError when the event was refused as malformed;
        ConnectionError (RESOURCE_EXHAUSTED) when it was dropped by the rate limit."""
        call = self._channel.unary_unary(
            "/rallypoint.RallypointLighthouse/ReportEvent",
            request_serializer=rpb.SupervisorEvent.SerializeToString,
            response_deserializer=rpb.ReportEventResponse.FromString,
        )
        msg = rpb.SupervisorEvent(group=group, kind=kind, details=json.dumps(details or {}, separators=(",", ":")))
        try:
            return call(msg, timeout=timeout, metadata=self._metadata).event_id
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise NotImplementedError(f"the lighthouse at {self.addr} does not accept reported events "
                                          f"(torchft's lighthouse?): {e.details()}") from None
            raise translate_rpc_error(e, f"{kind} event of group {group} to {self.addr}", timeout) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "LighthouseClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _translate(e: grpc.RpcError, what: str, timeout: float) -> Exception:
    """For quorum calls only: their timeout means no quorum formed."""
    return translate_rpc_error(e, what, timeout, " (no quorum formed in time)")


class LivenessStream:
    """Holds rallypoint's ``Attach`` stream open so that the lighthouse sees this
    replica's death within milliseconds of the process dying (the kernel closes the
    connection), and pushes ``PeerDown`` notices for other replicas to ``on_peer_down``.

    ``close()`` sends a goodbye first, so a clean shutdown is not counted as a crash.
    The stream reconnects (with capped backoff) until closed. Pings every
    ``ping_interval`` seconds also count as heartbeats. Talking to a lighthouse without
    the extension (torchft's) is harmless: the stream is UNIMPLEMENTED and is not retried.
    """

    def __init__(
        self,
        addr: str,
        replica_id: str,
        address: str = "",
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        ping_interval: float | None = 1.0,
        on_peer_down: Callable[[str, str], None] | None = None,
        reconnect_backoff: tuple[float, float] = (0.1, 2.0),
    ) -> None:
        self.addr = addr
        self.replica_id = replica_id
        self.address = address
        self._target = addrs.grpc_target(addr)
        self._metadata = _metadata(token)
        self._ping_interval = ping_interval
        self._on_peer_down = on_peer_down
        self._backoff = reconnect_backoff
        self._closed = threading.Event()
        self._welcomed = threading.Event()
        self._outbox: queue.Queue[rpb.AttachRequest | None] | None = None
        self._call: Any = None
        self._lock = threading.Lock()
        self.unsupported = False
        self.welcome: rpb.AttachWelcome | None = None
        self._channel = tls_channel(self._target, addr, tls or tls_config(), channel_options())
        self._attach = self._channel.stream_stream(
            "/rallypoint.RallypointLighthouse/Attach",
            request_serializer=rpb.AttachRequest.SerializeToString,
            response_deserializer=rpb.AttachResponse.FromString,
        )
        self._thread = threading.Thread(target=self._run, name=f"rallypoint-liveness-{replica_id}", daemon=True)

    def start(self, timeout: float = 10.0) -> bool:
        """Open the stream; True once the lighthouse welcomed us within ``timeout``."""
        self._thread.start()
        ok = self._welcomed.wait(timeout)
        if not ok and not self.unsupported:
            log.warning("[%s] liveness stream to %s not welcomed within %.1fs; will keep trying", self.replica_id, self.addr, timeout)
        return ok

    @property
    def connected(self) -> bool:
        return self._welcomed.is_set()

    def _requests(self, outbox: "queue.Queue[rpb.AttachRequest | None]") -> Iterator[rpb.AttachRequest]:
        yield rpb.AttachRequest(hello=rpb.AttachHello(replica_id=self.replica_id, address=self.address))
        while True:
            try:
                msg = outbox.get(timeout=self._ping_interval)
            except queue.Empty:
                msg = rpb.AttachRequest(ping=rpb.AttachPing())
            if msg is None:
                return
            yield msg

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._closed.is_set():
            outbox: queue.Queue[rpb.AttachRequest | None] = queue.Queue()
            with self._lock:
                if self._closed.is_set():
                    return
                self._outbox = outbox
                self._call = self._attach(self._requests(outbox), metadata=self._metadata)
            try:
                for resp in self._call:
                    if resp.HasField("welcome"):
                        self.welcome = resp.welcome
                        self._welcomed.set()
                        delay = self._backoff[0]
                        log.info("[%s] liveness stream attached to %s", self.replica_id, self.addr)
                    elif resp.HasField("peer_down") and self._on_peer_down is not None:
                        try:
                            self._on_peer_down(resp.peer_down.replica_id, resp.peer_down.reason)
                        except Exception:
                            log.exception("[%s] on_peer_down callback failed", self.replica_id)
                if self._closed.is_set():
                    return
                log.warning("[%s] liveness stream ended by the lighthouse; reconnecting", self.replica_id)
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True
                    log.info("[%s] lighthouse at %s has no liveness stream (torchft?); relying on heartbeats", self.replica_id, self.addr)
                    self._welcomed.set()
                    return
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                    log.error("[%s] liveness stream refused: %s", self.replica_id, e.details())
                    return
                log.warning("[%s] liveness stream to %s broke (%s); reconnecting in %.1fs", self.replica_id, self.addr, e.code(), delay)
            self._welcomed.clear()
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, self._backoff[1])

    def close(self, reason: str = "shutdown", timeout: float = 5.0) -> None:
        """Say goodbye and close; idempotent. The lighthouse forgets us at once."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            outbox, call = self._outbox, self._call
        if outbox is not None and call is not None and self._welcomed.is_set():
            outbox.put(rpb.AttachRequest(goodbye=rpb.AttachGoodbye(reason=reason)))
            outbox.put(None)
            self._thread.join(timeout)
        if call is not None and self._thread.is_alive():
            call.cancel()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        self._channel.close()

    def __enter__(self) -> "LivenessStream":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LighthouseClient", "LivenessStream", "Member", "Quorum", "grpc_target", "quorum_from_pb", "seconds", "translate_rpc_error"]
