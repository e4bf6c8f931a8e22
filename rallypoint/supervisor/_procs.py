"""Process plumbing of ``rallypoint run`` (a thin shell; no decisions here): the event
queue the main loop sleeps on, the lifeline, per-rank output pumps with prefixes, a rank
process, and the store host's client.

Every child is started from the main thread: the ``PR_SET_PDEATHSIG`` a rank sets on
itself (``_rank.py``) fires when the *thread* that forked it ends, so a child forked from
a short-lived thread would be killed with it. No child is started with a ``preexec_fn``:
with one, ``subprocess`` runs the Python-level fork handlers in the child, and grpc's
(registered once the event reporter has imported grpc) can abort the child before its
exec; without one it forks (or vforks) and execs in C.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

#: pids of the processes this supervisor started whose exit a waiter thread reaps (``_forks.reap_orphans``
#: leaves them alone: it reaps only orphans re-parented to the supervisor as a subreaper).
OWNED: set[int] = set()


class Wakeup:
    """Events from threads and signal handlers for the main loop: a deque (appending is
    atomic, so a signal handler may post) plus a self-pipe the loop sleeps on with
    ``select``. Never a lock: a handler interrupting the main thread while it held one
    would deadlock."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        self._closed = False

    def post(self, *event: Any) -> None:
        self._events.append(event)
        if self._closed:
            return  # the fd number may belong to another file by now
        try:
            os.write(self._w, b"!")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop wakes anyway

    def wait(self, timeout: float | None) -> list[tuple[Any, ...]]:
        """Posted events, waiting up to ``timeout`` seconds (None: forever) for one."""
        if not self._events:
            try:
                select.select([self._r], [], [], timeout)
            except InterruptedError:  # pragma: no cover - PEP 475 retries select
                pass
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def close(self) -> None:
        self._closed = True
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class Lifeline:
    """A pipe whose write end only the supervisor holds; children get the read end and
    see end-of-file when the supervisor is gone (see ``_rank.py``)."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # both non-inheritable; pass_fds opens read_fd in a child

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class Pump:
    """A thread copying a child's pipe to ``dest`` line by line, each line prefixed."""

    def __init__(self, src: IO[bytes], dest: IO[bytes], prefix: str, lock: threading.Lock) -> None:
        self._src, self._dest, self.prefix, self._lock = src, dest, prefix.encode(), lock
        self.lines = 0  # lines copied so far, and when the last one was (monotonic)
        self.last_line_at = 0.0
        self._thread = threading.Thread(target=self._run, name=f"pump {prefix.strip()}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._src.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    try:
                        self._dest.write(self.prefix + line)
                        self._dest.flush()
                    except (OSError, ValueError):
                        pass  # our own output is gone (a closed pipe): keep draining the child
                self.last_line_at = time.monotonic()
                self.lines += 1
        finally:
            self._src.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class RankProcess:
    """One rank of one incarnation: its process (own session, so its process group can be
    killed whole), two output pumps, and a waiter thread that posts
    ``("exit", incarnation, rank, returncode)`` to ``wakeup``.

    A warm standby (``incarnation`` None) is the same, started early with a pipe for its
    go on stdin: until :meth:`activate` hands it an incarnation its exit is posted as
    ``("standby_exit", self, returncode)`` instead, which does not end any incarnation.

    ``forked``: a process the group's zygote forked (``_forks.ForkedPopen``, a standby
    until activated) instead of one started here from ``argv`` and ``env``."""

    def __init__(self, argv: list[str], env: dict[str, str], rank: int, incarnation: int | None, prefix: str,
                 wakeup: Wakeup, lifeline: Lifeline, outputs: tuple[IO[bytes], IO[bytes]],
                 locks: tuple[threading.Lock, threading.Lock], forked: Any = None) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.standby = incarnation is None
        self.forked = forked is not None
        self.popen: Any = forked if forked is not None else subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE if self.standby else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(lifeline.read_fd,), start_new_session=True,  # no preexec_fn: see the module docstring
        )
        self.pid = self.popen.pid
        OWNED.add(self.pid)
        self.started = time.monotonic()
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self._pumps = [Pump(self.popen.stdout, outputs[0], prefix, locks[0]),
                       Pump(self.popen.stderr, outputs[1], prefix, locks[1])]
        self._lock = threading.Lock()  # orders an activation against the exit
        self._exited = False
        self._waiter = threading.Thread(target=self._wait, args=(wakeup,), name=f"wait rank {rank}", daemon=True)
        self._waiter.start()

    def _wait(self, wakeup: Wakeup) -> None:
        rc = self.popen.wait()
        OWNED.discard(self.pid)
        with self._lock:
            self._exited = True
            incarnation = self.incarnation
        if incarnation is None:
            wakeup.post("standby_exit", self, rc)
        else:
            wakeup.post("exit", incarnation, self.rank, rc)

    def activate(self, env: dict[str, str], incarnation: int, prefix: str) -> bool:
        """A standby becomes ``rank`` of ``incarnation`` with environment ``env``. False if
        it has exited already (its exit was or will be posted as a standby's: start the rank
        cold). If it dies from here on, its exit ends the incarnation like any rank's."""
        with self._lock:
            if self._exited or not self.standby:
                return False
            self.incarnation, self.standby = incarnation, False
        for p in self._pumps:
            p.prefix = prefix.encode()
        # From a thread: a standby still importing reads its go only when done, and an
        # environment larger than the pipe's buffer must not block the main loop till then.
        threading.Thread(target=self._send_go, args=(json.dumps({"env": env}).encode(),),
                         name=f"go rank {self.rank}", daemon=True).start()
        return True

    def _send_go(self, payload: bytes) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(payload)
            self.popen.stdin.close()
        except (OSError, ValueError):
            pass  # it is dying: its exit ends the incarnation

    def discard(self) -> None:
        """A standby no longer needed: the end of its input (it exits 0), then SIGKILL to
        its process group in case it is busy importing."""
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        self.signal(signal.SIGKILL, group=True)

    def signal(self, sig: int, group: bool = False) -> None:
        """Send ``sig`` to the rank (``group``: to its whole process group) if it runs."""
        if self.popen.returncode is not None and not group:
            return  # reaped: the pid may belong to someone else by now
        try:
            if group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stopped(self) -> bool:
        """Stopped (SIGSTOP, a debugger): it cannot act on a signal other than SIGKILL and
        SIGCONT until continued."""
        if self.popen.returncode is not None:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state in (b"T", b"t")

    def stderr_activity(self) -> tuple[int, float]:
        """How many lines of its stderr were printed so far, and when the last one was."""
        pump = self._pumps[1]
        return pump.lines, pump.last_line_at

    def drain(self, timeout: float) -> None:
        """Let the pumps print its last lines (e.g. a traceback) before we say it failed."""
        for p in self._pumps:
            p.join(timeout)

    def finish(self, timeout: float = 5.0) -> None:
        """After the exit: kill what is left of its process group (children it started),
        then let the pumps print its last lines."""
        self.signal(signal.SIGKILL, group=True)
        self.drain(timeout)


class StoreHost:
    """Client of ``_store_host.py``: start it, read its port, reset it, tell it which process
    groups to take down if we die, stop it. Its stdin is its lifeline; its stderr goes to
    ours with ``prefix``."""

    def __init__(self, host: str, port: int, prefix: str, err: IO[bytes], err_lock: threading.Lock,
                 on_exit: Callable[[int], None], rundir: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "rallypoint.supervisor._store_host", host, str(port), rundir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # no PR_SET_PDEATHSIG: it notices our death by the end of its stdin, and cleans up first
        self.pid = self.popen.pid
        OWNED.add(self.pid)
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="store host stdout", daemon=True).start()
        self._pump = Pump(self.popen.stderr, err, prefix, err_lock)
        self._closing = False
        self._on_exit = on_exit
        threading.Thread(target=self._wait, name="store host wait", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self._lines.put(raw.decode("utf-8", "replace").strip())
        self._lines.put(None)

    def _wait(self) -> None:
        rc = self.popen.wait()
        if not self._closing:
            self._on_exit(rc)

    def port(self, timeout: float) -> int:
        """The port from its next line; ``RuntimeError`` with its reason when it fails."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the store host did not answer within {timeout:g}s") from None
        if line is None:
            self._pump.join(2.0)
            raise RuntimeError(f"the store host exited (code {self.popen.wait()}) before it was ready; "
                               "see its log above")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return int(msg["port"])

    def _send(self, line: str) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(line.encode() + b"\n")
            self.popen.stdin.flush()
        except OSError as e:
            raise RuntimeError(f"the store host is gone ({e})") from None

    def reset(self, timeout: float) -> int:
        """A fresh, empty store (between incarnations); its port: the same one unless
        another process took it meanwhile."""
        self._send("reset")
        return self.port(timeout)

    def spare(self) -> None:
        """Keep a spare store on a second port from now on (see ``next``)."""
        self._send("spare")

    def next(self, timeout: float) -> int:
        """A fresh, empty store at once (the spare; the old one is recycled in the
        background); its port, which alternates between two."""
        self._send("next")
        return self.port(timeout)

    def guard(self, pgids: list[int]) -> None:
        """The process groups it SIGKILLs if we die (the running ranks'; [] when none)."""
        try:
            self._send(" ".join(["guard", *map(str, pgids)]))
        except RuntimeError:
            pass  # the main loop learns of its death from its exit event

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()  # end of input: it exits
            except OSError:
                pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout)
        self._pump.join(timeout)


__all__ = ["OWNED", "Lifeline", "Pump", "RankProcess", "StoreHost", "Wakeup"]
