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
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

import grpc

from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint._net import addr as addrs
from rallypoint._net.rpc import seconds, translate_rpc_error
from rallypoint._net.tls import TlsConfig, tls_config
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

from rallypoint.lighthouse._channels import _Endpoint, _endpoints, _metadata, _not_leader, split_addresses  # noqa: E402,F401

_QUORUM = "/torchft.LighthouseService/Quorum"
_HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
_STATUS = "/rallypoint.RallypointLighthouse/Status"
_KILL = "/rallypoint.RallypointLighthouse/KillReplica"
_INJECT = "/rallypoint.RallypointLighthouse/Inject"
_REPORT_EVENT = "/rallypoint.RallypointLighthouse/ReportEvent"


def quorum_from_pb(msg: pb.Quorum) -> Quorum:
    created = msg.created.seconds + msg.created.nanos / 1e9
    return Quorum(msg.quorum_id, tuple(member_from_pb(p) for p in msg.participants), created)


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
                 *, tls: TlsConfig | None = None, job: str | None = None) -> None:
        """``token``: the job token (default ``RALLYPOINT_TOKEN``); ``job``: the job's name on
        a lighthouse that serves several (default ``RALLYPOINT_JOB``, else ``default``); ``tls``: the job's TLS
        settings (default ``RALLYPOINT_TLS_*``; TLS when a CA is set or ``addr`` is https).
        Returns once any of the lighthouses is reachable (ConnectionError naming them all
        when none is within ``connect_timeout``)."""
        self.addr = addr
        self.addresses = split_addresses(addr)
        self._connect_timeout = seconds(connect_timeout)
        self._metadata = _metadata(token, job)
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
        reconfigure_handles: Sequence[str] = (),
    ) -> Quorum:
        """Ask for a quorum; blocks until one that contains ``replica_id`` forms.
        ``reconfigure_handles`` (torchft 0.3): the group's handles, one per group rank, or none.
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
            reconfigure_handles=list(reconfigure_handles),
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
        """Tell the lighthouse ``replica_id`` is alive (a Manager does this itself)."""
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
        Raises KeyError for an unknown replica, ValueError for a refused request (malformed,
        injection off on the lighthouse, or a token that may not inject)."""
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
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.PERMISSION_DENIED):  # injection off, or this token may not inject
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


from rallypoint.lighthouse.liveness import LivenessStream  # noqa: E402  (re-exported: the manager imports this module)


__all__ = ["LighthouseClient", "LivenessStream", "Member", "Quorum", "grpc_target", "quorum_from_pb", "seconds",
           "split_addresses", "translate_rpc_error"]
