"""The open-file limit of a process that serves connections.

Why: every connection a server accepts holds a file descriptor until the server drops it
(an idle one at the end of its handshake or head timeout, 10 s), and the soft limit many
hosts start a process with is 1,024. With it, anyone who can reach a port could hold the
descriptors with idle sockets, and the server could accept nothing else, not even its own
replicas (measured: at a soft limit of 256, 400 idle sockets to the lighthouse's gRPC port
made a quorum call fail after its 5 s connect timeout). The hard limit is what the host
allows the process; raising the soft limit up to it is what Go's runtime does at start.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("rallypoint.net")

#: The soft limit is raised at most this far (a hard limit may be "unlimited").
MAX_SOFT_LIMIT = 1 << 20


def wanted_soft_limit(soft: int, hard: int, infinity: int, cap: int = MAX_SOFT_LIMIT) -> int:
    """The soft limit to set: the hard one (``infinity`` stands for unlimited), at most
    ``cap``, and never below ``soft`` (a higher soft limit is left alone)."""
    target = cap if hard == infinity else min(hard, cap)
    return soft if soft == infinity else max(soft, target)


def raise_open_file_limit() -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (see the module docstring).
    Where the platform has no such limit or refuses, nothing changes."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = wanted_soft_limit(soft, hard, resource.RLIM_INFINITY)
    if want == soft:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # pragma: no cover - a platform that refuses
        logger.debug("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
        return
    logger.debug("raised the open-file limit from %d to %d", soft, want)


__all__ = ["MAX_SOFT_LIMIT", "raise_open_file_limit", "wanted_soft_limit"]
