"""The job name: which of the jobs served by one lighthouse a call belongs to.

Every rallypoint lighthouse client sends it as gRPC metadata ``rallypoint-job`` (from the
argument, else ``RALLYPOINT_JOB``); a call without it belongs to the job ``default``. So
torchft's clients, which cannot send it, and rallypoint clients from before jobs existed
both land in ``default`` and see the lighthouse exactly as before. The default job's name is
never sent, so a default-job client's calls are byte-for-byte what they were.

A name is 1..63 characters of ``[A-Za-z0-9_.-]`` starting with a letter or digit: it becomes
part of a state file's name, an etcd key, a Prometheus label value and a URL query.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

JOB_ENV = "RALLYPOINT_JOB"
JOB_KEY = "rallypoint-job"
DEFAULT_JOB = "default"
MAX_JOB_CHARS = 63
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def check_job(name: str, source: str = "the job name") -> str:
    """``name`` if it is a valid job name; ValueError saying what is wrong otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source} is empty: give a job name such as 'default' or 'llama-7b'")
    if len(name) > MAX_JOB_CHARS or not _NAME.fullmatch(name):
        shown = name[:80] + ("..." if len(name) > 80 else "")
        raise ValueError(f"{source} {shown!r} is not a job name: use 1..{MAX_JOB_CHARS} characters of "
                         "letters, digits, '_', '.', '-', starting with a letter or digit")
    return name


def job_name(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The caller's job: ``explicit`` if given, else ``RALLYPOINT_JOB``, else ``default``."""
    if explicit is not None:
        return check_job(explicit)
    env = os.environ if environ is None else environ
    if JOB_ENV in env:
        return check_job(env[JOB_ENV], JOB_ENV)
    return DEFAULT_JOB


def job_metadata(job: str) -> list[tuple[str, str]]:
    """The call metadata naming ``job`` (none for the default job)."""
    return [] if job == DEFAULT_JOB else [(JOB_KEY, job)]


def job_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The job a call's metadata names (``default`` without one); ValueError for a bad name
    or a call that names two jobs."""
    found: str | None = None
    for key, value in metadata or ():
        if key != JOB_KEY:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if found is not None and text != found:
            raise ValueError(f"the call names two jobs in '{JOB_KEY}' metadata: {found!r} and {text[:80]!r}")
        found = text
    return DEFAULT_JOB if found is None else check_job(found, f"'{JOB_KEY}' metadata")


__all__ = ["DEFAULT_JOB", "JOB_ENV", "JOB_KEY", "MAX_JOB_CHARS", "check_job", "job_metadata", "job_name", "job_of"]
