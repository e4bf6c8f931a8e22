"""The first code of every rank under ``rallypoint run``:
``python -m rallypoint.supervisor._rank [-m] target args...``.

It ties the rank's life to the supervisor's, then runs the training script (or module)
as ``python script.py`` / ``python -m module`` would: ``__name__ == "__main__"``,
``sys.argv`` = ``[script, *args]``, the script's folder first on ``sys.path``.

The tie: the supervisor holds the write end of a pipe (its *lifeline*) and passes the read
end here (``RALLYPOINT_SUPERVISOR_FD``). Nobody writes to it; when the supervisor dies, even
by SIGKILL, the kernel closes its end, the read here returns, and this rank kills itself
and its process group (its data loader workers, its own helpers). With the
``PR_SET_PDEATHSIG`` this rank sets first thing, it covers a supervisor that died between
the fork and that call.

Stack dumps: ``SIGUSR1`` makes this rank write every thread's Python stack to its stderr
(``faulthandler``), which the supervisor sends a hung rank before restarting its group. The
handler writes to a duplicate of the original stderr descriptor, so a script that replaces,
closes or redirects ``sys.stderr`` (or fd 2) does not lose the dump; a script that installs
its own ``SIGUSR1`` handler replaces this one (the supervisor then restarts the group
without a dump).

Warm standbys (``--standby [--preload m1,m2]`` before the target): the same bootstrap,
started ahead of a failure. It imports torch, the torch side of rallypoint and the
``--preload`` modules (from the script's folder too, as the script would), marks itself
ready (creates the file named by ``RALLYPOINT_STANDBY_READY``, holding its pid) and waits on its stdin for
its go: one JSON object ``{"env": {...}}``, the environment of the rank and incarnation it
becomes (``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT`` are only known then). It
replaces its environment with that one (``os.environ``, so C++ code reading ``getenv``
sees it too), points its stdin at ``/dev/null`` as a cold rank's, and runs the script
exactly as below. End of input without a go means "not needed": it exits 0.

While it imports it runs at ``SCHED_IDLE`` priority when it can return to normal priority
afterwards (root, or a ``RLIMIT_NICE`` that allows it; a probe thread tries the round trip
first), so that preparing for the next failure takes no CPU from the group that is
training, healing or starting; otherwise at normal priority.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import threading
from typing import NoReturn

LIFELINE_ENV = "RALLYPOINT_SUPERVISOR_FD"  # rallypoint.supervisor.envs.LIFELINE_ENV
READY_ENV = "RALLYPOINT_STANDBY_READY"  # rallypoint.supervisor.envs.READY_ENV
# What every standby imports before the user's --preload modules: torch, what a script's
# first optimizer pulls in (torch._dynamo: 0.5 s on an idle host, seconds on a busy one),
# and the pieces of rallypoint a training script builds first (the Manager, its server,
# process groups, DDP) or its first heal uses (the HTTP transport and its client).
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "rallypoint.manager.manager",
                   "rallypoint.manager.server", "rallypoint.process_groups", "rallypoint.integrations.ddp",
                   "rallypoint.transports.http")
MAX_GO_BYTES = 16 * 1024 * 1024  # the go message is an environment: far below this
PRELOAD_FAILED_EXIT = 3


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


_PR_SET_PDEATHSIG = 1


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with ``code`` at once (``os._exit``),
    without the interpreter's teardown: for rallypoint run's own helpers (the zygote, the
    store host) once their work is done. With torch imported, the teardown (module
    clean-up, a full garbage collection) costs 0.3-0.5 s of CPU; when a job ends, every
    one of its processes tears down at once, and on a small host the supervisor waited
    seconds for its helpers. Never for a rank: the user's ``atexit`` handlers must run."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to say
            pass
    os._exit(code)


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this rank when the supervisor (its parent) dies (Linux;
    elsewhere only the lifeline). A supervisor that died before this call is caught by
    the lifeline, whose read then returns at once. True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


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


def _sched_idle_reversible() -> bool:
    """Can this process drop to ``SCHED_IDLE`` and come back? Tried on a throwaway thread
    (scheduling policies are per thread), so a failed way back strands nothing."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except (OSError, AttributeError):
            pass

    t = threading.Thread(target=probe, name="rallypoint-sched-probe", daemon=True)
    t.start()
    t.join(5.0)
    return bool(ok)


def _set_policy(policy: int) -> None:
    """Every thread of this process to ``policy`` (the standby's threads are few: the
    lifeline watcher and whatever the imports started)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:
            pass


def _preload(modules: list[str], who: str = "standby") -> None:
    """Import what the script will need, so its own imports find them in ``sys.modules``.
    A module that cannot be imported ends the standby with a message (the supervisor stops
    making standbys after a few such deaths, and the ranks start cold)."""
    for name in DEFAULT_PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a speed-up only: the script imports what it needs itself
            pass
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - whatever a user's module raises
            print(f"rallypoint run: {who}: cannot preload {name!r}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            raise SystemExit(PRELOAD_FAILED_EXIT) from None


def _read_go() -> dict[str, str] | None:
    """Block until the supervisor's go (the rank's environment) or the end of stdin (None)."""
    chunks, size = [], 0
    while True:
        try:
            data = os.read(0, 1 << 16)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not data:
            break
        chunks.append(data)
        size += len(data)
        if size > MAX_GO_BYTES:
            raise ValueError(f"over {MAX_GO_BYTES} bytes")
    if not size:
        return None
    msg = json.loads(b"".join(chunks))
    env = msg.get("env") if isinstance(msg, dict) else None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("no environment of strings")
    return env


def _standby(preload: list[str]) -> bool:
    """Prepare, wait for the go and become the rank; False: not needed (exit quietly).

    The go is read by a thread started first, at normal priority: a go that arrives while
    the imports still run (a failure soon after the standby started) restores normal
    priority at once, so the rest of the imports do not crawl at ``SCHED_IDLE`` behind the
    training that now waits for this rank."""
    got: dict[str, object] = {}
    done = threading.Event()
    # A standby forked from the zygote has nothing left to import: it stays at normal
    # priority (at SCHED_IDLE on a busy host it could wait seconds to write its ready file).
    idle = not all(m in sys.modules for m in (*DEFAULT_PRELOAD, *preload)) and _sched_idle_reversible()

    def read() -> None:
        try:
            got["env"] = _read_go()
        except (SystemExit, ValueError) as e:
            got["error"] = e
        if idle:
            _set_policy(os.SCHED_OTHER)
        done.set()

    threading.Thread(target=read, name="rallypoint-standby-go", daemon=True).start()
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread; new ones inherit it
        except OSError:
            idle = False
    _preload(preload)
    if not gc.get_freeze_count():  # a fork of the zygote has its imports frozen already
        gc.freeze()  # as the zygote does (see _zygote.py): the rank's collections skip what the imports made
    ready = os.environ.get(READY_ENV)
    if ready:
        with open(ready, "w") as f:
            f.write(str(os.getpid()))  # which process is ready (a forked standby's /proc environ is its zygote's)
    done.wait()
    if "error" in got:
        raise SystemExit(f"rallypoint run: standby: a malformed go message ({got['error']})")
    env = got.get("env")
    if not isinstance(env, dict):
        return False
    env.pop(LIFELINE_ENV, None)  # the lifeline is watched already
    env.pop(READY_ENV, None)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    return True


def main(argv: list[str]) -> None:
    if os.environ.get(LIFELINE_ENV):  # started by rallypoint run (not by hand)
        die_with_parent()
    watch_lifeline()
    dump_stacks_on_sigusr1()
    standby, preload = False, []
    while argv[:1] in (["--standby"], ["--preload"]):
        if argv[0] == "--standby":
            standby, argv = True, argv[1:]
        else:
            if len(argv) < 2:
                raise SystemExit("--preload needs a list of modules")
            preload += [m for m in argv[1].split(",") if m]
            argv = argv[2:]
    if not argv:
        raise SystemExit("usage: python -m rallypoint.supervisor._rank [--standby [--preload m1,m2]] "
                         "[-m module | script.py] args...")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("-m needs a module name")
        if standby and not _standby(preload):
            return
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # before --preload: the script's own modules
        if standby and not _standby(preload):
            return
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
