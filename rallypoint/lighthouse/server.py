"""The lighthouse service: torchft's ``LighthouseService`` plus rallypoint's ``Attach``
liveness stream over one grpc.aio server, and the HTTP dashboard on the same loop.

The server is a thin shell: requests are validated (:mod:`validate`), handed to
:class:`~rallypoint.lighthouse.core.LighthouseCore`, and the decision is the pure
:func:`~rallypoint.lighthouse.quorum.decide`. :class:`LighthouseServer` runs all of it
in a background thread with its own event loop, mirroring torchft's
``LighthouseServer(bind, min_replicas, ...)`` so it can be embedded in tests and jobs;
``rallypoint lighthouse`` runs the same class as a service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from typing import Any, Callable

import grpc

from rallypoint._net import __version__
from rallypoint._net.auth import TokenInterceptor, job_token
from rallypoint._net.inject import INJECT_KEY, encode_injections
from rallypoint._net.lease import LEASE_KEY, encode_grant
from rallypoint._net.limits import MAX_REASON_BYTES, clip
from rallypoint._net.rpc import server_options, unary_handler
from rallypoint._net.tls import TlsConfig, add_port, check_server, tls_config
from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint._proto import torchft_pb2 as pb
from rallypoint._net import addr as addrs
from rallypoint.lighthouse import reports, validate
from rallypoint.lighthouse.core import OUTBOX_LIMIT, LighthouseCore, ReplicaDead, _Attachment
from rallypoint.lighthouse.injections import UnknownReplica, check_request
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse._view import _View
from rallypoint.lighthouse.quorum import Options
from rallypoint.lighthouse.state import MEMORY, StateStore
from rallypoint.lighthouse.etcd_state import EtcdSession, is_etcd, parse_spec
from rallypoint.lighthouse.ha import Leadership
from rallypoint.lighthouse.stragglers import Policy as StragglerPolicy

log = logging.getLogger("rallypoint.lighthouse")

DEFAULT_BIND = "[::]:29510"
DEFAULT_HTTP_PORT = 29511
DEFAULT_JOIN_TIMEOUT_MS = 60_000  # the `rallypoint lighthouse` command's (torchft_lighthouse's)
# The embedded LighthouseServer's, as torchft's Python binding (torchft._torchft.LighthouseServer):
# a lighthouse embedded in a script or a test waits 100 ms for healthy stragglers, not a minute.
EMBEDDED_JOIN_TIMEOUT_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000
# A stream must say hello promptly, or it is a confused client holding a slot.
HELLO_TIMEOUT_S = 10.0


def _raw(payload: Any) -> bytes:
    """Responses pre-serialized once per quorum pass through; others serialize."""
    return payload if isinstance(payload, bytes) else payload.SerializeToString()


class _Service:
    """gRPC handlers; each one validates, then delegates to the core."""

    def __init__(self, core: LighthouseCore, metrics: LighthouseMetrics, view: "_View",
                 leads: Callable[[], bool] = lambda: True) -> None:
        self.metrics = metrics
        self.view = view
        self.leads = leads  # False on an HA standby (and a deposed leader): refuse what needs the leader
        self.install(core)

    def install(self, core: LighthouseCore) -> None:
        """Serve from ``core`` (an HA lighthouse's own, once it is elected)."""
        self.core = core
        self.view.core = core
        self.reports = reports.EventIntake(core.store, self.metrics)

    def gated(self, fn: Callable[[Any, grpc.aio.ServicerContext], Any]) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
        """``fn``, refused with UNAVAILABLE ("standby lighthouse") unless this lighthouse
        leads: a client with several lighthouse addresses moves on to the next."""
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not self.leads():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "standby lighthouse: not the leader (HA); "
                                    "ask another lighthouse of the job")
            return await fn(request, context)
        return call

    async def status(self, _request: rpb.StatusRequest, _context: grpc.aio.ServicerContext) -> rpb.StatusResponse:
        return rpb.StatusResponse(json=json.dumps(self.view.status()))

    async def kill_replica(
        self, request: rpb.KillReplicaRequest, context: grpc.aio.ServicerContext
    ) -> rpb.KillReplicaResponse:
        try:
            rid = validate.replica_id(request.replica_id)
            why = validate.reason(request.reason)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        try:
            address = await self.view.kill(rid, why or "killed via the lighthouse")
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown replica {rid!r}: the lighthouse has no manager address for it")
            raise AssertionError("unreachable")
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"could not reach the manager of replica {rid}: {e}")
            raise AssertionError("unreachable")
        return rpb.KillReplicaResponse(address=address)

    async def report_event(
        self, request: rpb.SupervisorEvent, context: grpc.aio.ServicerContext
    ) -> rpb.ReportEventResponse:
        """A ``rallypoint run`` supervisor's event, into the event log (:mod:`reports`)."""
        try:
            report = reports.supervisor_event(request.group, request.kind, request.details)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        event = self.reports.accept(report, context.peer())
        if event is None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"event of group {report.group} dropped: over the lighthouse's rate limit for reported events",
            )
            raise AssertionError("unreachable")
        return rpb.ReportEventResponse(event_id=event.id)

    async def _invalid(self, context: grpc.aio.ServicerContext, err: Exception) -> None:
        self.metrics.rejected("invalid_argument")
        log.warning("rejected request from %s: %s", context.peer(), err)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def quorum(self, request: pb.LighthouseQuorumRequest, context: grpc.aio.ServicerContext) -> bytes:
        try:
            member = validate.quorum_request(request)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        log.debug("[%s] quorum request at step %d", member.replica_id, member.step)
        try:
            answer = await self.core.request_quorum(member)
        except ReplicaDead as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            raise AssertionError("unreachable")
        trailing = []
        injections = self.core.injections.take(member.replica_id)
        if injections:  # `rallypoint inject`: carried out by the group at its next step boundary
            trailing.append((INJECT_KEY, encode_injections(injections)))
        leased = self.core.leases.holds(member.replica_id)
        if leased:  # the quorum just answered is leased (LEASES.md); nothing revoked it since
            trailing.append((LEASE_KEY, encode_grant(leased, self.core.leases.report_every)))
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return answer

    async def inject(self, request: rpb.InjectRequest, context: grpc.aio.ServicerContext) -> rpb.InjectResponse:
        try:
            name, inj = check_request(request.json)
        except ValueError as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        try:
            rid = self.view.inject(name, inj)
        except UnknownReplica as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            raise AssertionError("unreachable")
        except (ValueError, RuntimeError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("unreachable")
        return rpb.InjectResponse(id=inj.id, replica_id=rid)

    async def heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.LighthouseHeartbeatResponse:
        try:
            rid = validate.replica_id(request.replica_id)
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            raise AssertionError("unreachable")
        self.core.heartbeat(rid)
        return pb.LighthouseHeartbeatResponse()

    async def attach(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        """Hold a replica's liveness stream; its end without a goodbye is a crash."""
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await self._invalid(context, validate.InvalidRequest(f"no hello within {HELLO_TIMEOUT_S:.0f}s"))
            return
        if first is not grpc.aio.EOF:
            try:
                first = _attach_request(first)
            except validate.InvalidRequest as e:
                await self._invalid(context, e)
                return
        if first is grpc.aio.EOF or not first.HasField("hello"):
            await self._invalid(context, validate.InvalidRequest("the first Attach message must be a hello"))
            return
        try:
            rid = validate.replica_id(first.hello.replica_id, "hello.replica_id")
            validate.address(first.hello.address, "hello.address")
        except validate.InvalidRequest as e:
            await self._invalid(context, e)
            return
        att = self.core.attach(rid, first.hello.address, first.hello.leases, max(0, first.hello.lease_quorum_id))
        log.info("[%s] liveness stream attached from %s", rid, context.peer())
        clean, reason = False, "connection lost"
        invalid: validate.InvalidRequest | None = None
        reader = asyncio.ensure_future(self._read(context, att))
        writer: asyncio.Future | None = None
        overflow: asyncio.Future | None = None
        try:
            await context.write(self.core.welcome())
            # One writer for the stream's life: a push costs a queue get and a write, not
            # a task and a wait per message (a revoke goes to every member at once).
            writer = asyncio.ensure_future(self._write(context, att))
            overflow = asyncio.ensure_future(att.overflow.wait())
            done, _ = await asyncio.wait({reader, writer, overflow}, return_when=asyncio.FIRST_COMPLETED)
            if overflow in done:
                reason = f"dropped: more than {OUTBOX_LIMIT} notices unread (the replica is not reading its stream)"
            elif reader in done:
                clean, reason = reader.result()
            else:
                writer.result()  # raises what broke the write side
        except validate.InvalidRequest as e:
            invalid, reason = e, f"invalid message on the stream: {e}"
        except asyncio.CancelledError:
            # The peer vanished or the server is stopping; the RPC is over either way.
            # Returning (not re-raising) keeps grpc from logging it as unhandled.
            pass
        except Exception as e:  # the write side broke: the peer is gone
            reason = f"stream error: {e!r}"
        finally:
            reader.cancel()
            if writer is not None:
                writer.cancel()
            if overflow is not None:
                overflow.cancel()
            self.core.detach(att, clean=clean, reason=reason)
        if invalid is not None:
            await self._invalid(context, invalid)

    @staticmethod
    async def _write(context: grpc.aio.ServicerContext, att: _Attachment) -> None:
        while True:
            await context.write(await att.outbox.get())

    async def _read(self, context: grpc.aio.ServicerContext, att: _Attachment) -> tuple[bool, str]:
        while True:
            try:
                msg = await context.read()
            except Exception as e:
                return False, f"connection lost: {e!r}"
            if msg is grpc.aio.EOF:
                return False, "stream closed without a goodbye"
            msg = _attach_request(msg)  # InvalidRequest ends only this caller's stream
            if msg.HasField("goodbye"):
                # Forwarded to every other replica as a PeerDown: bounded first.
                return True, clip(msg.goodbye.reason, MAX_REASON_BYTES) or "goodbye"
            self.core.heartbeat(att.replica_id)
            if msg.HasField("step_report"):  # a round started on a lease: checked like a Quorum's data
                report = msg.step_report
                if report.step < 0:
                    raise validate.InvalidRequest(f"step_report.step must be >= 0, got {report.step}")
                # Size first; the content is parsed once, by the scorer (malformed: unscored, as a Quorum's step stats).
                self.core.step_report(att.replica_id, report.step, validate.data_size(report.data, "step_report.data"))


def _attach_request(raw: bytes) -> rpb.AttachRequest:
    """One message of an Attach stream, parsed; InvalidRequest when it is not one."""
    try:
        return rpb.AttachRequest.FromString(raw)
    except Exception as e:  # noqa: BLE001 - DecodeError, RecursionError: all mean "not a message"
        raise validate.InvalidRequest(f"the stream message is not a valid rallypoint.AttachRequest: {e}"[:500]) from None


def _handlers(service: _Service) -> list[grpc.GenericRpcHandler]:
    def invalid() -> None:
        service.metrics.rejected("invalid_argument")

    lighthouse = grpc.method_handlers_generic_handler(
        "torchft.LighthouseService",
        {
            "Quorum": unary_handler(service.gated(service.quorum), pb.LighthouseQuorumRequest, _raw, invalid),
            "Heartbeat": unary_handler(service.gated(service.heartbeat), pb.LighthouseHeartbeatRequest, _raw, invalid),
        },
    )
    extension = grpc.method_handlers_generic_handler(
        "rallypoint.RallypointLighthouse",
        {
            # Parsed by the handler (_attach_request): malformed bytes are INVALID_ARGUMENT.
            "Attach": grpc.stream_stream_rpc_method_handler(service.gated(service.attach), response_serializer=_raw),
            "Status": unary_handler(service.status, rpb.StatusRequest, _raw, invalid),
            "KillReplica": unary_handler(service.gated(service.kill_replica), rpb.KillReplicaRequest, _raw, invalid),
            "ReportEvent": unary_handler(service.gated(service.report_event), rpb.SupervisorEvent, _raw, invalid),
            "Inject": unary_handler(service.gated(service.inject), rpb.InjectRequest, _raw, invalid),
        },
    )
    return [lighthouse, extension]


class LighthouseServer:
    """A lighthouse running in a background thread (torchft's constructor, plus ours).

    ``state`` is ``":memory:"`` by default here (embedding in tests and jobs); the
    ``rallypoint lighthouse`` command defaults to a file. ``join_timeout_ms`` defaults to
    100 here, as in torchft's ``LighthouseServer`` binding (the command's default is 60000). ``http_bind`` enables the
    dashboard/status/metrics app (``None``: off). ``stragglers`` is the straggler policy
    (:class:`~rallypoint.lighthouse.stragglers.Policy`; default: report only). Raises at
    construction if the port is taken or the state file is held by another lighthouse.
    """

    def __init__(
        self,
        bind: str = DEFAULT_BIND,
        min_replicas: int = 1,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        *,
        http_bind: str | None = None,
        state: str = ":memory:",
        token: str | None = None,
        forget_after_ms: int | None = None,
        startup_timeout: float = 30.0,
        tls: TlsConfig | None = None,
        stragglers: StragglerPolicy | None = None,
        on_restart: Callable[[], None] | None = None,
        leases: bool = True,
        ha_ttl_s: float = 2.0,
    ) -> None:
        self._options = Options(
            min_replicas=min_replicas,
            join_timeout=(join_timeout_ms if join_timeout_ms is not None else EMBEDDED_JOIN_TIMEOUT_MS) / 1000,
            heartbeat_timeout=(heartbeat_timeout_ms if heartbeat_timeout_ms is not None else DEFAULT_HEARTBEAT_TIMEOUT_MS)
            / 1000,
        )
        if quorum_tick_ms is not None and quorum_tick_ms <= 0:
            raise ValueError(f"quorum_tick_ms must be > 0, got {quorum_tick_ms}")
        self._bind = addrs.grpc_target(bind)
        self._http_bind = http_bind
        self._tick = quorum_tick_ms / 1000 if quorum_tick_ms else None
        self._forget_after = forget_after_ms / 1000 if forget_after_ms else None
        self._token = job_token(token)  # the argument, else RALLYPOINT_TOKEN; empty is an error
        self._tls = tls or tls_config()  # the argument, else RALLYPOINT_TLS_*
        self._state_path = state
        self._stragglers = stragglers or StragglerPolicy()
        # Called (on the loop thread) for a `lighthouse-restart` injection; None: this
        # lighthouse cannot restart itself (embedded in a process), and refuses it.
        self._on_restart = on_restart
        self._leases = leases  # grant quorum leases (LEASES.md); False: every round asks, as in torchft
        self._ha_ttl = ha_ttl_s  # state etcd://...: the leader's etcd lease (a dead leader is replaced after it)
        self._startup_timeout = startup_timeout
        self.leadership: Leadership | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._port = 0
        self._http_address: str | None = None
        self.core: LighthouseCore | None = None
        self._thread = threading.Thread(target=self._thread_main, name="rallypoint-lighthouse", daemon=True)
        self._thread.start()
        if not self._ready.wait(startup_timeout):
            raise TimeoutError(f"lighthouse did not start within {startup_timeout}s on {self._bind}")
        if self._error is not None:
            self._thread.join(5)
            raise self._error

    # ------------------------------------------------------------------ thread
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced to the constructor or logged
            if not self._ready.is_set():
                self._error = e
                self._ready.set()
            else:
                log.exception("lighthouse loop crashed")

    async def _main(self) -> None:
        from rallypoint.lighthouse.http import HttpService, create_app

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        host, _ = addrs.split_host_port(self._bind)
        if self._token is None and not addrs.is_loopback(host):
            log.warning(
                "lighthouse bound to %s without a token: anyone who can reach it can join or "
                "kill replicas; pass --token or set RALLYPOINT_TOKEN",
                self._bind,
            )
        check_server(self._tls, "the lighthouse", host, self._token, addrs.is_loopback(host))
        session: EtcdSession | None = None
        if is_etcd(self._state_path):  # HA: the state lives in etcd; serve only while elected
            session = EtcdSession(parse_spec(self._state_path), uuid.uuid4().hex[:12], ttl=self._ha_ttl)
            await session.connect(min(3.0, self._startup_timeout / 2))  # EtcdUnavailable: a clear error
        store = StateStore(MEMORY if session is not None else self._state_path)  # a standby's is a placeholder
        metrics = LighthouseMetrics()
        http = None
        core: LighthouseCore | None = None
        server: grpc.aio.Server | None = None
        election: asyncio.Task | None = None

        def make_core(st: StateStore) -> LighthouseCore:
            return LighthouseCore(self._options, st, metrics, quorum_tick=self._tick, forget_after=self._forget_after,
                                  stragglers=self._stragglers, leases=self._leases)

        try:
            core = make_core(store)
            self.core = core
            interceptors = [TokenInterceptor(self._token, lambda _m, _w: metrics.rejected("unauthenticated"))] if self._token else []
            server = grpc.aio.server(options=server_options(), interceptors=interceptors)
            view = _View(core, metrics, self._token, self._tls, self._on_restart)
            service = _Service(core, metrics, view)
            ha: Leadership | None = None
            if session is not None:  # gated before the first call can arrive: a standby answers nothing
                def install(elected: LighthouseCore) -> None:
                    self.core = elected
                    service.install(elected)

                self.leadership = ha = Leadership(session, "", make_core, install)
                service.leads = view.leads = ha.leads
                view.role = ha.role
            server.add_generic_rpc_handlers(_handlers(service))
            try:
                port = add_port(server, self._bind, self._tls)
            except RuntimeError as e:
                raise OSError(f"cannot bind the lighthouse to {self._bind}: {e}") from None
            if not port:
                raise OSError(f"cannot bind the lighthouse to {self._bind} (address in use?)")
            self._port = port
            await server.start()
            if session is None:
                core.start()  # an HA standby's placeholder core never runs: it only answers status
            if self._http_bind:
                http = HttpService(create_app(view, self._token), self._http_bind, tls=self._tls)
                await http.start()
                self._http_address = http.address()
            log.info(
                "lighthouse %s listening on %s (gRPC%s)%s; min_replicas=%d join_timeout=%.1fs heartbeat_timeout=%.1fs "
                "state=%s stragglers=%s leases=%s",
                __version__,
                self.address(),
                ", TLS" + (" with client certificates" if self._tls.mutual else "") if self._tls.serving else "",
                f", {self._http_address} (HTTP)" if self._http_address else "",
                self._options.min_replicas,
                self._options.join_timeout,
                self._options.heartbeat_timeout,
                store.path,
                self._stragglers.describe(),
                "on" if self._leases else "off",
            )
            if ha is not None and session is not None:
                ha.address = self.address()
                election = asyncio.ensure_future(ha.run(self._stop))
                log.info("HA lighthouse: standby until elected (state %s)", session.spec)
            self._ready.set()
            await self._stop.wait()
            log.info("lighthouse shutting down")
        finally:
            if election is not None:
                await asyncio.wait({election}, timeout=10.0)
            if self.leadership is not None:
                await self.leadership.close()
            # Also on a failed start (e.g. the HTTP port is taken): stop the gRPC server
            # that may already be listening, or its port stays bound in this process.
            if core is not None:
                await core.stop()
            if server is not None:
                await server.stop(grace=1.0 if self._ready.is_set() else None)
            if http is not None:
                await http.stop()
            store.close()

    # ------------------------------------------------------------------ API
    def address(self) -> str:
        """``http://host:port`` of the gRPC service (torchft's spelling; ``https://`` over TLS)."""
        host, _ = addrs.split_host_port(self._bind)
        return f"{self._tls.scheme()}://{addrs.join_host_port(addrs.advertised_host(host), self._port)}"

    def local_address(self) -> str:
        """A loopback address of the gRPC service, for clients on this machine."""
        host, _ = addrs.split_host_port(self._bind)
        if addrs.is_wildcard(host):
            host = "::1" if host in ("::", "[::]") and _has_ipv6() else "127.0.0.1"
        return f"{self._tls.scheme()}://{addrs.join_host_port(host, self._port)}"

    @property
    def port(self) -> int:
        return self._port

    def http_address(self) -> str | None:
        return self._http_address

    def status(self, timeout: float = 5.0) -> dict:
        """A snapshot of the lighthouse state (what ``GET /status`` returns)."""
        return self._call(lambda: self.core.status(), timeout)  # type: ignore[union-attr]

    def _call(self, fn: Any, timeout: float) -> Any:
        assert self._loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving; pending Quorum calls fail with UNAVAILABLE. Idempotent."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("lighthouse thread did not stop within %.1fs", timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (for the CLI); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "LighthouseServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _has_ipv6() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
