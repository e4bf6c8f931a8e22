"""The supervisor's side of the group's zygote (``_zygote.py``; a thin shell, no decisions):
start it, learn when it is ready or gone, ask it for a forked child, and watch that child
as a rank.

A forked child is first the zygote's grandchild; the supervisor is a child subreaper
(``set_subreaper``), so once the zygote has reaped the middle process the child is the
supervisor's own: :class:`ForkedPopen` waits for it with ``waitpid`` and gives it
``subprocess.Popen``'s face (``pid``, ``returncode``, ``wait``, ``stdin``, ``stdout``,
``stderr``), so ``RankProcess`` treats it as any rank.

Being a subreaper also makes the supervisor the parent of every orphan below it (a rank's
helper that outlives the rank's death, before ``killpg`` takes it down): ``reap_orphans``
reaps those zombies, and only those, never a process whose status a waiter thread is
waiting for (``OWNED``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

from rallypoint.supervisor._procs import OWNED, Lifeline, Pump, Wakeup
from rallypoint.supervisor._zygote import SOCK_ENV

_PR_SET_CHILD_SUBREAPER = 36
FORK_REPLY_S = 10.0


def set_subreaper() -> bool:
    """Make this process its descendants' reaper (Linux); True if set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def reap_orphans() -> int:
    """Reap the zombie children this process did not start (orphans re-parented to it as
    the subreaper); how many."""
    n = 0
    for pid in _children():
        if pid in OWNED:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == b"Z" and pid not in OWNED:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    n += 1
            except ChildProcessError:
                pass
    return n


class ForkedPopen:
    """``subprocess.Popen``'s face for a child forked by the zygote and re-parented to us:
    a thread waits for it (``waitpid``) and records its return code as ``Popen`` does
    (``-signum`` for a signal)."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._done = threading.Event()
        OWNED.add(pid)
        threading.Thread(target=self._reap, name=f"reap {pid}", daemon=True).start()

    def _reap(self) -> None:
        try:
            while True:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
                    break
                except InterruptedError:  # pragma: no cover - PEP 475 retries
                    continue
                except ChildProcessError:  # not ours after all (should not happen): watch it by polling
                    while os.path.exists(f"/proc/{self.pid}"):
                        time.sleep(0.05)
                    self.returncode = -signal.SIGKILL
                    break
        finally:
            OWNED.discard(self.pid)
            self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The zygote process of one group: ``state`` is ``starting`` until its ready message,
    then ``ready``; the main loop hears ``("zygote", "ready", import_s)``, ``("zygote",
    "failed", reason)`` (it could not get ready) and ``("zygote", "exit", returncode)``
    through ``wakeup``. :meth:`fork` is called from the main thread only."""

    def __init__(self, argv: list[str], env: dict[str, str], lifeline: Lifeline, prefix: str, wakeup: Wakeup,
                 outputs: tuple[IO[bytes], IO[bytes]], locks: tuple[threading.Lock, threading.Lock]) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen(
                argv, env={**env, SOCK_ENV: str(theirs.fileno())}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(lifeline.read_fd, theirs.fileno()), start_new_session=True,
            )  # no preexec_fn: see _procs.py
        finally:
            theirs.close()
        self.pid = self.popen.pid
        OWNED.add(self.pid)
        self.state = "starting"
        self.import_s: float | None = None
        self._closing = False
        self._wakeup = wakeup
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self._pumps = [Pump(self.popen.stdout, outputs[0], prefix, locks[0]),
                       Pump(self.popen.stderr, outputs[1], prefix, locks[1])]
        threading.Thread(target=self._read, name="zygote replies", daemon=True).start()
        threading.Thread(target=self._wait, name="zygote wait", daemon=True).start()

    def _read(self) -> None:
        ready = False
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                return
            try:
                msg = json.loads(data)
            except ValueError:
                msg = {"error": f"a malformed message {data[:200]!r}"}
            if not ready and msg.get("ready"):
                ready = True
                self._wakeup.post("zygote", "ready", msg.get("import_s"))
            elif not ready:
                self._wakeup.post("zygote", "failed", str(msg.get("error", msg))[:500])
            else:
                self._replies.put(msg)

    def _wait(self) -> None:
        rc = self.popen.wait()
        self._replies.put({"error": f"the zygote exited ({rc})"})
        if not self._closing:
            self._wakeup.post("zygote", "exit", rc)

    def fork(self, ready_path: str | None) -> ForkedPopen:
        """A new child waiting for its go (``ready_path``: the standby's ready file). An
        ``OSError`` when the zygote cannot (it is gone, or answered with an error)."""
        if self.state != "ready" or self.popen.poll() is not None:
            raise OSError(f"the zygote is {'gone' if self.popen.returncode is not None else self.state}")
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr; not inheritable
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        try:
            while not self._replies.empty():  # a stale reply (an error after a timeout) is no answer to this
                self._replies.get_nowait()
            socket.send_fds(self._sock, [json.dumps({"ready": ready_path}).encode()], theirs)
            reply = self._replies.get(timeout=FORK_REPLY_S)
        except (OSError, queue.Empty) as e:
            for fd in ours:
                os.close(fd)
            raise OSError(f"no answer from the zygote ({e or 'timeout'})") from None
        finally:
            for fd in theirs:
                os.close(fd)
        if "pid" not in reply:
            for fd in ours:
                os.close(fd)
            raise OSError(str(reply.get("error", reply)))
        return ForkedPopen(int(reply["pid"]), os.fdopen(ours[0], "wb"), os.fdopen(ours[1], "rb"),
                           os.fdopen(ours[2], "rb"))

    def close(self, timeout: float = 5.0) -> None:
        """End its socket (it exits), SIGKILL after ``timeout``, and reap it."""
        self._closing = True
        self.state = "failed"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self.popen.wait(timeout)
        self._sock.close()
        for p in self._pumps:
            p.join(1.0)


__all__ = ["OWNED", "ForkedPopen", "Zygote", "reap_orphans", "set_subreaper"]
