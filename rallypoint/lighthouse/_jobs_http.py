"""Which job an HTTP request is about, and whether its caller may see it.

Apart from :mod:`rallypoint.lighthouse.http` so that module stays the app's frame. Every
route that reveals or changes a job's state takes the job from the query parameter
``job`` (default ``default``) through one FastAPI dependency, :func:`job_picker`, so no
route can forget the credential check: a job A token never reads or changes job B.

The checks run in this order, and why:
1. a malformed name is a 400 (it could never name a job);
2. the credential (``admit``) before existence, so that a caller who may not see a job
   cannot learn whether it exists either (a 401 for every job it has no token for);
3. a job the lighthouse does not serve is a 404: HTTP never creates a job (only a gRPC
   call that passes authentication does), so a typo in a URL costs nothing.

``GET /jobs`` and ``GET /metrics`` (every job at once) list only the jobs the caller's
credential admits.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from rallypoint._net.auth import bearer_matches, bearer_token
from rallypoint._net.job import DEFAULT_JOB, check_job
from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint.lighthouse import jobs as rules
from rallypoint.lighthouse.jobs import JobConfig
from rallypoint.lighthouse.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

logger = logging.getLogger("rallypoint.lighthouse.http")

#: ``admit(job, authorization header) -> None`` (allowed) or why not (see ``jobs.admit``).
Admit = Callable[[str, str | None], str | None]

AUTH_HELP = (
    "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
    "(the lighthouse's --token / RALLYPOINT_TOKEN)"
)

NO_JOB_ADMITTED = (
    "missing or wrong bearer token: no job on this lighthouse admits it; send 'Authorization: Bearer <token>' "
    "(a job's token from the lighthouse's --jobs file, or the lighthouse's --token)"
)


class JobEntry(Protocol):
    """What the HTTP app uses of one served job (``_jobtable.Job``)."""

    @property
    def view(self) -> Any: ...


class JobSource(Protocol):
    """What the HTTP app needs of the lighthouse's jobs (``_jobtable.JobTable``)."""

    configs: dict[str, JobConfig]

    def get(self, name: str) -> Any: ...

    def names(self) -> list[str]: ...

    def summary(self) -> list[dict]: ...

    def render_metrics(self, names: Iterable[str] | None = None) -> bytes: ...


@dataclass(frozen=True)
class Picked:
    """The job a request is about and the view that serves it."""

    job: str
    view: Any


def client_of(request: Request) -> str:
    """``host:port`` of the caller, for log lines about who was refused or who killed."""
    if request.client is None:
        return "unknown client"
    return f"{request.client.host}:{request.client.port}"


def _job_name(job: str | None) -> str:
    """The job a ``job`` query parameter names (absent or empty: the default job); a
    400 for a malformed one."""
    if job is None or job == "":
        return DEFAULT_JOB
    try:
        return check_job(job, "the query parameter job")
    except ValueError as e:
        raise HTTPException(status_code=400, detail=str(e)) from None


def _no_such_job(name: str) -> HTTPException:
    return HTTPException(
        status_code=404,
        detail=f"no such job {name!r} on this lighthouse: a job exists once a replica group of it has called the "
               "lighthouse over gRPC (GET /jobs lists the jobs your token may see)",
    )


class _Refusals:
    """Logs refused requests, at most one line a second (the rest counted), so a flood of
    unauthenticated requests cannot flood the log too."""

    def __init__(self) -> None:
        self._throttle = Throttle(1.0)

    def log(self, request: Request, job: str | None, why: str) -> None:
        left_out = self._throttle.ready()
        if left_out is None:
            return
        about = f" (job {job!r})" if job is not None else ""
        logger.warning("refused %s %s%s from %s: %s%s", request.method, request.url.path, about, client_of(request),
                       why, left_out_note(left_out, "other refusals"))


def single_job_picker(view: Any, token: str | None) -> Callable[..., Awaitable[Picked]]:
    """The dependency of an app over one view (no job table): the lighthouse's token as
    before jobs existed; ``?job=`` may only name the default job (anything else is a 404,
    never another job's data under the wrong name)."""
    refusals = _Refusals()

    async def pick(request: Request, job: str | None = Query(None, description="the job (only 'default' here)")
                   ) -> Picked:
        if token:
            header = request.headers.get("authorization")
            if not bearer_matches(header, token):
                refusals.log(request, None, "wrong bearer token" if bearer_token(header) is not None
                             else "no bearer token")
                raise HTTPException(status_code=401, detail=AUTH_HELP, headers={"WWW-Authenticate": "Bearer"})
        name = _job_name(job)
        if name != DEFAULT_JOB:
            raise _no_such_job(name)
        return Picked(DEFAULT_JOB, view)

    return pick


def default_admit(token: str | None, configs: Mapping[str, JobConfig]) -> Admit:
    """``jobs.admit`` over the lighthouse's token and jobs file."""
    return lambda job, header: rules.admit(job, header, token, configs)


def job_picker(view: Any, jobs: JobSource, admit: Admit,
               on_reject: Callable[[str, str], None] | None = None) -> Callable[..., Awaitable[Picked]]:
    """The dependency of an app over a job table: the job of ``?job=`` (default
    ``default``), checked as the module docstring says. ``view`` serves the default job
    while the table has none (an HA standby before its first term). ``on_reject(job, why)``
    is told of each refused credential (the lighthouse counts it in ``/metrics``)."""
    refusals = _Refusals()

    async def pick(request: Request, job: str | None = Query(None, description="the job (default: 'default')")
                   ) -> Picked:
        name = _job_name(job)
        why = admit(name, request.headers.get("authorization"))
        if why is not None:
            refusals.log(request, name, why)
            if on_reject is not None:
                on_reject(name, why)
            raise HTTPException(status_code=401, detail=rules.refusal_hint(name, why, http=True),
                                headers={"WWW-Authenticate": "Bearer"})
        entry = jobs.get(name)
        if entry is not None:
            return Picked(name, entry.view)
        if name == DEFAULT_JOB:
            return Picked(name, view)
        raise _no_such_job(name)

    return pick


def add_job_routes(app: FastAPI, jobs: JobSource, admit: Admit, token: str | None,
                   pick: Callable[..., Awaitable[Picked]],
                   on_reject: Callable[[str, str], None] | None = None) -> None:
    """Register ``GET /jobs`` and the every-job ``GET /metrics`` (called by ``create_app``);
    ``on_reject(job, why)`` counts each refused credential, as for the per-job routes."""
    refusals = _Refusals()

    def admitted(request: Request) -> list[str]:
        """The jobs the request's credential admits; a 401 when the lighthouse is secured and
        it admits none (an open lighthouse answers an empty list)."""
        header = request.headers.get("authorization")
        names = [n for n in jobs.names() if admit(n, header) is None]
        if not names and rules.secured(token, jobs.configs):
            refusals.log(request, None, "admitted by no job")
            if on_reject is not None:
                on_reject(DEFAULT_JOB, "admitted by no job")
            raise HTTPException(status_code=401, detail=NO_JOB_ADMITTED, headers={"WWW-Authenticate": "Bearer"})
        return names

    @app.get("/jobs")
    async def list_jobs(request: Request) -> JSONResponse:
        """The jobs this lighthouse serves that the caller may see: name, quorum, members."""
        names = set(admitted(request))
        return JSONResponse([row for row in jobs.summary() if row.get("job") in names],
                            headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    async def metrics(request: Request, job: str | None = Query(None, description="only this job")) -> Response:
        """Prometheus scrape endpoint: every admitted job's metrics, each sample labelled
        ``rallypoint_job``; ``?job=NAME`` for one job."""
        names = [(await pick(request, job)).job] if job else admitted(request)
        return Response(jobs.render_metrics(names), media_type=METRICS_CONTENT_TYPE)


__all__ = ["AUTH_HELP", "Admit", "JobSource", "NO_JOB_ADMITTED", "Picked", "add_job_routes", "client_of",
           "default_admit", "job_picker", "single_job_picker"]
