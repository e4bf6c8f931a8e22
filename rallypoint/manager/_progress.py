"""Tell a supervising ``rallypoint run`` that this rank committed a step.

The supervisor names a file per rank and incarnation in ``RALLYPOINT_SUPERVISOR_PROGRESS``;
after a commit the Manager writes the step there (atomically: a temporary file, then a
rename), at most once per ``MIN_INTERVAL_S`` after the first. ``Manager.shutdown()``
writes ``<step> done`` (``finished``): no more commits are coming, the rank is winding up.
The supervisor reads the file to tell a crash loop (no commit between restarts) from a
group that works, and its hang watchdog times how long the file has not changed (not after
``done``). Without the variable (no supervisor) this does nothing; an error writing it is
never the training loop's problem.
"""

from __future__ import annotations

import os
import time

PROGRESS_ENV = "RALLYPOINT_SUPERVISOR_PROGRESS"  # rallypoint.supervisor.envs.PROGRESS_ENV
MIN_INTERVAL_S = 1.0

_last_write: dict[str, float] = {}  # path -> monotonic time of its last write


def committed(step: int) -> None:
    """Report ``step`` as committed (cheap: a dict lookup when nothing is due)."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    now = time.monotonic()
    last = _last_write.get(path)
    if last is not None and now - last < MIN_INTERVAL_S:
        return
    _last_write[path] = now
    _write(path, f"{step}\n")


def finished(step: int) -> None:
    """Report that no more commits are coming (the Manager shuts down): a supervisor's hang
    watchdog stops timing this rank, which may take a while to exit. Never throttled."""
    path = os.environ.get(PROGRESS_ENV)
    if path:
        _last_write.pop(path, None)
        _write(path, f"{step} done\n")


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass  # the supervisor's folder is gone (it is stopping us): nothing to tell


__all__ = ["MIN_INTERVAL_S", "PROGRESS_ENV", "committed", "finished"]
