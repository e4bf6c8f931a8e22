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
import dataclasses
import logging
import threading
import uuid
from typing import Any, Callable

import grpc

from rallypoint._net import __version__
from rallypoint._net.auth import bearer_matches, job_token
from rallypoint._net.fds import raise_open_file_limit
from rallypoint._net.inject import inject_allowed
from rallypoint._net.job import DEFAULT_JOB, check_job
from rallypoint._net.peercap import PeerCap
from rallypoint._net.rpc import server_options
from rallypoint._net.tls import TlsConfig, add_port, check_server, tls_config
from rallypoint._net import addr as addrs
from rallypoint.lighthouse import reports
from rallypoint.lighthouse._jobtable import Job, JobTable
from rallypoint.lighthouse._service import JobTokenInterceptor, _handlers, _Service
from rallypoint.lighthouse.core import LighthouseCore
from rallypoint.lighthouse.etcd_auth import EtcdSecurity, check_etcd_security, etcd_security
from rallypoint.lighthouse.injections import inject_refusal
from rallypoint.lighthouse.etcd_state import EtcdSession, EtcdStore, is_etcd, parse_spec
from rallypoint.lighthouse.ha import Leadership
from rallypoint.lighthouse.jobs import (DEFAULT_MAX_JOBS, JobConfig, admit, etcd_namespace, kill_credential, secured,
                                        state_path)
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse._view import _View
from rallypoint.lighthouse.quorum import Options
from rallypoint.lighthouse.state import MEMORY, StateStore
from rallypoint.lighthouse.stragglers import Policy as StragglerPolicy

log = logging.getLogger("rallypoint.lighthouse")

DEFAULT_BIND = "[::]:29510"
DEFAULT_HTTP_PORT = 29511
DEFAULT_JOIN_TIMEOUT_MS = 60_000  # the `rallypoint lighthouse` command's (torchft_lighthouse's)
# The embedded LighthouseServer's, as torchft's Python binding (torchft._torchft.LighthouseServer):
# a lighthouse embedded in a script or a test waits 100 ms for healthy stragglers, not a minute.
EMBEDDED_JOIN_TIMEOUT_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000


class LighthouseServer:
    """A lighthouse running in a background thread (torchft's constructor, plus ours).

    ``state`` is ``":memory:"`` by default here (embedding in tests and jobs); the
    ``rallypoint lighthouse`` command defaults to a file. ``join_timeout_ms`` defaults to
    100 here, as in torchft's ``LighthouseServer`` binding (the command's default is 60000). ``http_bind`` enables the
    dashboard/status/metrics app (``None``: off). ``allow_inject``: accept fault injections
    (default: ``RALLYPOINT_ALLOW_INJECT=1``, else off). ``stragglers`` is the straggler policy
    (:class:`~rallypoint.lighthouse.stragglers.Policy`; default: report only). ``etcd``: TLS
    and user for a ``state`` of ``etcd://...`` (:mod:`~rallypoint.lighthouse.etcd_auth`; default
    ``RALLYPOINT_ETCD_*``); with ``tls.require`` a clear-text etcd is refused. Raises at
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
        jobs: dict[str, JobConfig] | None = None,
        max_jobs: int = DEFAULT_MAX_JOBS,
        allow_inject: bool | None = None,
        etcd: EtcdSecurity | None = None,
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
        self._etcd: EtcdSecurity | None = None
        if is_etcd(state):  # TLS and user for etcd: the argument, else RALLYPOINT_ETCD_*
            self._etcd = etcd or etcd_security()
            warning = check_etcd_security(parse_spec(state).endpoints, self._etcd, self._tls.require)
            if warning:
                log.warning("%s", warning)
        self._stragglers = stragglers or StragglerPolicy()
        # Called (on the loop thread) for a `lighthouse-restart` injection; None: this
        # lighthouse cannot restart itself (embedded in a process), and refuses it.
        self._on_restart = on_restart
        # Fault injection: off unless asked for (the argument, else RALLYPOINT_ALLOW_INJECT=1).
        self._allow_inject = inject_allowed(allow_inject)
        self._leases = leases  # grant quorum leases (LEASES.md); False: every round asks, as in torchft
        self._ha_ttl = ha_ttl_s  # state etcd://...: the leader's etcd lease (a dead leader is replaced after it)
        self._startup_timeout = startup_timeout
        # Many jobs (jobs.py): each job's token/open/min_replicas; jobs not listed start on
        # their first call with the lighthouse's defaults, up to max_jobs.
        self._jobs = dict(jobs or {})
        for name in self._jobs:
            check_job(name, "a job name of `jobs`")
        if max_jobs < max(1, len(self._jobs)):
            raise ValueError(f"max_jobs is {max_jobs}, but {len(self._jobs)} jobs are configured")
        self._max_jobs = max_jobs
        self.jobs: JobTable | None = None
        self.leadership: Leadership | None = None
        self.peer_cap: PeerCap | None = None  # the gRPC port's per-peer connection cap, once serving
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

        self._loop = loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        host, _ = addrs.split_host_port(self._bind)
        configs = self._jobs
        if not secured(self._token, configs) and not addrs.is_loopback(host):
            log.warning(
                "lighthouse bound to %s without a token: anyone who can reach it can join or "
                "kill replicas; pass --token-file PATH or set RALLYPOINT_TOKEN",
                self._bind,
            )
        if self._allow_inject:
            log.warning("fault injection is ON (--allow-inject): %s can kill, hang or corrupt replica groups",
                        "the operator's and each job's token holders" if secured(self._token, configs) else
                        "anyone who reaches this lighthouse (it has no token)")
        any_token = self._token or next((c.token for c in configs.values() if c.token), None)
        check_server(self._tls, "the lighthouse", host, any_token, addrs.is_loopback(host))
        session: EtcdSession | None = None
        if is_etcd(self._state_path):  # HA: the state lives in etcd; serve only while elected
            session = EtcdSession(parse_spec(self._state_path), uuid.uuid4().hex[:12], ttl=self._ha_ttl,
                                  security=self._etcd)
            await session.connect(min(3.0, self._startup_timeout / 2))  # EtcdUnavailable: a clear error
        http = None
        server: grpc.aio.Server | None = None
        election: asyncio.Task | None = None
        leads: Callable[[], bool] = lambda: True
        role: Callable[[], str] = lambda: "single"

        def make_job(name: str, st: StateStore) -> Job:
            config = configs.get(name, JobConfig())
            options = self._options
            if config.min_replicas is not None:
                options = dataclasses.replace(options, min_replicas=config.min_replicas)
            metrics = LighthouseMetrics()
            core = LighthouseCore(options, st, metrics, quorum_tick=self._tick, forget_after=self._forget_after,
                                  stragglers=self._stragglers, leases=self._leases)
            # The token a kill carries to the job's managers: the job's own, none for an open
            # job (jobs.kill_credential). Only the default job may restart the lighthouse (it
            # would cost every job a recovery).
            is_secured, operator = secured(self._token, configs), self._token

            def gate(kind: str, authorization: str | bytes | None) -> str | None:
                return inject_refusal(kind, name, authorization, self._allow_inject, operator, config.token, is_secured)

            view = _View(core, metrics, kill_credential(name, self._token, configs), self._tls,
                         self._on_restart if name == DEFAULT_JOB else None, job=name, inject_gate=gate)
            view.leads, view.role = (lambda: leads()), (lambda: role())
            return Job(name, core, metrics, view, reports.EventIntake(st, metrics))

        async def make_store(name: str) -> StateStore:
            if session is None:
                return StateStore(state_path(self._state_path, name))
            restored, events = await session.load(etcd_namespace(name))
            return EtcdStore(session, restored, events, loop, etcd_namespace(name))

        table = self.jobs = JobTable(make_store, make_job, configs, self._max_jobs)
        try:
            # A standby's default job is a placeholder in memory: it only answers status.
            first = make_job(DEFAULT_JOB, StateStore(MEMORY if session is not None else self._state_path))
            table.install(first)
            self.core = first.core
            for name in configs:  # configured jobs are served (and their state opened) from the start
                if name != DEFAULT_JOB and session is None:
                    await table.open(name)

            def on_reject(job: str | None, why: str) -> None:
                found = table.get(job) if job else None
                (found or table.default).metrics.rejected("invalid_argument" if why == "invalid job" else "unauthenticated")

            interceptors = []
            if secured(self._token, configs):
                token = self._token
                interceptors.append(JobTokenInterceptor(lambda job, hdr: admit(job, hdr, token, configs), on_reject))
            raise_open_file_limit()  # idle sockets from anyone must not exhaust our descriptors
            # At most so many connections per source address; admitted calls prove a connection.
            self.peer_cap = cap = PeerCap(name="lighthouse", on_refuse=lambda: table.default.metrics.rejected("peer_cap"))
            interceptors.append(cap.interceptor())
            server = grpc.aio.server(options=server_options() + cap.options(), interceptors=interceptors)
            service = _Service(table)
            ha: Leadership | None = None
            if session is not None:  # gated before the first call can arrive: a standby answers nothing
                table.running = False

                def install(elected: Job) -> None:
                    self.core = elected.core
                    table.install(elected)
                    table.running = True

                async def retire() -> None:
                    table.running = False
                    await table.retire(keep_default=True)

                self.leadership = ha = Leadership(session, "", lambda st: make_job(DEFAULT_JOB, st), install, retire)
                service.leads = leads = ha.leads
                role = ha.role
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
                first.core.start()  # an HA standby's placeholder core never runs: it only answers status
            if self._http_bind:
                token = self._token
                app = create_app(first.view, self._token, jobs=table,
                                 admit=lambda job, hdr: admit(job, hdr, token, configs), on_reject=on_reject)
                credentials = [t for t in (token, *(c.token for c in configs.values())) if t]

                def prove(header: Any) -> bool:  # a request with a credential we accept proves its connection
                    return any(bearer_matches(header, t) for t in credentials)

                http = HttpService(app, self._http_bind, tls=self._tls, prove=prove if credentials else None,
                                   on_refused=lambda _status: table.default.metrics.rejected("http_refused"))
                await http.start()
                self._http_address = http.address()
            log.info(
                "lighthouse %s listening on %s (gRPC%s)%s; min_replicas=%d join_timeout=%.1fs heartbeat_timeout=%.1fs "
                "state=%s stragglers=%s leases=%s jobs=%s (at most %d)",
                __version__,
                self.address(),
                ", TLS" + (" with client certificates" if self._tls.mutual else "") if self._tls.serving else "",
                f", {self._http_address} (HTTP)" if self._http_address else "",
                self._options.min_replicas,
                self._options.join_timeout,
                self._options.heartbeat_timeout,
                first.core.store.path,
                self._stragglers.describe(),
                "on" if self._leases else "off",
                ",".join(table.names()),
                self._max_jobs,
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
            await table.retire()  # every job's core stops (its waiting calls fail) and its state closes
            if server is not None:
                await server.stop(grace=1.0 if self._ready.is_set() else None)
            if http is not None:
                await http.stop()

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
        """The gRPC port the service listens on (the OS's pick when bound to port 0)."""
        return self._port

    def http_address(self) -> str | None:
        """The dashboard's base URL (``http://host:port``), or None when HTTP is off."""
        return self._http_address

    def status(self, timeout: float = 5.0, job: str = DEFAULT_JOB) -> dict:
        """A snapshot of a job's lighthouse state (what ``GET /status`` returns; KeyError
        for a job the lighthouse does not serve)."""
        return self._call(lambda: self._job(job).view.status(), timeout)

    def job_core(self, job: str) -> LighthouseCore:
        """The core serving ``job`` (KeyError if none does yet). Call on the loop thread,
        or for reading counters that a race cannot tear."""
        return self._job(job).core

    def _job(self, job: str) -> Job:
        found = self.jobs.get(job) if self.jobs is not None else None
        if found is None:
            raise KeyError(f"no job {job!r} on this lighthouse")
        return found

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
