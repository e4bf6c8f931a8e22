"""The liveness stream a replica group holds open to the lighthouse for its whole life
(rallypoint's ``Attach``): its end without a goodbye tells the lighthouse the group died;
the lighthouse pushes peer-down notices and lease revokes on it; a leased group sends its
step reports on it. Re-exported by :mod:`rallypoint.lighthouse.client`."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Iterator

import grpc

from rallypoint._net.limits import MAX_DATA_BYTES
from rallypoint._net.tls import TlsConfig, tls_config
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint.lighthouse._channels import _endpoints, _metadata, split_addresses

log = logging.getLogger("rallypoint.lighthouse.client")


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
        job: str | None = None,
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
        self._metadata = _metadata(token, job)  # job: RALLYPOINT_JOB by default
        self._ping_interval = ping_interval
        self._base_ping = ping_interval
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
        """Whether the lighthouse has welcomed this stream (it then sees a break at once)."""
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
        if self._base_ping is not None and welcome.heartbeat_timeout_ms > 0:
            # A tenth of the lighthouse's heartbeat timeout is plenty (and at most 1 s): a
            # job of 1,000 groups must not send the lighthouse 10,000 pings a second.
            self._ping_interval = min(1.0, max(self._base_ping, welcome.heartbeat_timeout_ms / 10_000))
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
                detailed = n > 1 or e.code() == grpc.StatusCode.PERMISSION_DENIED  # e.g. our id is someone else's
                why = f"broke ({e.code()}: {e.details()})" if detailed else f"broke ({e.code()})"
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
