"""The group's zygote (``rallypoint run``): one process that imports what a rank needs once,
then forks the group's ranks and standbys from itself, ready at once (copy-on-write pages).

``python -m rallypoint.supervisor._zygote [--preload m1,m2] [-m] target args...``, started
by the supervisor from its main thread, in a session of its own, with
``RALLYPOINT_ZYGOTE_FD`` (one end of a ``SOCK_SEQPACKET`` socket pair) and the lifeline
(``RALLYPOINT_SUPERVISOR_FD``, see ``_rank.py``). A thin shell; the client is ``_forks.py``.

1. It sets ``PR_SET_PDEATHSIG``, imports ``_rank.DEFAULT_PRELOAD`` and ``--preload`` (from
   the script's folder too, as a rank would), checks it has exactly one thread (forking a
   process with other threads could copy a lock held by one of them), and says
   ``{"ready": true, "import_s": ...}`` — or ``{"error": ...}`` and exits (the supervisor
   then starts everything cold, as without a zygote).
2. Its one thread then waits (``select``) on the socket and the lifeline; it never starts a
   thread, so it stays safe to fork. End of the socket or of the lifeline: it exits at
   once (``_rank.exit_now``: no interpreter teardown, which ``rallypoint run`` would wait for).
3. A request is ``{"ready": PATH or null}`` with three descriptors (the child's stdin, a
   pipe whose other end the supervisor writes the go to; its stdout and stderr, pipes the
   supervisor pumps). It forks twice: the middle process forks the child, writes the
   child's pid to the zygote and exits; the zygote reaps it and answers ``{"pid": P}``. The
   supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so by then the child is
   the supervisor's own child: it waits for it and gets its exit status as for any rank.
4. The child makes its own session (``killpg`` stops it and its helpers), takes the three
   descriptors as 0/1/2, waits to be re-parented, sets ``PR_SET_PDEATHSIG`` (now tied to
   the supervisor's main thread, which is the new parent) and checks that its parent is
   the supervisor (else it exits: the supervisor died meanwhile), reseeds numpy's global
   generator when numpy was imported (a fork shares the zygote's state; Python's ``random``
   reseeds itself at a fork), and becomes a standby exactly as ``_rank.py --standby``
   does: it watches the lifeline, registers the ``SIGUSR1`` stack dump, marks itself
   ready (the ready file, if asked), waits for its go (the rank's environment) on stdin
   and runs the script as ``python script.py`` would. A rank forked for an incarnation
   gets its go at once.

What a forked rank shares with the zygote that a cold rank would not: the interpreter's
hash seed; the garbage collector's permanent generation (the objects the imports made,
frozen by ``gc.freeze`` before the first fork: no collection in the rank scans them again,
its last one at exit included, which on a 2-core host made a finished job's ranks take
seconds longer to exit); and whatever the preloaded modules computed at import from the
environment (the zygote's is rank 0's standby environment, as a cold standby of rank 0
has; the go replaces ``os.environ`` before the script runs), so keep ``--preload`` to
libraries.
"""

from __future__ import annotations

import gc
import json
import os
import select
import socket
import sys
import time

from rallypoint.supervisor import _rank

SOCK_ENV = "RALLYPOINT_ZYGOTE_FD"
MAX_REQUEST = 64 * 1024
REPARENT_WAIT_S = 10.0
NOT_READY_EXIT = 3


def threads() -> int:
    """This process's thread count (Linux; 1 elsewhere, where the supervisor uses no zygote)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _say(sock: socket.socket, **kw: object) -> None:
    sock.send(json.dumps(kw).encode())


def _reseed() -> None:
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:  # noqa: BLE001 - best effort: a numpy without the legacy generator
            pass


def _child(sock: socket.socket, supervisor: int, middle: int, req: dict[str, object], fds: list[int]) -> None:
    """In the forked child: its session, its descriptors, its parent (see the module docstring)."""
    os.setsid()
    sock.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0005)
    _rank.die_with_parent()
    if os.getppid() != supervisor:
        sys.stderr.write(f"rallypoint run: zygote child: the supervisor (pid {supervisor}) is gone; exiting\n")
        os._exit(1)
    ready = req.get("ready")
    if isinstance(ready, str):
        os.environ[_rank.READY_ENV] = ready
    else:
        os.environ.pop(_rank.READY_ENV, None)
    _reseed()


def _fork(sock: socket.socket, supervisor: int, req: dict[str, object], fds: list[int]) -> bool:
    """Fork a child for ``req``; True in the child (set up), False in the zygote (answered)."""
    r, w = os.pipe()
    try:
        middle = os.fork()
    except OSError as e:
        for fd in (r, w, *fds):
            os.close(fd)
        _say(sock, error=f"fork: {e}")
        return False
    if middle == 0:
        try:
            os.close(r)
            child = os.fork()
        except BaseException:  # noqa: BLE001 - the zygote answers with an error
            os._exit(1)
        if child == 0:
            os.close(w)
            _child(sock, supervisor, os.getppid(), req, fds)
            return True
        try:
            os.write(w, b"%d" % child)
        finally:
            os._exit(0)
    os.close(w)
    for fd in fds:
        os.close(fd)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    os.waitpid(middle, 0)
    if data:
        _say(sock, pid=int(data))
    else:
        _say(sock, error="the fork failed")
    return False


def serve(sock: socket.socket, lifeline: int | None, supervisor: int) -> bool:
    """Answer fork requests until the end of the socket or the lifeline (False: the zygote
    exits); True in a forked child, which goes on to become a standby or rank."""
    watch = [sock.fileno()] + ([lifeline] if lifeline is not None else [])
    while True:
        readable, _, _ = select.select(watch, [], [])
        if lifeline is not None and lifeline in readable:
            try:
                if not os.read(lifeline, 64):
                    return False
            except OSError:
                return False
        if sock.fileno() not in readable:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 3)
        if not msg:
            for fd in fds:
                os.close(fd)
            return False
        try:
            req = json.loads(msg)
            if len(fds) != 3 or not isinstance(req, dict):
                raise ValueError("not a request with three descriptors")
        except ValueError as e:
            for fd in fds:
                os.close(fd)
            _say(sock, error=f"a malformed request: {e}")
            continue
        if _fork(sock, supervisor, req, fds):
            return True


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(os.environ.pop(SOCK_ENV)))
    supervisor = os.getppid()
    _rank.die_with_parent()
    raw = os.environ.get(_rank.LIFELINE_ENV)  # stays: each child's _rank.main watches it
    lifeline = int(raw) if raw else None
    preload: list[str] = []
    rest = list(argv)
    while rest[:1] == ["--preload"] and len(rest) > 1:
        preload += [m for m in rest[1].split(",") if m]
        rest = rest[2:]
    if not rest or rest[0] == "-m" and len(rest) < 2:
        _say(sock, error="no target")
        raise SystemExit(NOT_READY_EXIT)
    if rest[0] != "-m":
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))  # the script's own modules, as a rank finds them
    t0 = time.monotonic()
    try:
        _rank._preload(preload, who="zygote")
    except SystemExit:
        _say(sock, error=f"cannot preload {preload}: see its message above")
        raise
    n = threads()
    if n != 1:
        _say(sock, error=f"{n} threads after the imports (forking is only safe with one)")
        raise SystemExit(NOT_READY_EXIT)
    sys.stdout.flush()
    sys.stderr.flush()
    # What the imports made (some 200,000 objects with torch) goes to the GC's permanent
    # generation: the forks' collections, their final one at exit included, skip it, and
    # leave its pages shared with the zygote (``gc.freeze``'s documented use before fork).
    # No collection first: it found nothing to free after the imports and took 0.1 s.
    gc.freeze()
    _say(sock, ready=True, import_s=round(time.monotonic() - t0, 3))
    if not serve(sock, lifeline, supervisor):
        _rank.exit_now(0)  # nothing to tear down: it only imported and forked
    head = ["--standby", *(["--preload", ",".join(preload)] if preload else [])]
    _rank.main([*head, *rest])  # a forked child: the standby, then the rank


if __name__ == "__main__":
    main(sys.argv[1:])
