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

Stack dumps: ``SIGUSR1`` makes this rank write every thread's Python stack to its stderr
(``faulthandler``), which the supervisor sends a hung rank before restarting its group. The
handler writes to a duplicate of the original stderr descriptor, so a script that replaces,
closes or redirects ``sys.stderr`` (or fd 2) does not lose the dump; a script that installs
its own ``SIGUSR1`` handler replaces this one (the supervisor then restarts the group
without a dump).

Seam for warm standbys (not built yet): a standby is this bootstrap started early, with
torch and ``--preload`` modules imported, that waits for its go (rank, incarnation,
environment) before it runs the script exactly as below.
"""

from __future__ import annotations

import faulthandler
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


_dump_file: object = None  # kept alive: faulthandler writes to its descriptor


def dump_stacks_on_sigusr1() -> bool:
    """Register the ``SIGUSR1`` stack dump (all threads) on a private duplicate of fd 2.
    True if registered."""
    global _dump_file
    try:
        fd = os.dup(2)  # not inheritable: programs this rank execs do not get it
    except OSError:
        return False
    try:
        f = os.fdopen(fd, "w")
    except OSError:
        os.close(fd)
        return False
    try:
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    except (OSError, RuntimeError, ValueError, AttributeError):
        f.close()
        return False
    _dump_file = f
    return True


def main(argv: list[str]) -> None:
    watch_lifeline()
    dump_stacks_on_sigusr1()
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
