"""The lighthouse's HTTP face: status JSON, Prometheus metrics, events, a dashboard, kill.

The FastAPI app is served by uvicorn *inside the lighthouse's own asyncio event loop*,
next to the gRPC server. That is the point of this module's shape:

* the view (:class:`LighthouseView`, implemented by the gRPC server) is only ever called
  on the loop thread, so it reads the quorum state without locks and without copying
  it across threads;
* :class:`HttpService` binds its socket itself (so IPv6 brackets, dual stack and port 0
  behave the same as for the gRPC port and a bind error names the address) and never
  lets uvicorn touch process signals or logging configuration: the lighthouse owns both.

With a token configured every route that reveals or changes state needs it (``/healthz``
and the dashboard shell stay open). A lighthouse serving many jobs (``jobs=``) picks the job
from ``?job=`` and checks each request against that job's credential
(:mod:`rallypoint.lighthouse._jobs_http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from rallypoint._net.job import DEFAULT_JOB
from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint._net.slots import closes_connection, evict_for_newcomer, proves_connection
from rallypoint._net.inject import Injection
from rallypoint._net.tls import TlsConfig, uvicorn_ssl_kwargs
from rallypoint.lighthouse._goodput_http import add_goodput_route
from rallypoint.lighthouse._http_bind import _bind_socket, _parse_bind  # noqa: F401 - _parse_bind: tests
from rallypoint.lighthouse._jobs_http import AUTH_HELP  # noqa: F401 - re-exported (tests, users)
from rallypoint.lighthouse._jobs_http import Admit, JobSource, Picked, add_job_routes, client_of
from rallypoint.lighthouse._jobs_http import default_admit, job_picker, single_job_picker
from rallypoint.lighthouse._http_body import DEFAULT_KILL_REASON  # noqa: F401 - re-exported (tests, users)
from rallypoint.lighthouse._http_body import kill_reason as _kill_reason, read_capped as _read_capped
from rallypoint.lighthouse.injections import MAX_REQUEST_BYTES, UnknownReplica, check_request, refusal_detail
from rallypoint.lighthouse.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

logger = logging.getLogger("rallypoint.lighthouse.http")

#: Where the dashboard lives: a file next to this module (shipped as package data),
#: read once. A path rather than importlib.resources because ``rallypoint.lighthouse``
#: may be a namespace package, and a plain path works for both layouts.
DASHBOARD_PATH = Path(__file__).with_name("static") / "dashboard.html"


#: How long a kill may wait for the manager. The view's own RPC should time out first;
#: this is the backstop so one stuck manager never pins an HTTP request forever.
KILL_TIMEOUT_S = 30.0

#: How long :meth:`HttpService.start` waits for uvicorn to report it is serving.
START_TIMEOUT_S = 10.0

#: Poll period while waiting for uvicorn's ``started`` flag (uvicorn has no event for it).
_START_POLL_S = 0.005

class LighthouseView(Protocol):
    """What the HTTP app needs from the lighthouse; implemented by the gRPC server.

    All methods are called on the event-loop thread, so implementations may read
    their state directly.
    """

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot: quorum, replicas, last decision, options, lighthouse."""
        ...

    def events(self, limit: int, since_id: int | None, replica_id: str | None) -> list[dict[str, Any]]:
        """Recent events, newest last or first as the server chooses, at most ``limit``."""
        ...

    def metrics(self) -> bytes:
        """Prometheus text exposition."""
        ...

    def inject_refusal(self, kind: str, authorization: str | None) -> str | None:
        """None when this caller may inject a ``kind`` fault; else why not (counted)."""
        ...

    def inject(self, name: str, inj: Injection) -> str:
        """Accept a fault injection; the replica it goes to (raises as ``_View.inject``)."""
        ...

    async def kill(self, replica_id: str, reason: str) -> str:
        """Forward Kill to the replica's manager and return the manager address.

        Raises ``KeyError(replica_id)`` for an unknown replica; any other exception
        means the manager could not be reached.
        """
        ...


@lru_cache(maxsize=1)
def _dashboard_html() -> str:
    """The dashboard page, read once: it is static and the lighthouse may run for weeks."""
    return DASHBOARD_PATH.read_text(encoding="utf-8")


_client = client_of  # the name tests and older code use
_INJECT_REFUSALS = Throttle(1.0)  # a flood of refused injections logs one line a second


def create_app(view: LighthouseView, token: str | None = None, *, jobs: JobSource | None = None,
               admit: Admit | None = None, on_reject: Callable[[str, str], None] | None = None) -> FastAPI:
    """Build the lighthouse's FastAPI app over ``view``.

    ``token``: when set, every route that reveals or changes state (``/status``,
    ``/events``, ``/metrics``, the kill route) needs ``Authorization: Bearer <token>``:
    the status lists every manager and store address. Only ``/healthz`` and the
    dashboard shell (``/``, which asks for the token) stay open.
    The interactive docs (/docs, /redoc) are off: they load scripts from a CDN, and
    lighthouses often run on hosts without internet access. ``/openapi.json`` is off too:
    it would answer without a token and map every route for a caller who has none.

    ``jobs`` (the lighthouse's job table): serve many jobs. Every state route then takes
    ``?job=NAME`` (default ``default``) and checks the caller with ``admit(job,
    authorization header)`` (default: ``jobs.admit`` over ``token`` and the table's
    configs) instead of ``token`` alone; ``GET /jobs`` lists the jobs the caller may see and
    ``GET /metrics`` merges theirs (see :mod:`rallypoint.lighthouse._jobs_http`). Without
    ``jobs`` the app serves ``view`` alone, as before jobs existed.
    """
    app = FastAPI(
        title="rallypoint lighthouse",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    if jobs is None:
        pick = single_job_picker(view, token)
    else:
        admits = admit if admit is not None else default_admit(token, jobs.configs)
        pick = job_picker(view, jobs, admits, on_reject)  # on_reject(job, why): each refused credential

    def status_doc(picked: Picked) -> dict[str, Any]:
        doc = picked.view.status()
        if jobs is None or "job" in doc:
            return doc  # type: ignore[no-any-return]
        return {**doc, "job": picked.job}  # which job this is: `rallypoint status --job` checks it

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        """The self-contained dashboard; it polls /status and /events."""
        return HTMLResponse(_dashboard_html(), headers={"Cache-Control": "no-cache"})

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> JSONResponse:
        """Liveness for load balancers and probes: reveals nothing."""
        return JSONResponse({"ok": True}, headers={"Cache-Control": "no-store"})

    @app.get("/status")
    async def status(picked: Picked = Depends(pick)) -> JSONResponse:
        """The view's status snapshot, passed through unchanged (with ``job`` added when
        the lighthouse serves jobs)."""
        return JSONResponse(status_doc(picked), headers={"Cache-Control": "no-store"})

    add_goodput_route(app, pick)  # GET /goodput: the goodput ledger

    if jobs is None:
        @app.get("/metrics")
        async def metrics(picked: Picked = Depends(pick)) -> Response:
            """Prometheus scrape endpoint."""
            return Response(picked.view.metrics(), media_type=METRICS_CONTENT_TYPE)
    else:
        add_job_routes(app, jobs, admits, token, pick, on_reject)  # GET /jobs, GET /metrics (every admitted job)

    @app.get("/events")
    async def events(
        picked: Picked = Depends(pick),
        limit: int = Query(100, ge=1, le=1000, description="at most this many events"),
        # A string so that an empty "since_id=" (what a form or a naive client sends)
        # means "no filter" instead of a 422; anything non-numeric is still a 422.
        since_id: str | None = Query(None, pattern=r"^\s*(-?\d{1,18})?\s*$", description="only events after this id"),
        replica_id: str | None = Query(None, description="only events about this replica"),
    ) -> JSONResponse:
        """Recent events from the lighthouse's event log."""
        since = int(since_id) if since_id is not None and since_id.strip() else None
        return JSONResponse(
            picked.view.events(limit=limit, since_id=since, replica_id=replica_id or None),
            headers={"Cache-Control": "no-store"},
        )

    # `:path` so replica ids with ':' or '/' (host:pid, job/group) still route; the
    # trailing "/kill" anchors the match.
    @app.post(
        "/replica/{replica_id:path}/kill",
        openapi_extra={
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "properties": {"reason": {"type": "string"}}}
                    }
                },
            }
        },
    )
    async def kill(replica_id: str, request: Request, picked: Picked = Depends(pick)) -> JSONResponse:
        """Ask the replica's manager to exit; the job then heals without it.

        Body (optional): ``{"reason": "..."}``, forwarded to the manager and logged.
        """
        reason = await _kill_reason(request)
        who = _who(replica_id, picked.job)
        started = time.monotonic()
        try:
            async with asyncio.timeout(KILL_TIMEOUT_S):
                address = await picked.view.kill(replica_id, reason)
        except KeyError:
            logger.info("kill of unknown %s requested by %s", who, _client(request))
            raise HTTPException(
                status_code=404,
                detail=(
                    f"unknown replica {replica_id!r}: the lighthouse has no replica with "
                    "this id (GET /status lists the known replicas)"
                    + ("" if picked.job == DEFAULT_JOB else f" in job {picked.job!r}")
                ),
            ) from None
        except TimeoutError:
            logger.warning("kill of %s: its manager did not answer within %.0f s", who, KILL_TIMEOUT_S)
            raise HTTPException(
                status_code=502,
                detail=(
                    f"could not kill replica {replica_id!r}: its manager did not answer "
                    f"within {KILL_TIMEOUT_S:.0f} s; check that the manager process is alive"
                ),
            ) from None
        except Exception as exc:  # the view's contract: anything else = manager unreachable
            logger.warning("kill of %s failed: %s: %s", who, type(exc).__name__, exc)
            raise HTTPException(
                status_code=502,
                detail=(
                    f"could not kill replica {replica_id!r}: its manager could not be "
                    f"reached: {type(exc).__name__}: {exc}"
                ),
            ) from None
        logger.warning(
            "killed %s (manager %s) on request of %s in %.3f s: %s",
            who,
            address,
            _client(request),
            time.monotonic() - started,
            reason,
        )
        return JSONResponse({"replica_id": replica_id, "address": address, "reason": reason})

    @app.post("/inject")
    async def inject(request: Request, picked: Picked = Depends(pick)) -> JSONResponse:
        """A fault injection (``rallypoint inject``; :mod:`rallypoint.lighthouse.injections`):
        ``{"kind": "slow", "replica": "replica_1", "factor": 3, "for_s": 30}``."""
        raw = await _read_capped(request, MAX_REQUEST_BYTES, "inject")
        try:
            name, inj = check_request(raw)
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from None
        why = picked.view.inject_refusal(inj.kind, request.headers.get("authorization"))
        if why is not None:  # off, or a caller admitted to the job (maybe an open one) without the right token
            left_out = _INJECT_REFUSALS.ready()
            if left_out is not None:
                logger.warning("refused a %s injection into job %r from %s: %s%s", inj.kind, picked.job,
                               _client(request), why, left_out_note(left_out, "other refusals"))
            raise HTTPException(status_code=403, detail=refusal_detail(why, inj.kind, picked.job))
        try:
            rid = picked.view.inject(name, inj)
        except UnknownReplica as e:
            raise HTTPException(status_code=404, detail=str(e)) from None
        except ValueError as e:  # a malformed request, or too many waiting for the replica
            raise HTTPException(status_code=422, detail=str(e)) from None
        except RuntimeError as e:
            raise HTTPException(status_code=409, detail=str(e)) from None
        logger.warning("injection %s (%s) into %s requested by %s", inj.id, inj.kind, _who(rid, picked.job),
                       _client(request))
        return JSONResponse({"id": inj.id, "kind": inj.kind, "replica_id": rid})

    return app


def _who(replica_id: str, job: str) -> str:
    """``replica 'x'``, with its job when not the default one (for log lines)."""
    return f"replica {replica_id!r}" + ("" if job == DEFAULT_JOB else f" of job {job!r}")


# --------------------------------------------------------------------------- serving


class _EmbeddedServer(uvicorn.Server):
    """uvicorn.Server that leaves process signals alone.

    uvicorn >= 0.29 swaps SIGINT/SIGTERM handlers in ``capture_signals()`` around
    ``serve()`` (and re-raises captured signals afterwards); older versions used
    ``install_signal_handlers()``. Both are neutralised: the lighthouse owns signals
    and stops this server through :meth:`HttpService.stop`.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return None


#: A connection must send a complete request head within this (also after each response).
HEAD_TIMEOUT_S = 10.0
#: Connections served at once. A newcomer beyond them replaces the oldest connection that
#: has not been proven yet (``_net.slots``: an accepted request, which on a lighthouse with a
#: credential means one that carried it), or is closed when every one has.
MAX_CONNECTIONS = 256
_REFUSALS = Throttle(10.0)  # a flood of connections logs one line per interval

#: ``prove(authorization header) -> bool``: whether a request's credential is one the
#: lighthouse accepts; None where no credential is configured.
Prove = Callable[[bytes | None], bool] | None
#: ``on_refused(status)``: told of each refused request whose connection was closed.
OnRefused = Callable[[int], None] | None


class _GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the bounds it lacks: a client that connects and sends
    nothing, or half a request head, is dropped after :data:`HEAD_TIMEOUT_S` (uvicorn would
    hold it forever, and enough of them exhaust the lighthouse's file descriptors, gRPC port
    included); at most :data:`MAX_CONNECTIONS` are open, where connections not yet proven by
    an accepted request give way to newcomers (so idle sockets cannot lock ``rallypoint
    status`` and the dashboard out); and a refused request (401, 403, 400, ...) closes its
    connection, so keep-alive sockets re-sending a bad token cannot hold slots either.
    :class:`HttpService` makes a subclass that sets ``_prove`` and ``_on_refused``."""

    _prove: Prove = None  # see Prove; None: no credential configured
    _on_refused: OnRefused = None  # called with the status of each refused request (metrics)
    _head_timer: asyncio.TimerHandle | None = None
    _accepted = 0.0
    _proven = False  # a request with a valid credential (or any, where none is configured) arrived
    _status = 0  # the status of the response being sent

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._accepted = time.monotonic()
        if len(self.connections) > MAX_CONNECTIONS:
            others = [c for c in self.connections if c is not self and isinstance(c, _GuardedH11)]
            pick = evict_for_newcomer([(c._accepted, c._proven) for c in others])
            left_out = _REFUSALS.ready()
            if left_out is not None:
                logger.warning("lighthouse HTTP endpoint: %d connections open; %s%s", len(self.connections),
                               "closing a newcomer: every one has sent an accepted request" if pick is None else
                               "closing the oldest without an accepted request for a newcomer",
                               left_out_note(left_out, "more"))
            if pick is None:
                transport.close()
                return
            victim = others[pick]
            self.connections.discard(victim)  # its slot is the newcomer's now
            victim.transport.close()
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._disarm()  # a whole request head arrived; the app answers it
            if not self._proven and proves_connection(self._credentialed(), self._prove is not None):
                self._proven = True  # (a refused answer closes the connection all the same)
            if "send" not in vars(cycle):  # learn the answer's status (run_asgi looks send up when it runs)
                original = cycle.send

                async def send(message: Any) -> None:
                    if message.get("type") == "http.response.start":
                        self._status = int(message.get("status", 0))
                        headers = list(message.get("headers", []))
                        if closes_connection(self._status) and not any(k.lower() == b"connection" for k, _ in headers):
                            # Say so, or a client reuses the connection we are about to close.
                            message = {**message, "headers": [*headers, (b"connection", b"close")]}
                    await original(message)

                cycle.send = send  # type: ignore[method-assign]

    def _credentialed(self) -> bool:
        if self._prove is None or self.cycle is None:
            return False
        header = next((v for k, v in self.cycle.scope.get("headers", ()) if k == b"authorization"), None)
        return bool(self._prove(header))

    def on_response_complete(self) -> None:
        status, self._status = self._status, 0
        if closes_connection(status):
            if self._on_refused is not None:
                self._on_refused(status)
            self.transport.close()  # a refused request: its connection goes (the answer is written first)
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class HttpService:
    """Runs an ASGI app with uvicorn as a task on the *current* asyncio loop.

    Not thread-safe: call :meth:`start` and :meth:`stop` from the loop that serves.
    """

    def __init__(self, app: FastAPI, bind: str, tls: TlsConfig | None = None, prove: Prove = None,
                 on_refused: OnRefused = None) -> None:
        """``prove(authorization header) -> bool``: whether a request carries a credential the
        lighthouse accepts (None: no credential is configured, any well-formed request proves
        its connection); ``on_refused(status)``: told of each request refused and its connection
        closed (metrics)."""
        self._bind = bind
        self._host, self._requested_port = _parse_bind(bind)
        self._scheme = tls.scheme() if tls is not None else "http"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # None: do not dictConfig() uvicorn's own handlers; its loggers propagate
            # to whatever logging the lighthouse set up.
            log_config=None,
            ws="none",
            http=type("_ServiceH11", (_GuardedH11,), {"_prove": staticmethod(prove) if prove is not None else None,
                                                       "_on_refused": staticmethod(on_refused)
                                                       if on_refused is not None else None}),
            server_header=False,
            **(uvicorn_ssl_kwargs(tls) if tls is not None else {}),
        )
        self._server = _EmbeddedServer(config)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        """The bound port once started (the real one for port 0), else the requested one."""
        return self._port if self._port is not None else self._requested_port

    def address(self) -> str:
        """An ``http://host:port`` (``https://`` over TLS) a client on this machine can use.

        For a wildcard bind that is the loopback address of the socket's family
        (127.0.0.1, or [::1] for an IPv6-only socket); otherwise the bound host.
        """
        host = self._host
        if host in ("", "::", "0.0.0.0"):
            host = "::1" if self._v6_only() else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"{self._scheme}://{host}:{self.port}"

    def _v6_only(self) -> bool:
        """Whether the bound socket is IPv6 and refuses IPv4 (so loopback must be ::1)."""
        sock = self._sock
        if sock is None or sock.family != socket.AF_INET6:
            return False
        try:
            return bool(sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY))
        except (OSError, AttributeError):
            return False

    async def start(self) -> None:
        """Bind, start uvicorn on this loop, and return once it accepts connections.

        Raises OSError (naming the bind address) when the socket cannot be bound, and
        RuntimeError when uvicorn stops or does not come up within START_TIMEOUT_S.
        """
        if self._task is not None:
            raise RuntimeError(f"HTTP service on {self._bind!r} was already started (it is one-shot)")
        sock = _bind_socket(self._bind, self._host, self._requested_port)
        self._sock = sock
        self._port = int(sock.getsockname()[1])
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name=f"lighthouse-http[{self._bind}]"
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                exc = None if self._task.cancelled() else self._task.exception()
                self._cleanup_socket()
                raise RuntimeError(
                    f"lighthouse HTTP endpoint on {self._bind!r} stopped while starting: {exc!r}"
                ) from exc
            if time.monotonic() > deadline:
                await self.stop(timeout=1.0)
                raise RuntimeError(
                    f"lighthouse HTTP endpoint on {self._bind!r} did not start within {START_TIMEOUT_S:.0f} s"
                )
            await asyncio.sleep(_START_POLL_S)
        self._task.add_done_callback(self._on_done)
        logger.info("lighthouse HTTP endpoint serving on %s (bind %s)", self.address(), self._bind)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        """Log if uvicorn ends on its own: the dashboard and metrics are then gone."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("lighthouse HTTP endpoint on %s crashed: %r", self._bind, exc, exc_info=exc)
        elif not self._server.should_exit:
            logger.warning("lighthouse HTTP endpoint on %s stopped unexpectedly", self._bind)

    def _cleanup_socket(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop serving: finish in-flight requests for up to half of ``timeout``, then
        cancel them; returns within ``timeout`` (1 s more if uvicorn must be cancelled).

        Idempotent; a service never started is a no-op. A stopped service cannot be
        started again (uvicorn servers are one-shot): build a new HttpService.
        """
        task = self._task
        if task is None:
            return
        if task.done():
            self._cleanup_socket()
            return
        timeout = max(0.2, float(timeout))
        # uvicorn's graceful phase: it waits this long for open requests, then cancels them.
        self._server.config.timeout_graceful_shutdown = max(0.1, timeout / 2)  # type: ignore[assignment]  # uvicorn accepts seconds as float
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=timeout)
        except TimeoutError:
            logger.warning(
                "lighthouse HTTP endpoint on %s did not stop within %.1f s; cancelling it", self.address(), timeout
            )
            self._server.force_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=1.0)
        except Exception as exc:  # the serve task failed; it is over either way
            logger.warning("lighthouse HTTP endpoint on %s ended with %r", self._bind, exc)
        finally:
            self._cleanup_socket()
        logger.info("lighthouse HTTP endpoint on %s stopped", self.address())
