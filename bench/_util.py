"""Shared helpers for the benchmarks in ``bench/`` (not part of the library).

- :func:`load_torchft_native` loads torchft's Rust extension (``torchft._torchft``)
  without running ``torchft/__init__.py``, which imports torch (~8 s); the lighthouse
  benchmarks only need the native ``LighthouseServer``/``LighthouseClient``.
- :class:`Child` is a subprocess speaking one JSON object per line on stdin/stdout,
  with stderr sent to a file (never a pipe that could fill and block the child), read
  by a thread so every wait has a timeout, and killed by pid.
- :func:`percentile`, :func:`table`: the numbers and the printed table.
- :class:`TlsJob`: a job token and a throw-away PKI (a CA and one certificate for this
  host, made with ``trustme``) in a temporary directory, for the ``--tls`` variants;
  :func:`clear_job_env` drops the job's ``RALLYPOINT_TOKEN``/``RALLYPOINT_TLS_*``
  settings from an environment, so the clear-text variants stay clear text.
- :func:`procs`, :func:`proc_environ`, :func:`term_with_parent`, :func:`log_time`: what a
  bench that drives ``rallypoint run`` reads from ``/proc`` and from the supervisor's log.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

_NATIVE: Any = None
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def term_with_parent() -> None:
    """``preexec_fn`` of a child that must not outlive the bench: SIGTERM to it when the
    bench dies (Linux ``PR_SET_PDEATHSIG``; nothing elsewhere)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM, 0, 0, 0)


def log_time(line: str) -> float | None:
    """The wall time a ``logging`` line (``YYYY-MM-DD HH:MM:SS,mmm ...``) was logged at, or None."""
    m = _STAMP.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def procs() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) of every process this user can read in ``/proc``."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except (OSError, ValueError, IndexError):
            continue
        out[int(d)] = (ppid, cmd)
    return out


def proc_environ(pid: int) -> dict[str, str]:
    """Process ``pid``'s environment from ``/proc`` (empty when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode("utf-8", "replace").split("=", 1) for i in items if b"=" in i)


def load_torchft_native() -> Any:
    """``torchft._torchft`` without importing torch (the extension does not need it)."""
    global _NATIVE
    if _NATIVE is not None:
        return _NATIVE
    if "torchft._torchft" in sys.modules:
        _NATIVE = sys.modules["torchft._torchft"]
        return _NATIVE
    spec = importlib.util.find_spec("torchft")  # locates the package, does not run it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchft is not installed (pip install 'torchft==0.2.0' or '.[test]')")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    candidates = sorted(pkg_dir.glob("_torchft*.so")) + sorted(pkg_dir.glob("_torchft*.pyd"))
    if not candidates:
        raise ImportError(f"torchft's native extension _torchft is missing from {pkg_dir}")
    ext = importlib.util.spec_from_file_location("torchft._torchft", candidates[0])
    assert ext is not None and ext.loader is not None
    mod = importlib.util.module_from_spec(ext)
    ext.loader.exec_module(mod)
    _NATIVE = mod
    return mod


def exit_with_parent(parent: int | None = None, poll_s: float = 0.5) -> None:
    """In a child: exit at once when the parent (pid ``parent``, by default the current
    parent) dies, so no benchmark process outlives an interrupted run, even one blocked
    in a long RPC."""
    parent = parent or os.getppid()
    if os.getppid() != parent:
        os._exit(3)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def torchft_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:
        return "unknown"


def _task_files(name: str) -> dict[int, str]:
    """``/proc/self/task/<tid>/<name>`` of every thread of this process, by thread id (a
    thread that ended meanwhile is left out; empty where there is no ``/proc``)."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/{name}") as f:
                out[int(tid)] = f.read()
        except (OSError, ValueError):
            continue
    return out


def thread_cpu_ns() -> dict[int, int]:
    """Nanoseconds of CPU each thread of this process has run so far, by thread id, from
    ``/proc/self/task/<tid>/schedstat`` (the scheduler's own clock, so a per-step delta is
    exact, unlike ``stat``'s clock ticks). Empty where there is no such file (not Linux, or
    a kernel without schedstats): callers then report nothing per thread."""
    out: dict[int, int] = {}
    for tid, text in _task_files("schedstat").items():
        fields = text.split()
        if fields and fields[0].isdigit():
            out[tid] = int(fields[0])
    return out


def thread_kinds() -> dict[int, str]:
    """Each live thread's kind, by thread id: a Python thread's name without its trailing
    number or replica id ("MainThread", "rallypoint-ddp-wait"), a native thread's kernel
    name (gloo's "pt_gloo_runloop", "gloo_tcp_loop"; gRPC's "event_engine")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, str] = {}
    for tid, comm in _task_files("comm").items():
        comm = comm.strip()
        name = names.get(tid, comm)
        name = re.sub(r"-replica.*$", "", name)  # a rallypoint thread's replica id
        name = re.sub(r"^Thread-\d+ \((\w+)\)$", r"python thread (\1)", name)
        out[tid] = re.sub(r"[-_ ]?\d+$", "", name) or comm
    return out


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in [0, 100]); with few samples p99 is the max."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 100)) - 1))
    return s[k]


def median(values: Sequence[float]) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs != theirs or ours != ours or theirs <= 0:
        return None
    return ours / theirs


class ChildError(RuntimeError):
    pass


class Child:
    """A subprocess exchanging JSON lines; ``recv`` has a timeout; ``kill`` by pid."""

    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.name = name
        self._log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.log_path = self._log.name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=cwd,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self.lines: "queue.Queue[tuple[float, Any]]" = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"reader-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.time()
            line = line.strip()
            if not line:
                continue
            try:
                self.lines.put((now, json.loads(line)))
            except json.JSONDecodeError:
                self.lines.put((now, {"raw": line}))
        self.lines.put((time.time(), None))  # EOF

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ChildError(f"{self.name} (pid {self.pid}) is gone: {e}; log {self.log_path}: {self.log_tail()}") from None

    def recv(self, timeout: float) -> Any:
        """The next JSON object, or ChildError on timeout/EOF (with the log's tail)."""
        try:
            _, obj = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(f"{self.name} (pid {self.pid}) said nothing within {timeout:.0f}s; log: {self.log_tail()}") from None
        if obj is None:
            rc = self.proc.poll()
            raise ChildError(f"{self.name} (pid {self.pid}) exited (rc={rc}); log: {self.log_tail()}")
        return obj

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child by its pid (never by name) and reap it."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self, grace: float = 5.0) -> None:
        """Ask politely (EOF on stdin), then SIGKILL; always reaps; removes the log."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        for f in (self.proc.stdout, self.proc.stdin):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            self._log.close()
            os.unlink(self.log_path)
        except OSError:
            pass


def recv_result(c: Child, timeout: float) -> dict[str, Any]:
    """The ``result`` a worker sends (``{"result": ...}``), skipping its other lines;
    ``ChildError`` with its log's tail when none comes within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise ChildError(f"{c.name} (pid {c.pid}) gave no result within {timeout:.0f}s; log: {c.log_tail()}")
        obj = c.recv(left)
        if isinstance(obj, dict) and "result" in obj:
            return obj["result"]


def close_all(children: Iterable[Child | None], grace: float = 5.0) -> None:
    for c in children:
        if c is not None:
            try:
                c.close(grace)
            except Exception as e:  # cleanup must go on
                print(f"warning: cleaning up {c.name} (pid {c.pid}): {e}", file=sys.stderr)


def goal_met(value: float | None, ok: bool) -> bool | None:
    """A goal's verdict for the JSON line: None when there was nothing to measure."""
    return None if value is None else ok


def report_goals(bench: str, plan: dict[str, Any], results: Any, goals: dict[str, bool | None],
                 ratios: dict[str, Any], out: str | None) -> None:
    """The goals line, then the bench's one JSON line (also written to ``out``)."""
    print("goals: " + ", ".join(f"{k}: {'met' if v else ('not met' if v is False else '-')}" for k, v in goals.items()))
    emit_line(json.dumps({"bench": bench, "plan": plan, "results": results, "goals": goals, "ratios": ratios}), out)


def emit_line(line: str, out: str | None) -> None:
    """Print a bench's one JSON line and, with ``--out``, write it to that file too."""
    print(line)
    if out:
        Path(out).write_text(line + "\n")


def fmt_ms(v: float | None, digits: int = 1) -> str:
    """Milliseconds for a table cell (``digits`` after the point; seconds from 1000 ms on)."""
    if v is None or v != v:
        return "-"
    return f"{v:.{digits}f} ms" if v < 1000 else f"{v / 1000:.2f} s"


def fmt_num(v: float | None, unit: str = "") -> str:
    if v is None or v != v:
        return "-"
    return f"{v:,.0f}{unit}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)



# ---------------------------------------------------------------------- TLS (--tls)
#: The environment variables through which a rallypoint process picks up the job's
#: token and TLS settings (rallypoint._net.auth / rallypoint._net.tls).
JOB_ENV_KEYS = ("RALLYPOINT_TOKEN", "RALLYPOINT_TLS_CERT", "RALLYPOINT_TLS_KEY", "RALLYPOINT_TLS_CA",
                "RALLYPOINT_TLS_CLIENT_CA", "RALLYPOINT_REQUIRE_TLS")


def clear_job_env(env: dict[str, str] | Any) -> list[str]:
    """Remove the job's token/TLS variables from ``env`` (a dict or ``os.environ``);
    the names removed."""
    gone = [k for k in JOB_ENV_KEYS if k in env]
    for k in gone:
        env.pop(k, None)
    return gone


class TlsJob:
    """One job's credentials for a benchmark run: a random bearer token and, in a fresh
    temporary directory, a CA (``ca.pem``) and one leaf certificate + key
    (``cert.pem``/``key.pem``) for localhost, 127.0.0.1, ::1 and this host's name, usable
    as server and client certificate (as in ``tests/test_tls.py``). ``close()`` removes
    the directory. Needs ``trustme`` (a test extra)."""

    def __init__(self) -> None:
        try:
            import trustme
        except ImportError as e:  # pragma: no cover - depends on the install
            raise SystemExit(f"--tls needs trustme to make certificates (pip install -e '.[test]'): {e}") from None
        self.dir = tempfile.mkdtemp(prefix="bench-tls-")
        try:
            ca = trustme.CA()
            leaf = ca.issue_cert("localhost", "127.0.0.1", "::1", socket.gethostname())
            self.ca = os.path.join(self.dir, "ca.pem")
            self.cert = os.path.join(self.dir, "cert.pem")
            self.key = os.path.join(self.dir, "key.pem")
            ca.cert_pem.write_to_path(self.ca)
            leaf.private_key_pem.write_to_path(self.key)
            leaf.cert_chain_pems[0].write_to_path(self.cert)
            for extra in leaf.cert_chain_pems[1:]:
                extra.write_to_path(self.cert, append=True)
        except BaseException:
            self.close()
            raise
        self.token = secrets.token_urlsafe(24)
        with open(os.path.join(self.dir, "token"), "w") as f:  # for child processes (from_dir)
            f.write(self.token)
        self._owner = True

    @classmethod
    def from_dir(cls, path: str) -> "TlsJob":
        """The job made by another process (its ``dir``), in a child; ``close`` leaves it."""
        job = cls.__new__(cls)
        job.dir = path
        job.ca, job.cert, job.key = (os.path.join(path, n) for n in ("ca.pem", "cert.pem", "key.pem"))
        with open(os.path.join(path, "token")) as f:
            job.token = f.read().strip()
        job._owner = False
        return job

    def env(self, mutual: bool = True, require: bool = True) -> dict[str, str]:
        """The variables every rallypoint server and client of the job reads: the token,
        the certificate (served, and presented as the client certificate), the CA that
        clients verify against (which also makes them dial TLS), the client CA (servers
        demand client certificates: mutual TLS) and ``RALLYPOINT_REQUIRE_TLS`` (a client
        refuses a clear-text address, a server refuses to start without a certificate)."""
        env = {"RALLYPOINT_TOKEN": self.token, "RALLYPOINT_TLS_CERT": self.cert, "RALLYPOINT_TLS_KEY": self.key,
               "RALLYPOINT_TLS_CA": self.ca}
        if mutual:
            env["RALLYPOINT_TLS_CLIENT_CA"] = self.ca
        if require:
            env["RALLYPOINT_REQUIRE_TLS"] = "1"
        return env

    def config(self, mutual: bool = True, require: bool = True) -> Any:
        """The same settings as a ``rallypoint._net.tls.TlsConfig`` (not read from the environment)."""
        from rallypoint._net.tls import tls_config

        return tls_config(self.cert, self.key, self.ca, self.ca if mutual else None, require=require, environ={})

    def close(self) -> None:
        if getattr(self, "_owner", True):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "TlsJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
