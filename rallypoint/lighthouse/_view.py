"""What the lighthouse's HTTP app (dashboard, ``/status``, ``/events``, ``/metrics``, kill,
inject) sees of the running lighthouse, on its event loop: the core it serves from, and
whether this lighthouse leads (an HA standby serves status, nothing that changes state)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from rallypoint._net import __version__
from rallypoint._net import addr as addrs
from rallypoint._net.inject import Injection
from rallypoint._net.job import DEFAULT_JOB
from rallypoint._net.rpc import channel_options
from rallypoint._net.tls import TlsConfig, aio_channel
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.lighthouse import leases as ls
from rallypoint.lighthouse.core import LighthouseCore
from rallypoint.lighthouse.injections import INJECT_OFF, LIGHTHOUSE_KINDS, resolve
from rallypoint.lighthouse.metrics import LighthouseMetrics

log = logging.getLogger("rallypoint.lighthouse")
KILL_TIMEOUT_S = 10.0


def _raw(payload: object) -> bytes:
    return payload if isinstance(payload, bytes) else payload.SerializeToString()  # type: ignore[attr-defined]


class _View:
    """What the HTTP app sees (called on the loop thread)."""

    def __init__(self, core: LighthouseCore, metrics: LighthouseMetrics, token: str | None, tls: TlsConfig,
                 on_restart: Callable[[], None] | None = None, job: str = DEFAULT_JOB,
                 inject_gate: Callable[[str, str | bytes | None], str | None] | None = None) -> None:
        self.core = core
        self.job = job
        self._metrics = metrics
        self._token = token  # what a forwarded kill carries: the job's credential (jobs.kill_credential)
        # (kind, authorization) -> None or why not (injections.inject_refusal); None: injection off.
        self._inject_gate = inject_gate
        self._tls = tls
        self._on_restart = on_restart
        self.leads: Callable[[], bool] = lambda: True  # an HA standby: False (it changes nothing)
        self.role: Callable[[], str] = lambda: "single"  # "leader" / "standby" with etcd state

    def inject_refusal(self, kind: str, authorization: str | bytes | None) -> str | None:
        """None when a caller with ``authorization`` (already admitted to this job) may
        inject a ``kind`` fault; else why not, counted in ``/metrics`` as ``inject_refused``."""
        why = INJECT_OFF if self._inject_gate is None else self._inject_gate(kind, authorization)
        if why is not None:
            self._metrics.rejected("inject_refused")
        return why

    def inject(self, name: str, inj: Injection) -> str:
        """Accept a checked injection (see :mod:`injections`); returns the replica it goes
        to. Raises ``UnknownReplica``, ``ValueError`` (too many waiting) or ``RuntimeError``
        (a restart this lighthouse cannot do); nothing is recorded then."""
        if not self.leads():
            raise RuntimeError("standby lighthouse: not the leader (HA); ask the lighthouse that leads")
        if inj.kind in LIGHTHOUSE_KINDS:
            if self._on_restart is None:
                raise RuntimeError("this lighthouse cannot restart itself (it is embedded in another program, or the "
                                   "injection came for a job other than 'default': a restart costs every job a "
                                   "recovery); lighthouse-restart needs one started by `rallypoint lighthouse`")
            self.core.store.record_event("inject", None, injection=inj.id, injected=inj.kind)
            log.warning("injection %s: restarting the lighthouse", inj.id)
            asyncio.get_running_loop().call_later(0.2, self._on_restart)  # after the answer is out
            return ""
        rid = resolve(name, set(self.core.heartbeats) | set(self.core.pending))
        self.core.injections.add(rid, inj)
        if self.core.leases.holds(rid):  # handed out with a quorum answer: the group's next round must ask
            self.core.revoke_lease(ls.Revoke(self.core.leases.holds(rid), "injection", f"injection {inj.id} for {rid}"))
        self.core.store.record_event("inject", rid, injection=inj.id, injected=inj.kind,
                                     **{k: v for k, v in inj.to_json().items() if k not in ("id", "kind")})
        log.warning("[%s] injection %s (%s) handed to the group with its next quorum", rid, inj.id, inj.kind)
        return rid

    def status(self) -> dict:
        s = self.core.status()
        s["lighthouse"] = {"version": __version__, "started": self.core.started, "state_path": self.core.store.path,
                           "role": self.role()}
        s["job"] = self.job
        return s

    def events(self, limit: int, since_id: int | None, replica_id: str | None) -> list[dict]:
        return [
            {"id": e.id, "time": e.time, "kind": e.kind, "replica_id": e.replica_id, "detail": e.detail}
            for e in self.core.store.events(limit=limit, since_id=since_id, replica_id=replica_id)
        ]

    def metrics(self) -> bytes:
        self.core.refresh_gauges()
        return self._metrics.render()

    async def kill(self, replica_id: str, reason: str) -> str:
        if not self.leads():
            raise ConnectionError("standby lighthouse: not the leader (HA); ask the lighthouse that leads")
        address = self.core.manager_address(replica_id)
        if not address:
            raise KeyError(replica_id)
        self.core.store.record_event("kill", replica_id, reason=reason, address=address)
        if self.core.leases.holds(replica_id):
            self.core.revoke_lease(ls.Revoke(self.core.leases.holds(replica_id), "kill", f"operator kill of {replica_id}"))
        log.warning("[%s] forwarding Kill to its manager at %s: %s", replica_id, address, reason)
        metadata = [("authorization", f"Bearer {self._token}")] if self._token else None
        async with aio_channel(addrs.grpc_target(address), address, self._tls, channel_options()) as channel:
            call = channel.unary_unary(
                "/torchft.ManagerService/Kill",
                request_serializer=_raw,
                response_deserializer=pb.KillResponse.FromString,
            )
            try:
                await call(pb.KillRequest(msg=reason), timeout=KILL_TIMEOUT_S, metadata=metadata)
            except grpc.aio.AioRpcError as e:
                raise ConnectionError(f"manager at {address} answered {e.code().name}: {e.details()}") from None
        return address
