"""A fork server for the suite's own worker scripts: torch is imported once, each worker is forked.

Why: the multi-replica tests start about a hundred worker processes, and each spent ~3 s of
CPU importing torch (and ~2 s more importing ``torch._dynamo`` at its first ``torch.optim``
step). On the 2-core CI machine the suite is CPU-bound, so that import was a third of its
time. The zygote imports torch, ``torch.distributed``, ``torch.optim``'s dynamo and
rallypoint once, then forks a child per worker, which runs the script as ``__main__`` the
way ``python script.py`` would (its own ``sys.argv``, environment, working directory and
stdio; normal interpreter exit, so ``atexit`` and non-daemon threads behave as usual).

The children are real processes: their own pid, killed and signalled by pid, their exit
status reported as ``subprocess.Popen`` reports it (negative: the signal). Only their
parent differs (the zygote, not pytest). Tests of how *users* start us (``rallypoint
run``, torchrun, the examples, plain ``python``) do not use this.

Fork safety: after these imports the process has one thread (torch starts its pools at
first use), and the zygote never starts another: it is a single-threaded ``select`` loop.
``RALLYPOINT_TEST_NO_ZYGOTE=1`` starts every worker with ``subprocess.Popen`` instead.

Protocol (a Unix socket): the client sends one JSON line (argv, env, cwd) with the child's
stdin, stdout and stderr descriptors attached (``SCM_RIGHTS``); the zygote answers
``{"pid": N}`` and, once the child is reaped, ``{"rc": R}``; then the connection closes.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Union

#: the longest a spawn waits for the zygote (its start included: importing torch)
START_TIMEOUT_S = 120.0
#: the zygote's own environment: the session's, as first imported (not a test's monkeypatched one)
_BASE_ENV = dict(os.environ)


# ------------------------------------------------------------------------ the server (its own process)
def _serve(path: str) -> tuple[list[str], dict[str, str], str] | None:
    """The zygote's loop. Returns (argv, env, cwd) in a forked child, which then runs the
    script; never returns in the zygote (it exits when its parent, pytest, is gone)."""
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(64)
    rfd, wfd = os.pipe()  # SIGCHLD wakes the loop
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    parent = os.getppid()
    conns: dict[int, socket.socket] = {}  # child pid -> the client waiting for its status
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([lsock.fileno(), rfd], [], [], 1.0)
        if os.getppid() != parent:  # pytest is gone: so are we (our children see their parent go)
            os._exit(0)
        if rfd in ready:
            os.read(rfd, 4096)
        while conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = conns.pop(pid, None)
            if conn is not None:
                rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
        if lsock.fileno() not in ready:
            continue
        conn, _ = lsock.accept()
        conn.settimeout(10.0)
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(msg)
        except (OSError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for c in [lsock, conn, *conns.values()]:
                c.close()
            os.close(rfd)
            os.close(wfd)
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                if fd > 2:
                    os.close(fd)
            return req["argv"], req["env"], req["cwd"]
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        conns[pid] = conn


def _run_child(argv: list[str], env: dict[str, str], cwd: str) -> None:
    """Run ``argv[0]`` as ``python argv[0] argv[1:]`` would, in this forked process."""
    import runpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _main() -> None:
    path = sys.argv[1]
    import torch  # noqa: F401 - the point: imported once, before any fork
    import torch.distributed  # noqa: F401
    import torch.optim  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401 - torch.optim imports it at the first step
    except Exception:  # noqa: BLE001 - a torch without it: nothing to preload
        pass
    import rallypoint.manager  # noqa: F401
    import rallypoint.transports.http  # noqa: F401

    assert threading.active_count() == 1, "the zygote must not fork with other threads running"
    job = _serve(path)
    if job is not None:  # the child: run the script; sys.exit/normal exit as in a plain process
        _run_child(*job)


# ------------------------------------------------------------------------ the client (pytest's side)
class ZygoteProc:
    """The parts of ``subprocess.Popen`` the tests use, for a worker the zygote forked."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int, stdin: IO[bytes] | None) -> None:
        self.args = args
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self._conn = conn
        self._buf = b""

    def _read_rc(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return False
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the test zygote went away before pid {self.pid} exited")
            self._buf += chunk
        self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["rc"])
        self._conn.close()
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_rc(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_rc(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._path = ""
        self._ready_path = ""  # the socket of the zygote that said it is ready

    def start(self) -> None:
        """Start the zygote (returns at once; the first spawn waits until it is ready).
        One that died (the OOM killer, say) is started again."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            if self._path:  # the one that died
                shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)
            self._path = os.path.join(tempfile.mkdtemp(prefix="rp-zygote-"), "sock")
            if self._proc is None:
                atexit.register(self.stop)
            self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self._path],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=_BASE_ENV)

    def _ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self._lock:
            if self._ready_path == self._path:
                return
            ready, _, _ = select.select([self._proc.stdout], [], [], START_TIMEOUT_S)
            line = self._proc.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                raise RuntimeError(f"the test zygote did not start within {START_TIMEOUT_S} s (exit {self._proc.poll()})")
            self._ready_path = self._path

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        if self._path:
            shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)

    def spawn(self, argv: list[str], stdin: Any, stdout: Any, stderr: Any, env: dict[str, str] | None,
              cwd: str | None) -> ZygoteProc:
        self.start()
        self._ready()
        closers: list[int] = []
        keep: IO[bytes] | None = None

        def fd_of(f: Any, default: int) -> int:
            nonlocal keep
            if f is None:
                return default
            if f == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                closers.append(fd)
                return fd
            if f == subprocess.PIPE:  # stdin only: the write end stays here as .stdin
                r, w = os.pipe()
                closers.append(r)
                keep = os.fdopen(w, "wb")
                return r
            return f if isinstance(f, int) else f.fileno()

        fds = [fd_of(stdin, -1), fd_of(stdout, 1), -1]
        if fds[0] == -1:
            fds[0] = fd_of(subprocess.DEVNULL, 0)
        fds[2] = fds[1] if stderr == subprocess.STDOUT else fd_of(stderr, 2)
        req = {"argv": argv[1:], "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd()}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(START_TIMEOUT_S)
            conn.connect(self._path)
            socket.send_fds(conn, [json.dumps(req).encode()], fds)
            buf = b""
            while b"\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the test zygote closed the connection before forking")
                buf += chunk
        except BaseException:
            conn.close()
            if keep is not None:
                keep.close()
            raise
        finally:
            for fd in closers:
                os.close(fd)
        line, rest = buf.split(b"\n", 1)
        proc = ZygoteProc(argv, conn, int(json.loads(line)["pid"]), keep)
        proc._buf = rest
        return proc


_ZYGOTE = _Zygote()
#: what :func:`popen` returns
Proc = Union["subprocess.Popen[bytes]", ZygoteProc]


def popen(argv: list[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
          env: dict[str, str] | None = None, cwd: str | None = None) -> Proc:
    """``subprocess.Popen(argv, ...)`` for ``[sys.executable, script, *args]``, forked from
    the zygote (see the module docstring); a plain ``Popen`` with
    ``RALLYPOINT_TEST_NO_ZYGOTE=1`` or for any other command."""
    if os.environ.get("RALLYPOINT_TEST_NO_ZYGOTE") or len(argv) < 2 or argv[0] != sys.executable \
            or argv[1].startswith("-"):
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
    return _ZYGOTE.spawn(argv, stdin, stdout, stderr, env, cwd)


if __name__ == "__main__":
    _main()
