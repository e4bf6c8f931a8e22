"""Idle sockets from anyone cannot lock a rallypoint server: every gRPC server closes a
connection that has not finished its handshake within HANDSHAKE_TIMEOUT_MS (gRPC's own
default held it 60 s here), and every server raises its process's open-file soft limit to
the hard one, so the descriptors such sockets hold run out much later. (The HTTP
servers' connection slots are tested in test_checkpoint_server.py and test_http.py.)"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from rallypoint._net import rpc
from rallypoint._net.fds import MAX_SOFT_LIMIT, wanted_soft_limit

INF = resource.RLIM_INFINITY


@pytest.mark.parametrize("soft, hard, want", [
    (1024, 524288, 524288),
    (1024, 1024, 1024),  # nothing to raise to
    (4096, 2048, 4096),  # never lowered
    (1024, INF, MAX_SOFT_LIMIT),  # unlimited: the cap
    (1024, 1 << 30, MAX_SOFT_LIMIT),
    (INF, INF, INF),
])
def test_wanted_soft_limit(soft: int, hard: int, want: int) -> None:
    assert wanted_soft_limit(soft, hard, INF) == want


def _closed_within(host: str, port: int, seconds: float) -> float:
    """Connect, send nothing, and return how long the server took to close the socket."""
    with socket.create_connection((host, port), timeout=seconds) as s:
        t0 = time.monotonic()
        while True:
            try:
                if not s.recv(65536):  # the server's SETTINGS, then its GOAWAY, then the close
                    return time.monotonic() - t0
            except ConnectionResetError:
                return time.monotonic() - t0


def test_grpc_servers_close_a_connection_that_never_handshakes(monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint.lighthouse.server import LighthouseServer
    from rallypoint.manager.server import ManagerServer

    monkeypatch.setattr(rpc, "HANDSHAKE_TIMEOUT_MS", 500)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, token="tok")
    ms = ManagerServer(replica_id="r0", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
                       store_addr="127.0.0.1:29500", world_size=1, connect_timeout=timedelta(seconds=10),
                       token="tok")
    try:
        for addr in (lh.address(), ms.address()):
            host, port = addr.split("://")[-1].rsplit(":", 1)
            took = _closed_within(host, int(port), 10.0)
            assert 0.4 < took < 5.0, f"{addr}: an idle connection was held {took:.2f} s"
    finally:
        ms.shutdown()
        lh.shutdown()


_SERVER = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from rallypoint.lighthouse.server import LighthouseServer
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, token="tok")
    print(lh.address(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
    sys.stdin.read()  # until the test closes it
    lh.shutdown()
""")


def test_idle_sockets_cannot_exhaust_a_lighthouse_started_with_a_low_file_limit() -> None:
    """A lighthouse process started with a soft limit of 256 open files: 400 idle sockets
    to its gRPC port, and a replica's quorum call still succeeds. (Before the limit was
    raised, the same call failed after its 5 s connect timeout.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != INF and hard < 2048 or soft != INF and soft < 1024:
        pytest.skip(f"this host's open-file limits ({soft}, {hard}) are too low to hold 400 sockets on both sides")
    from rallypoint.lighthouse.client import LighthouseClient

    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        addr, limit = proc.stdout.readline().split()
        host, port = addr.split("://")[-1].rsplit(":", 1)
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(400)]
        client = LighthouseClient(addr, connect_timeout=5, token="tok")
        try:
            q = client.quorum("r0", timeout=timedelta(seconds=10), store_address="127.0.0.1:1")
        finally:
            client.close()
        assert q.replica_ids == ("r0",)
        assert int(limit) > 256, "the lighthouse raised its soft limit"
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait(timeout=10)
