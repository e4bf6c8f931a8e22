"""Clients of the lighthouse: the torchft-compatible Quorum/Heartbeat client and the
liveness stream a replica holds open for its whole life.

This is the only part of ``rallypoint.lighthouse`` that the manager imports. Every
call has a timeout; the liveness stream reconnects by itself until closed.

High availability: both clients accept a comma-separated list of lighthouses
(``RALLYPOINT_LIGHTHOUSE=http://a:1,http://b:2``). Only the leader serves; a standby (or
a dead lighthouse) answers UNAVAILABLE, so UNAVAILABLE means "try the next one". Each
client remembers the lighthouse that last answered and starts there, so a steady job
costs one hop per call; a failover costs one pass over the list.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import grpc

from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint._net import addr as addrs
from rallypoint._net.auth import bearer_metadata, job_token
from rallypoint._net.limits import MAX_DATA_BYTES
from rallypoint._net.rpc import keepalive_channel_options, seconds, translate_rpc_error
from rallypoint._net.tls import TlsConfig, tls_config
from rallypoint._net.tls import channel as tls_channel
from rallypoint.lighthouse.quorum import Member, Quorum
from rallypoint.lighthouse.validate import member_from_pb

log = logging.getLogger("rallypoint.lighthouse.client")

grpc_target = addrs.grpc_target

T = TypeVar("T")

#: The pause after a full pass over the lighthouses found no leader: doubling from the
#: first to the second, and never past the call's own deadline. Why: while an election
#: is under way every lighthouse answers UNAVAILABLE at once; without a pause a waiting
#: quorum call would spin on them.
FAILOVER_PAUSE_S = (0.05, 0.5)
#: An attempt with less time left than this is not started: it could only end in
#: DEADLINE_EXCEEDED, which would turn "no leader answered" into "no quorum formed".
_MIN_ATTEMPT_S = 0.02
#: How long the constructor waits for an earlier-listed lighthouse once a later one is
#: reachable (see ``LighthouseClient._first_ready``).
_PREFER_GRACE_S = 0.1

_QUORUM = "/torchft.LighthouseService/Quorum"
_HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
_STATUS = "/rallypoint.RallypointLighthouse/Status"
_KILL = "/rallypoint.RallypointLighthouse/KillReplica"
_INJECT = "/rallypoint.RallypointLighthouse/Inject"
_REPORT_EVENT = "/rallypoint.RallypointLighthouse/ReportEvent"
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


def _metadata(token: str | None) -> list[tuple[str, str]] | None:
    """The call metadata of the job token (the argument, else RALLYPOINT_TOKEN)."""
    return bearer_metadata(job_token(token))


def _not_leader(e: grpc.RpcError) -> bool:
    """Whether a failed call should go to the next lighthouse: UNAVAILABLE is what a
    standby, a leader that just lost its lease and a dead address all answer."""
    return e.code() == grpc.StatusCode.UNAVAILABLE


def quorum_from_pb(msg: pb.Quorum) -> Quorum:
    created = msg.created.seconds + msg.created.nanos / 1e9
    return Quorum(msg.quorum_id, tuple(member_from_pb(p) for p in msg.participants), created)


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


class _CallFailed(Exception):
    """The last failure of a (possibly retried) call and the lighthouse that gave it."""

    def __init__(self, error: grpc.RpcError, addr: str) -> None:
        super().__init__(addr)
        self.error = error
        self.addr = addr


class LighthouseClient:
    """Quorum and Heartbeat against a lighthouse (ours or torchft's).

    Mirrors torchft's ``LighthouseClient(addr, connect_timeout)``: ``quorum()`` blocks
    until a quorum containing ``replica_id`` forms or ``timeout`` passes (then raises
    ``TimeoutError`` naming the replica and the lighthouse).

    ``addr`` may list several lighthouses (comma-separated): every call goes to the one
    that last answered and, on UNAVAILABLE, to the next, until one answers or the call's
    own timeout is spent (see :meth:`_invoke`). With one address nothing is retried.
    """

    def __init__(self, addr: str, connect_timeout: float | timedelta = 10.0, token: str | None = None,
                 *, tls: TlsConfig | None = None) -> None:
        """``token``: the job token (default ``RALLYPOINT_TOKEN``); ``tls``: the job's TLS
        settings (default ``RALLYPOINT_TLS_*``; TLS when a CA is set or ``addr`` is https).
        Returns once any of the lighthouses is reachable (ConnectionError naming them all
        when none is within ``connect_timeout``)."""
        self.addr = addr
        self.addresses = split_addresses(addr)
        self._connect_timeout = seconds(connect_timeout)
        self._metadata = _metadata(token)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._endpoints = _endpoints(self.addresses, tls or tls_config())
        self._current = self._first_ready()

    def _first_ready(self) -> int:
        """The index of the lighthouse the first call goes to: the first listed one that
        is reachable. Returns as soon as one is ready; when that is not the first listed,
        the ones listed before it get ``_PREFER_GRACE_S`` more to become ready too, so the
        list order (the operator's preference) wins over which connection happened to
        finish first. Only reachability is known here, not leadership: a standby may be
        picked, and the first call moves on from it."""
        deadline = time.monotonic() + self._connect_timeout
        futures = [grpc.channel_ready_future(ep.channel) for ep in self._endpoints]
        any_ready = threading.Event()
        for f in futures:
            f.add_done_callback(lambda _f: any_ready.set())
        any_ready.wait(self._connect_timeout)
        ready = [i for i, f in enumerate(futures) if f.done() and not f.cancelled()]
        if ready and ready[0] > 0:
            grace_end = min(deadline, time.monotonic() + _PREFER_GRACE_S)
            for i, f in enumerate(futures[: ready[0]]):
                try:
                    f.result(timeout=max(0.0, grace_end - time.monotonic()))
                except grpc.FutureTimeoutError:
                    continue
                ready.insert(0, i)
                break
        for f in futures:
            f.cancel()  # stops the connection attempts of the rest
        if ready:
            return ready[0]
        self.close()
        if len(self.addresses) == 1:
            where = f"the lighthouse at {self.addresses[0]}"
        else:
            where = f"any of the lighthouses at {', '.join(self.addresses)}"
        raise ConnectionError(f"could not connect to {where} within {self._connect_timeout:.1f}s; "
                              "is `rallypoint lighthouse` running there?") from None

    @property
    def current_address(self) -> str:
        """The lighthouse the next call goes to first (the one that last answered)."""
        return self._endpoints[self._current].addr

    def _where(self, addr: str) -> str:
        """``addr`` for error messages; with several lighthouses, all of them too."""
        if len(self._endpoints) == 1:
            return self.addr
        return f"{addr} (lighthouses: {', '.join(self.addresses)})"

    def _follow(self, index: int) -> None:
        """Start the next calls at the lighthouse that just answered; say so once per switch."""
        with self._lock:
            if self._current == index:
                return
            self._current = index
        log.info("lighthouse at %s answered; following it", self._endpoints[index].addr)

    def _invoke(self, timeout: float, attempt: Callable[[_Endpoint, float], T]) -> T:
        """Run ``attempt(endpoint, seconds left)`` at the current lighthouse, then, while
        it answers UNAVAILABLE, at the next ones in turn (pausing after each full pass).

        Bounded by ``timeout``: each attempt gets only the time left, no attempt starts
        with less than ``_MIN_ATTEMPT_S`` left and a pause never outlasts the deadline, so
        the whole call returns within about ``timeout``. Any other failure, a single
        lighthouse, or a closed client ends it at once. Raises :class:`_CallFailed`."""
        n = len(self._endpoints)
        deadline = time.monotonic() + timeout
        index, failed, pause = self._current, 0, FAILOVER_PAUSE_S[0]
        left, last = timeout, None
        while True:
            ep = self._endpoints[index]
            try:
                result = attempt(ep, left)
            except grpc.RpcError as e:
                if n == 1 or not _not_leader(e) or self._closed.is_set():
                    raise _CallFailed(e, ep.addr) from None
                log.debug("lighthouse at %s: %s (%s); trying the next one", ep.addr, e.code(), e.details())
                last = _CallFailed(e, ep.addr)
                failed += 1
                index = (index + 1) % n
                if failed % n == 0:  # a full pass and no leader: an election may be under way
                    wait = min(pause, deadline - time.monotonic())
                    if wait > 0 and self._closed.wait(wait):
                        raise last from None
                    pause = min(pause * 2, FAILOVER_PAUSE_S[1])
                left = deadline - time.monotonic()
                if left < _MIN_ATTEMPT_S or self._closed.is_set():
                    raise last from None
                continue
            except ValueError:
                # A retry on a channel closed meanwhile ("Cannot invoke RPC on closed
                # channel"): the call ends as it would have without the retry.
                if last is not None and self._closed.is_set():
                    raise last from None
                raise
            self._follow(index)
            return result

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
        request = pb.LighthouseQuorumRequest(requester=requester)
        secs = seconds(timeout)

        def attempt(ep: _Endpoint, left: float) -> tuple[Any, Any]:
            stub = ep.unary(_QUORUM, pb.LighthouseQuorumRequest, pb.LighthouseQuorumResponse)
            return stub.with_call(request, timeout=left, metadata=self._metadata)

        try:
            resp, call = self._invoke(secs, attempt)
        except _CallFailed as f:
            raise _translate(f.error, f"quorum for replica {replica_id} at {self._where(f.addr)}", secs) from None
        if on_trailing is not None:
            on_trailing(call.trailing_metadata())
        return quorum_from_pb(resp.quorum)

    def heartbeat(self, replica_id: str, timeout: float | timedelta = 5.0) -> None:
        secs = seconds(timeout)
        request = pb.LighthouseHeartbeatRequest(replica_id=replica_id)

        def attempt(ep: _Endpoint, left: float) -> None:
            stub = ep.unary(_HEARTBEAT, pb.LighthouseHeartbeatRequest, pb.LighthouseHeartbeatResponse)
            stub(request, timeout=left, metadata=self._metadata)

        try:
            self._invoke(secs, attempt)
        except _CallFailed as f:
            raise translate_rpc_error(f.error, f"heartbeat for replica {replica_id} at {self._where(f.addr)}",
                                      secs) from None

    def status(self, timeout: float = 5.0) -> dict:
        """The lighthouse's status document (rallypoint lighthouses only)."""

        def attempt(ep: _Endpoint, left: float) -> dict:
            stub = ep.unary(_STATUS, rpb.StatusRequest, rpb.StatusResponse)
            return json.loads(stub(rpb.StatusRequest(), timeout=left, metadata=self._metadata).json)

        try:
            return self._invoke(timeout, attempt)
        except _CallFailed as f:
            raise translate_rpc_error(f.error, f"status of {self._where(f.addr)}", timeout) from None

    def kill(self, replica_id: str, reason: str = "killed via the lighthouse", timeout: float = 15.0) -> str:
        """Ask the lighthouse to forward Kill to ``replica_id``'s manager; returns its address.
        Raises KeyError for a replica the lighthouse does not know."""
        request = rpb.KillReplicaRequest(replica_id=replica_id, reason=reason)

        def attempt(ep: _Endpoint, left: float) -> str:
            stub = ep.unary(_KILL, rpb.KillReplicaRequest, rpb.KillReplicaResponse)
            return str(stub(request, timeout=left, metadata=self._metadata).address)

        try:
            return self._invoke(timeout, attempt)
        except _CallFailed as f:
            if f.error.code() == grpc.StatusCode.NOT_FOUND:
                raise KeyError(f.error.details()) from None
            raise translate_rpc_error(f.error, f"kill of replica {replica_id} via {self._where(f.addr)}",
                                      timeout) from None

    def inject(self, request: dict[str, Any], timeout: float = 10.0) -> tuple[str, str]:
        """Ask for a fault injection (``{"kind": ..., "replica": ..., ...}``; see
        :mod:`rallypoint.lighthouse.injections`); returns ``(injection id, replica id)``.
        Raises KeyError for an unknown replica, ValueError for a refused request."""
        msg = rpb.InjectRequest(json=json.dumps(request))

        def attempt(ep: _Endpoint, left: float) -> tuple[str, str]:
            stub = ep.unary(_INJECT, rpb.InjectRequest, rpb.InjectResponse)
            resp = stub(msg, timeout=left, metadata=self._metadata)
            return resp.id, resp.replica_id

        try:
            return self._invoke(timeout, attempt)
        except _CallFailed as f:
            e = f.error
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise KeyError(e.details()) from None
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise ValueError(e.details()) from None
            raise translate_rpc_error(e, f"injection via {self._where(f.addr)}", timeout) from None

    def report_event(self, group: str, kind: str, details: dict[str, Any] | None = None, timeout: float = 5.0) -> int:
        """Record a ``rallypoint run`` event (``restart``, ``gave_up``, ``stopped``,
        ``started``) of replica group ``group`` in the lighthouse's event log; returns its
        event id. ``details``: a flat JSON object (scalars, short lists) of at most 4 KiB.

        Raises NotImplementedError when the lighthouse has no such RPC (torchft's), so a
        caller can stop trying; ValueError when the event was refused as malformed;
        ConnectionError (RESOURCE_EXHAUSTED) when it was dropped by the rate limit."""
        msg = rpb.SupervisorEvent(group=group, kind=kind, details=json.dumps(details or {}, separators=(",", ":")))

        def attempt(ep: _Endpoint, left: float) -> int:
            stub = ep.unary(_REPORT_EVENT, rpb.SupervisorEvent, rpb.ReportEventResponse)
            return int(stub(msg, timeout=left, metadata=self._metadata).event_id)

        try:
            return self._invoke(timeout, attempt)
        except _CallFailed as f:
            e = f.error
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise NotImplementedError(f"the lighthouse at {self._where(f.addr)} does not accept reported events "
                                          f"(torchft's lighthouse?): {e.details()}") from None
            raise translate_rpc_error(e, f"{kind} event of group {group} to {self._where(f.addr)}", timeout) from None

    def close(self) -> None:
        """Close every channel (cancelling in-flight calls) and stop any retry."""
        self._closed.set()
        for ep in self._endpoints:
            ep.channel.close()

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

    With several lighthouses (``addr`` comma-separated), a stream refused or broken moves
    to the next one at once; only after each was tried once does it back off, so a
    failover to a new leader costs one pass over the list, not a backoff per standby.
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
        held_lease: Callable[[], int] | None = None,
        on_lease_revoke: Callable[[rpb.LeaseRevoke], None] | None = None,
    ) -> None:
        self.addr = addr
        self.addresses = split_addresses(addr)
        self.replica_id = replica_id
        self.address = address
        self._metadata = _metadata(token)
        self._ping_interval = ping_interval
        self._on_peer_down = on_peer_down
        # Quorum leases (LEASES.md): the hello says we take them and which one we hold;
        # None: this replica takes none (its quorums are never leased).
        self._held_lease = held_lease
        self._on_lease_revoke = on_lease_revoke
        self._backoff = reconnect_backoff
        self._closed = threading.Event()
        self._welcomed = threading.Event()
        self._outbox: queue.Queue[rpb.AttachRequest | None] | None = None
        self._call: Any = None
        self._lock = threading.Lock()
        self.unsupported = False
        self.welcome: rpb.AttachWelcome | None = None
        self._endpoints = _endpoints(self.addresses, tls or tls_config())
        self._next = 0  # the lighthouse the next (re)connect tries first
        self._leader = 0  # the lighthouse that last welcomed us
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

    @property
    def current_address(self) -> str:
        """The lighthouse that last welcomed the stream (the first listed before that)."""
        return self._endpoints[self._leader].addr

    def _requests(self, outbox: "queue.Queue[rpb.AttachRequest | None]") -> Iterator[rpb.AttachRequest]:
        # Built as each stream starts, so a re-attach (to a new leader too) carries the
        # lease held now.
        held = self._held_lease
        yield rpb.AttachRequest(hello=rpb.AttachHello(replica_id=self.replica_id, address=self.address,
                                                      leases=held is not None, lease_quorum_id=held() if held else 0))
        while True:
            try:
                msg = outbox.get(timeout=self._ping_interval)
            except queue.Empty:
                msg = rpb.AttachRequest(ping=rpb.AttachPing())
            if msg is None:
                return
            yield msg

    def _welcomed_by(self, index: int, welcome: rpb.AttachWelcome) -> None:
        self.welcome = welcome
        self._welcomed.set()
        if index != self._leader:
            self._leader = index
            log.info("[%s] lighthouse at %s answered; following it", self.replica_id, self._endpoints[index].addr)
        log.info("[%s] liveness stream attached to %s", self.replica_id, self._endpoints[index].addr)

    def _run(self) -> None:
        n = len(self._endpoints)
        delay = self._backoff[0]
        failed = 0  # lighthouses that refused or dropped the stream since the last welcome or backoff
        while not self._closed.is_set():
            index = self._next
            ep = self._endpoints[index]
            outbox: queue.Queue[rpb.AttachRequest | None] = queue.Queue()
            with self._lock:
                if self._closed.is_set():
                    return
                self._outbox = outbox
                self._call = ep.attach()(self._requests(outbox), metadata=self._metadata)
            attached = False
            try:
                for resp in self._call:
                    if resp.HasField("welcome"):
                        attached, failed, delay = True, 0, self._backoff[0]
                        self._welcomed_by(index, resp.welcome)
                    elif resp.HasField("lease_revoke") and self._on_lease_revoke is not None:
                        try:
                            self._on_lease_revoke(resp.lease_revoke)
                        except Exception:
                            log.exception("[%s] on_lease_revoke callback failed", self.replica_id)
                    elif resp.HasField("peer_down") and self._on_peer_down is not None:
                        try:
                            self._on_peer_down(resp.peer_down.replica_id, resp.peer_down.reason)
                        except Exception:
                            log.exception("[%s] on_peer_down callback failed", self.replica_id)
                if self._closed.is_set():
                    return
                why = "ended by the lighthouse"
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unsupported = True
                    log.info("[%s] lighthouse at %s has no liveness stream (torchft?); relying on heartbeats", self.replica_id, ep.addr)
                    self._welcomed.set()
                    return
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                    log.error("[%s] liveness stream refused: %s", self.replica_id, e.details())
                    if self._on_lease_revoke is not None:  # no stream from now on: no lease either
                        self._on_lease_revoke(rpb.LeaseRevoke(quorum_id=2**62, reason="liveness stream refused"))
                    return
                why = f"broke ({e.code()}: {e.details()})" if n > 1 else f"broke ({e.code()})"
            self._welcomed.clear()
            failed += 1
            self._next = (index + 1) % n
            if failed < n:  # another lighthouse not tried yet: at once, no backoff
                log.log(logging.WARNING if attached else logging.DEBUG, "[%s] liveness stream to %s %s; trying %s",
                        self.replica_id, ep.addr, why, self._endpoints[self._next].addr)
                continue
            failed = 0
            if n == 1:
                log.warning("[%s] liveness stream to %s %s; reconnecting in %.1fs", self.replica_id, ep.addr, why, delay)
            else:
                log.warning("[%s] no lighthouse of %s accepted the liveness stream (last: %s %s); retrying in %.1fs",
                            self.replica_id, self.addr, ep.addr, why, delay)
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, self._backoff[1])

    def report(self, step: int, data: str) -> bool:
        """Send the step stats of a round started on a lease (``data``: what the Quorum
        request would have carried). Never blocks; False when the stream is down (the
        report is dropped: step stats are for scores, not for correctness)."""
        outbox = self._outbox
        if outbox is None or not self._welcomed.is_set() or self._closed.is_set():
            return False
        if len(data) > MAX_DATA_BYTES or outbox.qsize() >= 1024:  # the lighthouse would end the stream; or it is stuck
            log.debug("[%s] step report of step %d dropped (%d bytes, %d queued)", self.replica_id, step, len(data),
                      outbox.qsize())
            return False
        outbox.put(rpb.AttachRequest(step_report=rpb.StepReport(step=step, data=data)))
        return True

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
        for ep in self._endpoints:
            ep.channel.close()

    def __enter__(self) -> "LivenessStream":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LighthouseClient", "LivenessStream", "Member", "Quorum", "grpc_target", "quorum_from_pb", "seconds",
           "split_addresses", "translate_rpc_error"]
