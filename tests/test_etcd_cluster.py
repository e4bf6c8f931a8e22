"""The etcd test harness (tests/etcd_cluster.py): real etcd clusters on loopback, with
peers on UNIX sockets and clients on kernel-chosen ports, that serve through ``aetcd``
and keep serving when a member is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from conftest import listening_ports
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401

aetcd = pytest.importorskip("aetcd")


async def put_get(endpoint: str, key: bytes, value: bytes, timeout: float = 5.0) -> bytes | None:
    """Put ``key`` through ``endpoint`` and read it back there."""
    host, port = endpoint.rsplit(":", 1)
    client = aetcd.Client(host, int(port), timeout=timeout)
    try:
        await client.connect()
        await client.put(key, value)
        got = await client.get(key)
        return None if got is None else got.value
    finally:
        await client.close()


def _tcp_listen_ports(pid: int) -> set[int]:
    """TCP ports ``pid`` listens on (from /proc; no probing)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_single_member_serves_put_get(etcd_cluster: Callable[..., EtcdCluster]) -> None:  # noqa: F811
    c = etcd_cluster(members=1)
    [ep] = c.endpoints
    assert asyncio.run(put_get(ep, b"/t/one", b"1")) == b"1"
    assert c.spec("lh") == f"etcd://{ep}/lh"
    # Clients on the one logged TCP port, peers on a socket file: nothing else is bound.
    assert _tcp_listen_ports(c.pids[0]) == {c.port(0)}
    assert (c.root / "localhost:1001").is_socket()
    assert not listening_ports() & {c.port(0)}  # etcd's port, not one this process holds


def test_three_members_survive_a_sigkilled_leader(etcd_cluster: Callable[..., EtcdCluster]) -> None:  # noqa: F811
    c = etcd_cluster(members=3)
    assert len(set(c.endpoints)) == 3 and len(set(c.pids)) == 3
    assert c.spec("/lh") == "etcd://" + ",".join(c.endpoints) + "/lh"
    assert asyncio.run(put_get(c.endpoint(0), b"/t/before", b"b")) == b"b"

    dead = c.leader()
    c.kill(dead)
    assert not c.alive(dead)
    survivor = (dead + 1) % 3
    # A new leader is elected among the two left (election timeout 500 ms); the write
    # made before the kill is still there, and new ones go through.
    assert c.leader(via=survivor, timeout=10) != dead
    for i in range(3):
        if i != dead:
            assert asyncio.run(put_get(c.endpoint(i), f"/t/after{i}".encode(), b"a")) == b"a"

    async def read_before() -> bytes | None:
        host, port = c.endpoint(survivor).rsplit(":", 1)
        client = aetcd.Client(host, int(port), timeout=5)
        try:
            await client.connect()
            got = await client.get(b"/t/before")
            return None if got is None else got.value
        finally:
            await client.close()

    assert asyncio.run(read_before()) == b"b"

    # The killed member comes back on its data dir (and a new client port) and catches up.
    ep = c.restart(dead, timeout=15)
    assert asyncio.run(put_get(ep, b"/t/back", b"k")) == b"k"
