"""Many jobs on one lighthouse: the rules, as pure functions over plain data.

Each job (named by the ``rallypoint-job`` call metadata, see :mod:`rallypoint._net.job`)
gets its own quorum state machine, state (its own SQLite file or etcd key prefix), event
log, leases, straggler scores, goodput ledger and metrics. Nothing is shared between jobs
but the process, the ports and the event loop, so one job's members, bad input or churn
never enter another job's quorum decision.

Credentials (``admit``):
- a job with its own token (``--jobs FILE``) takes that token, or the lighthouse's
  ``--token`` (the operator's credential, good for every job);
- a job without one takes the lighthouse's ``--token``;
- once any credential is configured, a job with none of its own is refused unless the
  jobs file marks it ``"open": true`` (for torchft's clients, which cannot send a token).
  A credential, once configured, guards everything by default; leaving a job open is a
  decision someone wrote down.
- with no credential configured at all, every job is open (as a lighthouse without
  ``--token`` was before jobs).

The jobs file (JSON, at most 1 MiB)::

    {"jobs": {"llama": {"token": "s3cret", "min_replicas": 2},
              "default": {"open": true}}}
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from rallypoint._net.auth import bearer_token, check_token
from rallypoint._net.job import DEFAULT_JOB, check_job

#: Default limit on the jobs one lighthouse serves (each costs a core, a state file, metrics).
DEFAULT_MAX_JOBS = 64
MAX_JOBS_FILE_BYTES = 1 << 20
#: The Prometheus label naming the job (``job`` itself belongs to Prometheus' scrape config).
JOB_LABEL = "rallypoint_job"


@dataclass(frozen=True)
class JobConfig:
    """What the jobs file says of one job."""

    token: str | None = None
    open: bool = False
    min_replicas: int | None = None


def parse_jobs(text: str, source: str = "the jobs file") -> dict[str, JobConfig]:
    """The jobs file's content -> {name: JobConfig}; ValueError naming the job and field."""
    if len(text.encode("utf-8", "replace")) > MAX_JOBS_FILE_BYTES:
        raise ValueError(f"{source} is larger than {MAX_JOBS_FILE_BYTES} bytes")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{source} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), dict) or set(doc) - {"jobs"}:
        raise ValueError(f'{source} must be an object {{"jobs": {{"<name>": {{"token": ..., "open": ..., '
                         '"min_replicas": ...}}}}}}')
    out: dict[str, JobConfig] = {}
    for name, spec in doc["jobs"].items():
        check_job(name, f"{source}: job name")
        where = f"{source}: job {name!r}"
        if not isinstance(spec, dict):
            raise ValueError(f"{where} must be an object")
        unknown = set(spec) - {"token", "open", "min_replicas"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)} (known: token, open, min_replicas)")
        token = spec.get("token")
        if token is not None:
            if not isinstance(token, str):
                raise ValueError(f"{where}: token must be a string")
            check_token(token, f"{where}: token")
        is_open = spec.get("open", False)
        if not isinstance(is_open, bool):
            raise ValueError(f"{where}: open must be true or false")
        if is_open and token is not None:
            raise ValueError(f"{where} is both open and has a token: choose one")
        mr = spec.get("min_replicas")
        if mr is not None and (not isinstance(mr, int) or isinstance(mr, bool) or not 1 <= mr <= 1_000_000):
            raise ValueError(f"{where}: min_replicas must be an integer >= 1")
        out[name] = JobConfig(token=token, open=is_open, min_replicas=mr)
    return out


def load_jobs(path: str) -> dict[str, JobConfig]:
    """The jobs file at ``path``, parsed (OSError/ValueError name the file)."""
    p = Path(path)
    if p.stat().st_size > MAX_JOBS_FILE_BYTES:
        raise ValueError(f"jobs file {path} is larger than {MAX_JOBS_FILE_BYTES} bytes")
    return parse_jobs(p.read_text(encoding="utf-8"), f"jobs file {path}")


def secured(lighthouse_token: str | None, jobs: Mapping[str, JobConfig]) -> bool:
    """Whether any credential is configured (then every call is checked)."""
    return lighthouse_token is not None or any(c.token is not None for c in jobs.values())


def admit(job: str, authorization: str | bytes | None, lighthouse_token: str | None,
          jobs: Mapping[str, JobConfig]) -> str | None:
    """None when a call for ``job`` carrying ``authorization`` may proceed; else why not
    ("no token", "wrong token", "job without a token"). Tokens compare in constant time."""
    if not secured(lighthouse_token, jobs):
        return None
    config = jobs.get(job, JobConfig())
    if config.open:
        return None
    given = bearer_token(authorization)
    if config.token is None and lighthouse_token is None:
        return "job without a token"
    if given is None:
        return "no token"
    for accepted in (config.token, lighthouse_token):
        if accepted is not None and hmac.compare_digest(given.encode("utf-8"), accepted.encode("utf-8")):
            return None
    return "wrong token"


def kill_credential(job: str, lighthouse_token: str | None, jobs: Mapping[str, JobConfig]) -> str | None:
    """The credential a kill the lighthouse forwards to a manager of ``job`` carries.

    A credential is only ever sent to a party that could have presented it, and a manager's
    address was registered by a caller admitted to ``job``, so the kill carries what every
    such caller holds: the job's own token (a job of the jobs file with one); nothing for an
    open job (anyone may register an address there, so it may be an attacker's server) or
    on a lighthouse without credentials; the lighthouse's ``--token`` only for a job guarded
    by nothing else (the one credential that admits callers to it). The operator's token is
    never sent for a job that has its own token or is open."""
    if not secured(lighthouse_token, jobs):
        return None
    config = jobs.get(job, JobConfig())
    if config.open:
        return None
    if config.token is not None:
        return config.token
    return lighthouse_token


def refusal_hint(job: str, why: str, http: bool = False) -> str:
    """What a refused caller is told (never which tokens exist); ``http``: the wording for
    an HTTP request (a header, not gRPC metadata)."""
    if why == "job without a token":
        return (f"job {job!r} has no token on this lighthouse and is not open: give it one in the lighthouse's "
                '--jobs file (or mark it "open": true), or pass the lighthouse\'s --token')
    how = "send the header 'Authorization: Bearer <token>'" if http else \
        "pass gRPC metadata 'authorization: Bearer <token>'"
    return (f"missing or wrong bearer token for job {job!r}: {how} (RALLYPOINT_TOKEN for rallypoint clients: "
            "the job's token from the lighthouse's --jobs file, or the lighthouse's --token)")


def state_path(base: str, job: str) -> str:
    """Where ``job`` keeps its state: the default job in ``base`` itself (so a state file
    from before jobs keeps its quorum_id), another beside it, ``<stem>.job-<name><suffix>``;
    ``:memory:`` stays in memory."""
    if job == DEFAULT_JOB or base == ":memory:":
        return base
    p = Path(base)
    return str(p.with_name(f"{p.stem}.job-{job}{p.suffix}"))


def etcd_namespace(job: str) -> str:
    """The key namespace of ``job`` under the etcd prefix ("" for the default job, so the
    keys of a lighthouse from before jobs are the default job's)."""
    return "" if job == DEFAULT_JOB else f"jobs/{job}/"


def merge_metrics(per_job: Iterable[tuple[str, Iterable[Metric]]]) -> list[Metric]:
    """Every job's metric families as one set: one family per name (HELP and TYPE once),
    in first-seen order. Each sample of a named job is labelled ``rallypoint_job``; the
    default job's samples are left as they were before jobs existed, so the series, alerts
    and dashboards of a one-job lighthouse do not change (``sum by (rallypoint_job)``
    shows the default job as the empty label)."""
    merged: dict[str, Metric] = {}
    for job, families in per_job:
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                labels: dict[str, Any] = dict(s.labels) if job == DEFAULT_JOB else {JOB_LABEL: job, **s.labels}
                out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    return list(merged.values())


__all__ = ["DEFAULT_MAX_JOBS", "JOB_LABEL", "JobConfig", "admit", "etcd_namespace", "kill_credential", "load_jobs",
           "merge_metrics",
           "parse_jobs", "refusal_hint", "secured", "state_path"]
