"""The jobs one lighthouse serves, each with its own core, state, metrics and view (the
rules are in :mod:`jobs`). Runs on the lighthouse's event loop.

The default job exists from the start (an HA lighthouse's from its election); any other
job is created by its first call that passes authentication, up to ``max_jobs``. A job
stays until the lighthouse stops: its quorum_id must never go backwards, and it lives in
the job's state, which is kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from rallypoint._net.job import DEFAULT_JOB
from rallypoint.lighthouse import reports
from rallypoint.lighthouse.core import LighthouseCore
from rallypoint.lighthouse.jobs import DEFAULT_MAX_JOBS, JobConfig, merge_metrics
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse._view import _View
from rallypoint.lighthouse.state import StateStore

log = logging.getLogger("rallypoint.lighthouse")


class TooManyJobs(RuntimeError):
    """The lighthouse serves ``max_jobs`` jobs already."""


@dataclass
class Job:
    """One job's share of the lighthouse."""

    name: str
    core: LighthouseCore
    metrics: LighthouseMetrics
    view: _View
    reports: reports.EventIntake


class JobTable:
    """name -> :class:`Job`. ``make_store(name)`` opens (or, with etcd, loads) a job's
    state; ``make_job(name, store)`` builds the rest. Both run on the loop."""

    def __init__(self, make_store: Callable[[str], Awaitable[StateStore]],
                 make_job: Callable[[str, StateStore], Job], configs: dict[str, JobConfig] | None = None,
                 max_jobs: int = DEFAULT_MAX_JOBS) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self._make_store = make_store
        self._make_job = make_job
        self.configs = dict(configs or {})
        self.max_jobs = max_jobs
        self._jobs: dict[str, Job] = {}
        self._opening: dict[str, asyncio.Future[Job]] = {}
        self.running = True  # False: built cores are not started (an HA standby's placeholders)

    def get(self, name: str) -> Job | None:
        return self._jobs.get(name)

    def names(self) -> list[str]:
        return sorted(self._jobs)

    def jobs(self) -> list[Job]:
        return [self._jobs[n] for n in self.names()]

    @property
    def default(self) -> Job:
        return self._jobs[DEFAULT_JOB]

    def install(self, job: Job) -> None:
        """Serve ``job`` (the default job's core of a new HA term)."""
        self._jobs[job.name] = job

    async def open(self, name: str) -> Job:
        """The job named ``name``, created on first use; TooManyJobs past the limit."""
        job = self._jobs.get(name)
        if job is not None:
            return job
        pending = self._opening.get(name)
        if pending is not None:  # another call is creating it: share the result
            return await asyncio.shield(pending)
        if len(self._jobs) + len(self._opening) >= self.max_jobs:
            raise TooManyJobs(f"the lighthouse serves {self.max_jobs} jobs already (--max-jobs); job {name!r} "
                              "cannot start here: raise --max-jobs or run it on another lighthouse")
        fut: asyncio.Future[Job] = asyncio.get_running_loop().create_future()
        self._opening[name] = fut
        try:
            store = await self._make_store(name)
            job = self._make_job(name, store)
            if self.running:
                job.core.start()
            self._jobs[name] = job
            fut.set_result(job)
            log.warning("job %r: first call; serving it (state %s, min_replicas %d); %d job(s) now", name,
                        store.path, job.core.options.min_replicas, len(self._jobs))
            return job
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: a failure nobody else awaited is not "never retrieved"
            raise
        finally:
            self._opening.pop(name, None)

    async def retire(self, keep_default: bool = False) -> None:
        """Stop every job's core (the end of an HA term, or of the lighthouse); their
        waiting calls fail and their streams end. The default job's core is the caller's
        when ``keep_default``."""
        for name in list(self._jobs):
            if keep_default and name == DEFAULT_JOB:
                continue
            job = self._jobs.pop(name)
            try:
                await job.core.stop()
            finally:
                job.core.store.close()

    def render_metrics(self, names: Iterable[str] | None = None) -> bytes:
        """Every job's metrics, labelled ``rallypoint_job`` (Prometheus text); only the jobs
        in ``names`` when given (HTTP shows a caller only the jobs its token admits)."""
        per_job = []
        wanted = None if names is None else set(names)
        for job in self.jobs():
            if wanted is not None and job.name not in wanted:
                continue
            job.core.refresh_gauges()
            per_job.append((job.name, list(job.metrics.registry.collect())))
        merged = merge_metrics(per_job)

        class _Merged:
            def collect(self) -> list:
                return merged

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged())  # type: ignore[arg-type]
        return generate_latest(registry)

    def summary(self) -> list[dict]:
        """One line per job: what ``/jobs`` and ``rallypoint status --jobs`` show."""
        out = []
        for job in self.jobs():
            core = job.core
            config = self.configs.get(job.name, JobConfig())
            out.append({
                "job": job.name,
                "quorum_id": core.quorum_id,
                "members": list(core.previous.replica_ids) if core.previous else [],
                "healthy": len(core.heartbeats),
                "pending": len(core.pending),
                "min_replicas": core.options.min_replicas,
                "own_token": config.token is not None,
                "open": config.open,
                "state_path": core.store.path,
            })
        return out


__all__ = ["Job", "JobTable", "TooManyJobs"]
