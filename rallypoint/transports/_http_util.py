"""The receiving side's errors and limits, apart from ``http.py`` (the transport)."""

from __future__ import annotations

import os


class TransferError(RuntimeError):
    """A checkpoint could not be fetched from one source; retry with another."""


class TransferTimeout(TransferError, TimeoutError):
    """The checkpoint did not arrive within the timeout."""


class SourceRefused(TransferError):
    """The source answered with an error retrying it cannot fix (401, 404, 409, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


MAX_STATE_ENV = "RALLYPOINT_MAX_STATE_BYTES"


def default_max_state_bytes() -> int:
    """The largest state a receiver accepts unless told otherwise: ``RALLYPOINT_MAX_STATE_BYTES``,
    else this machine's physical memory (a larger state cannot be a legitimate heal here,
    and its header is refused before anything is allocated)."""
    raw = os.environ.get(MAX_STATE_ENV)
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{MAX_STATE_ENV}={raw!r} is not a number of bytes") from None
        if value <= 0:
            raise ValueError(f"{MAX_STATE_ENV} must be > 0, got {value}")
        return value
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


#: The most connections per source a receiver opens by default.
MAX_DEFAULT_CONNECTIONS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def default_connections(cpus: int) -> int:
    """Connections per source when the caller does not choose (``num_chunks=None``):
    ``MAX_DEFAULT_CONNECTIONS``, but no more than ``cpus``.

    Why: each connection's bytes are copied into the tensors by the thread that reads
    it, so connections beyond the cores add contention, not copying. On a 2-core host
    (1 GB in place, fresh process per fetch, 6 alternating runs each) 2 connections took
    0.36-0.45 s and 0.36-0.47 s of CPU against 0.45-0.52 s and 0.45-0.53 s with 4; into
    fresh tensors the two were equal within noise."""
    return max(1, min(MAX_DEFAULT_CONNECTIONS, cpus))

