"""The first code of every rank under ``rallypoint run``:
``python -m rallypoint.supervisor._rank [-m] target args...``.

It ties the rank's life to the supervisor's, then runs the training script (or module)
as ``python script.py`` / ``python -m module`` would: ``__name__ == "__main__"``,
``sys.argv`` = ``[script, *args]``, the script's folder first on ``sys.path``.

The tie: the supervisor holds the write end of a pipe (its *lifeline*) and passes the read
end here (``RALLYPOINT_SUPERVISOR_FD``). Nobody writes to it; when the supervisor dies, even
by SIGKILL, the kernel closes its end, the read here returns, and this rank kills itself
and its process group (its data loader workers, its own helpers). This backs up the
``PR_SET_PDEATHSIG`` the supervisor sets before exec, which misses a supervisor that died
between fork and prctl.

Seam for warm standbys (not built yet): a standby is this bootstrap started early, with
torch and ``--preload`` modules imported, that waits for its go (rank, incarnation,
environment) before it runs the script exactly as below.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading

LIFELINE_ENV = "RALLYPOINT_SUPERVISOR_FD"  # rallypoint.supervisor.envs.LIFELINE_ENV


def _die_with_supervisor(fd: int) -> None:
    """Block until the lifeline closes, then SIGKILL this rank (and its process group,
    when it leads one: the supervisor starts each rank in a session of its own)."""
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    if os.getpgrp() == os.getpid():
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def watch_lifeline(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Start the lifeline watcher if the supervisor passed one (the variable is removed,
    and the fd is not inherited by programs this rank execs). True if started."""
    raw = environ.pop(LIFELINE_ENV, None)
    if not raw:
        return False
    try:
        fd = int(raw)
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return False
    threading.Thread(target=_die_with_supervisor, args=(fd,), name="rallypoint-lifeline", daemon=True).start()
    return True


def main(argv: list[str]) -> None:
    watch_lifeline()
    if not argv:
        raise SystemExit("usage: python -m rallypoint.supervisor._rank [-m module | script.py] args...")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("-m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
