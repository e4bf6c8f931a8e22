"""Shared fixtures for the lighthouse tests.

- ``lighthouse``: a factory starting in-process ``LighthouseServer``s on 127.0.0.1:0,
  shut down at teardown.
- ``client``: a factory of ``LighthouseClient``s (closed at teardown).
- ``procs``: a factory of child processes (``python -c CODE`` or ``python -m rallypoint
  ...``) whose stdout is read line by line by a thread, so tests can await a line with a
  deadline; every child is killed and reaped by pid at teardown.
- ``cli_lighthouse``: starts ``python -m rallypoint lighthouse`` and waits (with a
  timeout) for the JSON line it prints when ready.

Every wait has a deadline; nothing sleeps where an event can be awaited.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rallypoint.lighthouse.client import LighthouseClient, LivenessStream
from rallypoint.lighthouse.quorum import Quorum
from rallypoint.lighthouse.server import LighthouseServer

REPO = Path(__file__).resolve().parent.parent


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def reserved_port(listen: bool = False) -> Iterator[int]:
    """A loopback port this process holds for the whole block, so nothing else can take
    it: bound to port 0 (the OS picks it) and never released before the block ends.
    ``listen``: a port in use (a server told to bind it must fail); otherwise an address
    where connections are refused (nothing listens, and nothing else can start to)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        if listen:
            s.listen()
        _, port = s.getsockname()
        yield port
    finally:
        s.close()


@contextlib.contextmanager
def watched_leaver(address: str) -> Iterator[tuple[LivenessStream, list[tuple[str, str]]]]:
    """Two liveness streams on the lighthouse at ``address``: a "watcher" that records the
    PeerDown notices it gets, and a "leaver" for the test to close; both closed after."""
    seen: list[tuple[str, str]] = []
    watcher = LivenessStream(address, "watcher", on_peer_down=lambda rid, why: seen.append((rid, why)))
    leaver = LivenessStream(address, "leaver")
    try:
        assert watcher.start(5.0) and leaver.start(5.0)
        yield leaver, seen
    finally:
        leaver.close()
        watcher.close()


def listening_ports() -> set[int]:
    """TCP ports this process has a listening socket on (from /proc; no probing)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def replica_row(status: dict, rid: str) -> dict | None:
    """The ``replicas`` entry of ``rid`` in a status document (None if absent)."""
    for r in status["replicas"]:
        if r["replica_id"] == rid:
            return r
    return None


def ask_concurrently(
    c: LighthouseClient,
    ids: list[str],
    timeout: float = 10.0,
    kw_for: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Quorum]:
    """Every replica in ``ids`` asks ``c`` for a quorum from its own thread; their answers."""
    with cf.ThreadPoolExecutor(len(ids)) as ex:
        futs = {rid: ex.submit(c.quorum, rid, timeout, **(kw_for(rid) if kw_for else {})) for rid in ids}
        return {rid: f.result(timeout + 5) for rid, f in futs.items()}


def assert_one_quorum(answers: dict[str, Quorum], members: list[str]) -> Quorum:
    """All answers are the same quorum, with exactly ``members`` in sorted order."""
    ids = {q.quorum_id for q in answers.values()}
    assert len(ids) == 1, f"replicas disagree on quorum_id: {ids}"
    for rid, q in answers.items():
        assert list(q.replica_ids) == sorted(members), f"{rid} got {q.replica_ids}"
    return next(iter(answers.values()))


# ----------------------------------------------------------------------- in-process


#: Variables torch sets in its own process the first time it needs them (inductor's cache
#: directory, computed once, e.g. by a torch.distributed.checkpoint load): not a test's leak.
_SET_BY_TORCH = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                           "CUBLAS_WORKSPACE_CONFIG"})


@pytest.fixture(autouse=True)
def _environment_unchanged() -> Iterator[None]:
    """Every test leaves ``os.environ`` as it found it: a variable one test leaves behind
    reaches every process a later test starts (a leaked rendezvous setting once made a
    later torchrun's agent keep its store to itself). Runs after the test's own fixtures
    (``monkeypatch``) are undone; what is still changed is put back and fails the test,
    naming the variables."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
                     and k != "PYTEST_CURRENT_TEST"  # pytest's own, per phase
                     and not (k in _SET_BY_TORCH and k not in before))
    if not changed:
        return
    for k in changed:
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    pytest.fail(f"the test left the environment changed: {', '.join(changed)} (restored)", pytrace=False)


@pytest.fixture
def closers() -> Iterator[list[Callable[[], None]]]:
    """Cleanups of clients and channels, run after the lighthouses stopped: a gRPC
    channel still connected to a live server takes ~0.2 s to close, one whose server
    is gone closes at once."""
    fns: list[Callable[[], None]] = []
    yield fns
    for fn in reversed(fns):
        fn()


@pytest.fixture
def client(closers: list[Callable[[], None]]) -> Callable[..., LighthouseClient]:
    """``client(lh_or_addr, **kw)`` -> a connected LighthouseClient, closed at teardown."""

    def make(target: LighthouseServer | str, **kw: Any) -> LighthouseClient:
        addr = target.local_address() if isinstance(target, LighthouseServer) else target
        kw.setdefault("connect_timeout", 5.0)
        c = LighthouseClient(addr, **kw)
        closers.append(c.close)
        return c

    return make


@pytest.fixture
def lighthouse(closers: list[Callable[[], None]]) -> Iterator[Callable[..., LighthouseServer]]:
    """``lighthouse(min_replicas=..., ...)`` -> a started LighthouseServer on 127.0.0.1:0."""
    started: list[LighthouseServer] = []

    def make(**kw: Any) -> LighthouseServer:
        kw.setdefault("bind", "127.0.0.1:0")
        kw.setdefault("min_replicas", 1)
        server = LighthouseServer(**kw)
        started.append(server)
        return server

    yield make
    for server in reversed(started):
        server.shutdown(timeout=10)


# ----------------------------------------------------------------------- processes


class Proc:
    """A child process whose stdout lines are collected by a reader thread.

    stderr goes to a file (no pipe to fill up); ``stderr_text()`` reads it for messages.
    """

    def __init__(self, argv: list[str], log_dir: Path, name: str, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        child_env = dict(os.environ)
        child_env["PYTHONUNBUFFERED"] = "1"
        child_env.setdefault("RALLYPOINT_LOG_LEVEL", "INFO")
        if env:
            child_env.update(env)
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=str(log_dir),
            env=child_env,
        )
        self.pid = self.popen.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, name=f"reader-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self.lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        self.lines.put(None)  # EOF

    def next_line(self, timeout: float) -> str:
        """The next stdout line; AssertionError on EOF or after ``timeout``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.name}: no output line within {timeout:.1f}s; stderr:\n{self.stderr_text()[-3000:]}"
            ) from None
        if line is None:
            self.lines.put(None)  # keep EOF visible to later calls
            raise AssertionError(
                f"{self.name}: exited (rc={self.popen.poll()}) before the expected line; "
                f"stderr:\n{self.stderr_text()[-3000:]}"
            )
        self.seen.append(line)
        return line

    def wait_line(self, pred: Callable[[str], bool], timeout: float) -> str:
        """The first new stdout line satisfying ``pred`` within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.0, deadline - time.monotonic()))
            if pred(line):
                return line

    def json_line(self, timeout: float) -> dict:
        """The next stdout line that parses as a JSON object."""

        def is_json(line: str) -> bool:
            try:
                return isinstance(json.loads(line), dict)
            except ValueError:
                return False

        return json.loads(self.wait_line(is_json, timeout))

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout:.1f}s") from None

    def rest_of_stdout(self, timeout: float = 5.0) -> list[str]:
        """After the child exited: every stdout line not consumed yet."""
        self._reader.join(timeout)
        out = []
        while not self.lines.empty():
            line = self.lines.get_nowait()
            if line is not None:
                out.append(line)
        self.lines.put(None)
        return out

    def stderr_text(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text("utf-8", "replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child by pid (if still running)."""
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def cleanup(self) -> None:
        """Kill (SIGKILL) and reap the child, then close our ends."""
        self.kill(signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed child always exits
            pass
        self._reader.join(5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._stderr.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """``procs(argv_tail, name=..., env=...)`` -> Proc running ``python *argv_tail``."""
    started: list[Proc] = []
    counter = iter(range(10_000))

    def spawn(args: list[str], name: str | None = None, env: dict[str, str] | None = None) -> Proc:
        p = Proc([sys.executable, *args], tmp_path, name or f"proc{next(counter)}", env)
        started.append(p)
        return p

    yield spawn
    for p in started:
        p.cleanup()


@pytest.fixture
def spawn_python(procs: Callable[..., Proc]) -> Callable[..., Proc]:
    """``spawn_python(code, *args, name=..., env=...)``: a small Python child (``-c``)."""

    def spawn(code: str, *args: str, name: str | None = None, env: dict[str, str] | None = None) -> Proc:
        return procs(["-c", code, *args], name=name, env=env)

    return spawn


@pytest.fixture
def rallypoint_cli(procs: Callable[..., Proc]) -> Callable[..., Proc]:
    """``rallypoint_cli(*args)``: ``python -m rallypoint *args`` as a child process."""

    def spawn(*args: str, name: str | None = None, env: dict[str, str] | None = None) -> Proc:
        return procs(["-m", "rallypoint", *args], name=name, env=env)

    return spawn


class CliLighthouse:
    """A ``python -m rallypoint lighthouse`` child that printed its ready line."""

    def __init__(self, proc: Proc, info: dict) -> None:
        self.proc = proc
        self.info = info
        self.address: str = info["local"]
        self.http: str | None = info.get("http")


@pytest.fixture
def cli_lighthouse(rallypoint_cli: Callable[..., Proc]) -> Callable[..., CliLighthouse]:
    """``cli_lighthouse(min_replicas=2, state=..., extra=[...])``: start the CLI lighthouse
    on 127.0.0.1:0 and wait for its JSON ready line (default timeout 20 s)."""

    def start(
        min_replicas: int = 1,
        state: str | Path = ":memory:",
        extra: list[str] | None = None,
        http: bool = False,
        timeout: float = 20.0,
        name: str | None = None,
    ) -> CliLighthouse:
        args = [
            "lighthouse",
            "--min-replicas",
            str(min_replicas),
            "--bind",
            "127.0.0.1:0",
            "--http-bind",
            "127.0.0.1:0" if http else "off",
            "--state",
            str(state),
            *(extra or []),
        ]
        proc = rallypoint_cli(*args, name=name)
        return CliLighthouse(proc, proc.json_line(timeout))

    return start


# ----------------------------------------------------------------------- replica groups


@pytest.fixture
def replicas_factory(tmp_path: Path) -> Iterator[Callable[[Any], Any]]:
    """``replicas_factory(lighthouse)`` -> a ``replica_worker.Replicas`` whose worker
    processes are all SIGKILLed and reaped at teardown."""
    from replica_worker import Replicas

    made: list[Replicas] = []

    def make(lh: Any) -> Replicas:
        r = Replicas(tmp_path, lh.address())
        made.append(r)
        return r

    yield make
    for r in made:
        r.kill_all()


@pytest.fixture
def ddp_replicas(tmp_path: Path) -> Iterator[Callable[[Any], Any]]:
    """``ddp_replicas(lighthouse)`` -> a ``ddp_worker.DDPReplicas`` (replica groups training
    under rallypoint's DDP) whose workers are SIGKILLed by pid and reaped at teardown."""
    from ddp_worker import DDPReplicas

    made: list[DDPReplicas] = []

    def make(lh: Any) -> DDPReplicas:
        r = DDPReplicas(tmp_path, lh.address())
        made.append(r)
        return r

    yield make
    for r in made:
        r.kill_all()


@pytest.fixture
def mesh1() -> Iterator[Any]:
    """A 1-rank gloo world and a 1-D CPU device mesh in this process (FSDP2/DTensor tests),
    torn down afterwards; skips where gloo is missing or a process group already exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs gloo and no process group in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
