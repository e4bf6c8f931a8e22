"""Real etcd clusters (1 or 3 members) on loopback, for the etcd-backed lighthouse tests.

``EtcdCluster(tmp_path, members=3)`` runs Debian's ``etcd`` (3.4) binary, one process per
member, and knows each member's client endpoint and pid; ``kill(i)`` SIGKILLs one member,
``stop()`` all of them (by pid, reaped). The ``etcd_cluster`` fixture is a factory of
started clusters, stopped at teardown; a test module gets it with
``from etcd_cluster import etcd_cluster  # noqa: F401``. It skips the test when the
``etcd`` binary or the ``aetcd`` client is missing (``make test`` installs etcd where apt can).

No port is picked ahead of time:

- peers talk over UNIX sockets: ``unix://localhost:1001`` makes etcd listen on (and its
  peers dial) a socket file named ``localhost:1001`` in the current directory, so every
  member of a cluster runs in the same directory (its own), under its own name;
- clients use TCP on ``127.0.0.1:0``; the port the kernel gave is read back from the line
  etcd logs when it starts serving (``serving insecure client requests on 127.0.0.1:P``),
  which comes once the member has joined the cluster.

``start()`` returns once every member answered a put/get round trip through ``aetcd``
(the probe key is deleted again, so the cluster starts empty). Every wait has a deadline.

Secured clusters: ``tls=EtcdTls.make(dir)`` (trustme certificates: a CA, etcd's server
certificate, a client certificate) serves clients over https and demands a client
certificate signed by the CA; ``root_password=...`` turns etcd's authentication on once the
cluster is up (user ``root``), and ``add_user`` adds a user allowed to read and write one key
prefix. The cluster's own probes use ``admin_security`` (the client certificate and root).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import pytest

from rallypoint.lighthouse.etcd_auth import EtcdSecurity, make_client

SKIP_NO_ETCD = "etcd is not installed (Debian's etcd-server; `make test` installs it where apt can)"
SKIP_NO_AETCD = "aetcd is not installed (pip install 'rallypoint[etcd]'; the test extra has it)"

_SERVING = re.compile(rb"serving (?:insecure )?client requests on 127\.0\.0\.1:(\d+)")
_PEER_BASE = 1001  # peer socket names: localhost:1001, localhost:1002, ... (files, not ports)

T = TypeVar("T")


def etcd_binary() -> str | None:
    """The ``etcd`` on PATH, or None."""
    return shutil.which("etcd")


def _run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``make()`` to completion: on a fresh event loop in this thread, or
    (when this thread already runs a loop, as in an async test) in a helper thread."""

    async def main() -> T:
        return await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with cf.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, main()).result()


@dataclass(frozen=True)
class EtcdTls:
    """PEM files of a test PKI: the CA, etcd's server certificate and key (127.0.0.1 and
    localhost), and a client certificate and key (no user name in it)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, directory: Path) -> EtcdTls:
        """A fresh CA and certificates under ``directory`` (trustme)."""
        import trustme

        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        client = ca.issue_cert("client.test")
        paths = {n: directory / f"{n}.pem" for n in ("ca", "server_cert", "server_key", "client_cert", "client_key")}
        ca.cert_pem.write_to_path(str(paths["ca"]))
        server.cert_chain_pems[0].write_to_path(str(paths["server_cert"]))
        server.private_key_pem.write_to_path(str(paths["server_key"]))
        client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
        client.private_key_pem.write_to_path(str(paths["client_key"]))
        return cls(**paths)

    def security(self, client_cert: bool = True, user: str | None = None, password: str | None = None) -> EtcdSecurity:
        """Client settings trusting this CA, with (or without) the client certificate."""
        return EtcdSecurity(ca=self.ca.read_bytes(), cert=self.client_cert.read_bytes() if client_cert else None,
                            key=self.client_key.read_bytes() if client_cert else None, user=user, password=password)


async def _round_trip(port: int, key: bytes, rpc_timeout: float, security: EtcdSecurity | None = None) -> None:
    """One put/get/delete of ``key`` through the member serving clients on ``port``."""
    client = make_client("127.0.0.1", port, security, rpc_timeout)
    try:
        await client.connect()
        value = uuid.uuid4().hex.encode()
        await client.put(key, value)
        got = await client.get(key)
        if got is None or got.value != value:
            raise RuntimeError(f"read back {got!r} after putting {value!r}")
        await client.delete(key)
    finally:
        await client.close()


class EtcdCluster:
    """``members`` etcd processes forming one cluster; see the module docstring."""

    def __init__(self, tmp_path: str | os.PathLike[str], members: int = 1, etcd: str | None = None,
                 tls: EtcdTls | None = None, root_password: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        if members < 1:
            raise ValueError("members must be at least 1")
        self.members = members
        self.etcd = etcd or etcd_binary() or "etcd"
        # One directory per cluster: the peers' socket files live here (and are found here
        # by every member, all of which run in it), next to each member's data and log.
        self.root = Path(tempfile.mkdtemp(prefix="etcd-", dir=tmp_path))
        self.token = f"rallypoint-{uuid.uuid4().hex[:12]}"
        self.names = [f"m{i}" for i in range(members)]
        self.peer_urls = [f"unix://localhost:{_PEER_BASE + i}" for i in range(members)]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self._logs: list[IO[bytes] | None] = [None] * members
        self._log_paths: list[Path] = [self.root / f"{n}.log" for n in self.names]
        self._ports: list[int | None] = [None] * members
        self._starts = [0] * members  # how often each member was started (names its log)
        self.startup_s: float | None = None  # seconds start() took
        self.tls = tls
        self.root_password = root_password
        self.extra_args = tuple(extra_args)  # more etcd flags, e.g. ("--auth-token-ttl", "1")
        self._auth_on = False

    # ------------------------------------------------------------------ addresses

    @property
    def endpoints(self) -> list[str]:
        """``127.0.0.1:PORT`` of every member's client listener (killed members included)."""
        if any(p is None for p in self._ports):
            raise RuntimeError("the cluster is not started")
        return [f"127.0.0.1:{p}" for p in self._ports]

    def endpoint(self, i: int) -> str:
        return self.endpoints[i]

    def port(self, i: int) -> int:
        p = self._ports[i]
        if p is None:
            raise RuntimeError(f"member {i} is not started")
        return p

    @property
    def admin_security(self) -> EtcdSecurity | None:
        """What the cluster's own probes connect with: the client certificate (TLS) and
        user root (once authentication is on)."""
        user, pw = ("root", self.root_password) if self._auth_on else (None, None)
        if self.tls is not None:
            return self.tls.security(user=user, password=pw)
        return EtcdSecurity(user=user, password=pw) if user else None

    def spec(self, prefix: str = "") -> str:
        """The lighthouse's state spec: ``etcd://127.0.0.1:P1,127.0.0.1:P2/prefix``."""
        return "etcd://" + ",".join(self.endpoints) + "/" + prefix.lstrip("/")

    @property
    def pids(self) -> list[int]:
        """Each member's (latest) process id, dead or alive."""
        return [p.pid for p in self._procs if p is not None]

    def alive(self, i: int) -> bool:
        p = self._procs[i]
        return p is not None and p.poll() is None

    def log_text(self, i: int) -> str:
        """What member ``i`` logged (its latest run)."""
        try:
            return self._log_paths[i].read_text("utf-8", "replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ lifecycle

    def _argv(self, i: int) -> list[str]:
        initial = ",".join(f"{n}={u}" for n, u in zip(self.names, self.peer_urls))
        scheme = "https" if self.tls is not None else "http"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth",
        ]
        return [
            self.etcd,
            "--name", self.names[i],
            "--data-dir", str(self.root / f"{self.names[i]}.data"),
            "--listen-peer-urls", self.peer_urls[i],
            "--initial-advertise-peer-urls", self.peer_urls[i],
            "--initial-cluster", initial,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.token,
            "--listen-client-urls", f"{scheme}://127.0.0.1:0",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:0",
            *tls,
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            # Only NOTICE and up from etcd's own packages: the "serving insecure client
            # requests" line is a NOTICE (--log-level warn would drop it); raft and the
            # internal grpc-gateway (which dials 127.0.0.1:0 and complains) log regardless.
            "--logger", "capnslog",
            # (over TLS, "serving client requests on ..." is an INFO line of package embed).
            "--log-package-levels", "*=NOTICE,embed=INFO" if self.tls is not None else "*=NOTICE",
            *self.extra_args,
        ]  # fmt: skip

    def _spawn(self, i: int) -> None:
        self._starts[i] += 1
        n = self._starts[i]
        self._log_paths[i] = self.root / (f"{self.names[i]}.log" if n == 1 else f"{self.names[i]}.{n}.log")
        self._ports[i] = None
        log = open(self._log_paths[i], "wb")
        self._logs[i] = log
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "ETCDCTL_"))}
        self._procs[i] = subprocess.Popen(
            self._argv(i),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(self.root),
            env=env,
        )

    def _wait_port(self, i: int, deadline: float) -> int:
        """The client port member ``i`` logged, polling its log until ``deadline``."""
        proc = self._procs[i]
        assert proc is not None
        while True:
            m = _SERVING.search(self._log_paths[i].read_bytes())
            if m:
                port = int(m.group(1))
                self._ports[i] = port
                return port
            if proc.poll() is not None:
                raise RuntimeError(f"etcd member {i} exited (rc={proc.returncode}):\n{self.log_text(i)[-3000:]}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"etcd member {i} serves no clients yet; its log:\n{self.log_text(i)[-3000:]}")
            time.sleep(0.02)

    def _wait_ready(self, members: list[int], deadline: float) -> None:
        """A put/get round trip through each of ``members``, retried until ``deadline``."""

        import aetcd  # noqa: F401 - missing, it fails here rather than being retried

        async def probe_all() -> None:
            for i in members:
                last: BaseException | None = None
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"etcd member {i} ({self.endpoint(i)}) answered no put/get: {last!r}; "
                            f"its log:\n{self.log_text(i)[-3000:]}"
                        )
                    try:
                        await _round_trip(self.port(i), f"/etcd_cluster/ready/{self.names[i]}".encode(), min(2.0, left),
                                          self.admin_security)
                        break
                    except Exception as e:  # noqa: BLE001 - aetcd raises several kinds while electing
                        last = e
                        if not self.alive(i):
                            raise RuntimeError(f"etcd member {i} exited:\n{self.log_text(i)[-3000:]}") from e
                        await asyncio.sleep(0.05)

        _run_async(probe_all)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member, wait (up to ``timeout`` s in all) until each serves a
        put/get; on failure everything started is killed and the error raised."""
        if any(p is not None for p in self._procs):
            raise RuntimeError("the cluster was started already")
        t0 = time.monotonic()
        deadline = t0 + timeout
        try:
            for i in range(self.members):  # all at once: a member serves only once a quorum is up
                self._spawn(i)
            for i in range(self.members):
                self._wait_port(i, deadline)
            self._wait_ready(list(range(self.members)), deadline)
            if self.root_password is not None:
                self._enable_auth(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    async def _auth_calls(self, calls: Callable[[Any, Any, dict[str, Any]], Awaitable[None]], timeout: float) -> None:
        """``calls(rpc, auth_stub, call_kwargs)`` on a client of member 0 (as admin)."""
        from aetcd import rpc

        client = make_client("127.0.0.1", self.port(0), self.admin_security, timeout)
        try:
            await client.connect()
            await calls(rpc, rpc.AuthStub(client.channel), {"metadata": client.metadata, "timeout": timeout})
        finally:
            await client.close()

    def _enable_auth(self, timeout: float) -> None:
        """User ``root`` (role root) with ``root_password``, then authentication on."""
        assert self.root_password is not None
        password = self.root_password

        async def calls(rpc: Any, auth: Any, kw: dict[str, Any]) -> None:
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), **kw)
            await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), **kw)
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), **kw)
            await auth.AuthEnable(rpc.AuthEnableRequest(), **kw)

        _run_async(lambda: self._auth_calls(calls, timeout))
        self._auth_on = True

    def add_user(self, name: str, password: str, prefix: str, timeout: float = 10.0) -> None:
        """A user that may read and write the keys under ``prefix`` only (and nothing else)."""
        end = prefix.encode()[:-1] + bytes([prefix.encode()[-1] + 1])

        async def calls(rpc: Any, auth: Any, kw: dict[str, Any]) -> None:
            await auth.RoleAdd(rpc.AuthRoleAddRequest(name=f"{name}-role"), **kw)
            perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=prefix.encode(), range_end=end)
            await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=f"{name}-role", perm=perm), **kw)
            await auth.UserAdd(rpc.AuthUserAddRequest(name=name, password=password), **kw)
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=f"{name}-role"), **kw)

        _run_async(lambda: self._auth_calls(calls, timeout))

    def restart(self, i: int, timeout: float = 30.0) -> str:
        """Start member ``i`` again (after ``kill(i)``) on its data dir; it rejoins the
        cluster on a new client port. Returns its new endpoint (``endpoints`` and ``spec``
        name it from now on)."""
        if self.alive(i):
            raise RuntimeError(f"etcd member {i} is still running")
        self._close_log(i)
        deadline = time.monotonic() + timeout
        try:
            self._spawn(i)
            self._wait_port(i, deadline)
            self._wait_ready([i], deadline)
        except BaseException:
            self.kill(i)
            raise
        return self.endpoint(i)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` by pid and reap it (nothing if it is not running)."""
        proc = self._procs[i]
        if proc is None:
            return
        try:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process exits
                pass
        finally:
            self._close_log(i)

    def _close_log(self, i: int) -> None:
        log = self._logs[i]
        self._logs[i] = None
        if log is not None:
            log.close()

    def stop(self) -> None:
        """SIGKILL and reap every member (idempotent)."""
        errors: list[BaseException] = []
        for i in range(self.members):
            try:
                self.kill(i)
            except BaseException as e:  # noqa: BLE001 - kill the others first
                errors.append(e)
        if errors:
            raise errors[0]

    def leader(self, via: int | None = None, timeout: float = 10.0) -> int:
        """The index of the current leader, asked of member ``via`` (default: the first
        alive one); retried until it names one that is alive (after a leader is killed,
        the others name it until they elect a new one), or ``timeout``."""
        i = via if via is not None else next(j for j in range(self.members) if self.alive(j))
        deadline = time.monotonic() + timeout

        async def ask() -> int:
            last: Any = None
            while time.monotonic() < deadline:
                client = make_client("127.0.0.1", self.port(i), self.admin_security, 2.0)
                try:
                    await client.connect()
                    status = await client.status()
                    if status.leader is None:
                        last = "no leader"
                    else:
                        j = self.names.index(status.leader.name)
                        if self.alive(j):
                            return j
                        last = f"leader m{j} is killed (not noticed yet)"
                except Exception as e:  # noqa: BLE001
                    last = e
                finally:
                    await client.close()
                await asyncio.sleep(0.05)
            raise TimeoutError(f"no leader known to etcd member {i} within {timeout:.1f}s: {last!r}")

        return _run_async(ask)

    def __enter__(self) -> EtcdCluster:
        if all(p is None for p in self._procs):
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Callable[..., EtcdCluster]]:
    """``etcd_cluster(members=1, timeout=30, tls=None, root_password=None, extra_args=())`` -> a started
    EtcdCluster under ``tmp_path``;
    every cluster is SIGKILLed and reaped at teardown. Skips without etcd or aetcd."""
    if etcd_binary() is None:
        pytest.skip(SKIP_NO_ETCD)
    try:
        import aetcd  # noqa: F401
    except ImportError:
        pytest.skip(SKIP_NO_AETCD)
    started: list[EtcdCluster] = []

    def make(members: int = 1, timeout: float = 30.0, tls: EtcdTls | None = None,
             root_password: str | None = None, extra_args: tuple[str, ...] = ()) -> EtcdCluster:
        cluster = EtcdCluster(tmp_path, members, tls=tls, root_password=root_password, extra_args=extra_args)
        started.append(cluster)
        return cluster.start(timeout)

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()
