"""Tell a supervising ``rallypoint run`` that this rank committed a step.

The supervisor names a file per rank and incarnation in ``RALLYPOINT_SUPERVISOR_PROGRESS``;
after a commit the Manager writes the step there (atomically: a temporary file, then a
rename), at most once per ``MIN_INTERVAL_S`` after the first. The supervisor reads it to
tell a crash loop (no commit between restarts) from a group that works, and the hang
watchdog will read its age. Without the variable (no supervisor) this does nothing; an
error writing it is never the training loop's problem.
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
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(f"{step}\n")
        os.replace(tmp, path)
    except OSError:
        pass  # the supervisor's folder is gone (it is stopping us): nothing to tell


__all__ = ["MIN_INTERVAL_S", "PROGRESS_ENV", "committed"]
