"""How a :class:`~rallypoint.manager.Manager` joins its replica group: the group's store
(the caller's, or one it hosts), group rank 0's ManagerServer and the address and replica
id it publishes in the store, every rank's client of that server, and the peer-down relay
that carries the lighthouse's death notices to the other ranks. Apart from the Manager so
that the step path (quorum, allreduce, commit) reads on its own.

With a job token, what rank 0 publishes in the store is signed (``_storesig``) and every
rank checks it: a ``manager_addr`` written by anyone else (who would then receive the job
token from the ranks that dial it) is refused, logged, and rank 0's own value waited for.
Without a token the store's values are trusted as they are (the data plane is open).

Each rank 1..n writes the digest of its ManagerClient's rank key in the store before its
first call; the server binds a group rank only to the key its digest names (``_votes``)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from datetime import timedelta
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError, PrefixStore

from rallypoint._net.auth import job_token
from rallypoint.manager._config import env as _env
from rallypoint.manager._failfast import FailFast
from rallypoint.manager._peer_relay import PeerDownRelay
from rallypoint.manager._storesig import sign, store_scope, verify
from rallypoint.manager._votes import RANK_KEY_STORE_KEY, new_rank_key, rank_key_digest
from rallypoint.manager._store import open_store as _open_store, plan_store as _plan_store, store_prefix as _store_prefix
from rallypoint.manager.client import ManagerClient

#: Store keys under which group rank 0 publishes its server's address and the replica id.
MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"
#: How often a rank that found a forged value looks again for rank 0's own.
_RECHECK_S = 0.05


def published_rank_key(store: Any, rank: int, log: logging.Logger | logging.LoggerAdapter) -> str | None:
    """The digest of its rank key that group rank ``rank`` wrote in the group's store (None
    if none, or the store cannot be read): what the ManagerServer binds the rank to."""
    key = RANK_KEY_STORE_KEY.format(rank=rank)
    try:
        return store.get(key).decode("ascii", "replace") if store.check([key]) else None
    except Exception as e:  # noqa: BLE001 - unreadable: unconfirmed (the caller is refused and retries)
        log.warning("cannot read %s from the group's store: %s", key, e)
        return None


def publish_signed(store: Any, token: str | None, scope: str, values: dict[str, str]) -> None:
    """Write ``values`` (key: value) in the group's store, signed with the job token
    (plain without one). Group rank 0's side of :func:`read_signed`."""
    for key, value in values.items():
        store.set(key, sign(token, scope, key, value.encode()))


def read_signed(store: Any, key: str, token: str | None, scope: str, timeout_s: float,
                log: logging.Logger | logging.LoggerAdapter) -> str:
    """The value group rank 0 published under ``key``. A value not signed with the job
    token (someone else wrote the key first, or replayed another's) is refused and logged
    once, and the key read again until rank 0's own value is there or ``timeout_s``
    passes (TimeoutError). ``store.get`` blocks until the key exists (the store's
    timeout: DistStoreError)."""
    deadline = time.monotonic() + timeout_s
    refused = 0
    while True:
        value = verify(token, scope, key, store.get(key))
        if value is not None:
            if refused:
                log.info("store key %s: rank 0's signed value arrived after %d forged one(s)", key, refused)
            return value.decode()
        refused += 1
        if refused == 1:
            log.warning("refused store key %s: it is not signed with the job token (someone who can reach the "
                        "group's store wrote it); waiting for group rank 0's own value", key)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"store key {key} holds only values not signed with the job token "
                               f"({refused} read in {timeout_s:.0f}s); someone who can reach the group's store "
                               "is writing it; check who can reach MASTER_ADDR:MASTER_PORT")
        time.sleep(_RECHECK_S)


class GroupConnection:
    """The Manager's part that connects it to its replica group (called once, from
    ``Manager.__init__``)."""

    _group_rank: int
    _group_world_size: int
    _connect_timeout: timedelta
    _log: logging.LoggerAdapter
    _server: Any
    _client: Any
    _relay: PeerDownRelay | None
    _replica_id: str
    _lighthouse_addr: str | None
    _store: PrefixStore
    _store_host: str
    _store_port: int
    _ff: FailFast


    def _connect(
        self,
        store_addr: str | None,
        store_port: int | None,
        lighthouse_addr: str | None,
        replica_id: str | None,
        port: int | None,
        hostname: str,
        heartbeat_interval: timedelta,
        quorum_retries: int,
    ) -> None:
        plan = _plan_store(store_addr, store_port, hostname, os.environ)
        is_master = self._group_rank == 0
        raw = _open_store(plan, self._group_rank, self._group_world_size, self._connect_timeout, self._log)
        self._store_host, self._store_port = plan.host, int(raw.port)
        prefix = _store_prefix(os.environ)
        self._store = PrefixStore(prefix, raw)
        token = job_token()  # as the ManagerServer and ManagerClient read it
        scope = store_scope(prefix, self._store_port, os.environ)
        if is_master:
            lh = _env(lighthouse_addr, "RALLYPOINT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE")
            if lh is None:
                raise ValueError("no lighthouse address: pass lighthouse_addr or set RALLYPOINT_LIGHTHOUSE")
            self._lighthouse_addr = lh
            rid = _env(replica_id, "REPLICA_GROUP_ID")
            rid = f"{rid}:{uuid.uuid4()}" if rid else str(uuid.uuid4())
            mport = int(_env(port, "RALLYPOINT_MANAGER_PORT", "TORCHFT_MANAGER_PORT") or 0)
            from rallypoint.manager.server import ManagerServer

            def serve(bind_port: int) -> ManagerServer:
                return ManagerServer(
                    replica_id=rid,
                    lighthouse_addr=lh,
                    hostname=hostname,
                    bind=f"0.0.0.0:{bind_port}",
                    store_addr=f"{plan.advertise}:{self._store_port}",
                    world_size=self._group_world_size,
                    heartbeat_interval=heartbeat_interval,
                    connect_timeout=self._connect_timeout,
                    quorum_retries=quorum_retries,
                    on_peer_down=self._on_peer_down,
                    on_lease_left=self._on_lease_left,
                    published_rank_key=lambda rank: published_rank_key(self._store, rank, self._log),
                )

            try:
                self._server = serve(mport)
            except OSError as e:
                if not mport:
                    raise
                # A fixed port (torchft's tests pass 19530 + replica) can be taken between
                # runs. Nobody dials it by number: the group's ranks read the address from
                # the store below, the lighthouse and the peers from the quorum. So the OS
                # picks one instead of the job failing.
                self._log.warning("manager port %d is taken (%s); serving on a port the OS picks instead", mport, e)
                self._server = serve(0)
            publish_signed(self._store, token, scope, {MANAGER_ADDR_KEY: self._server.address(), REPLICA_ID_KEY: rid})
        wait_s = self._connect_timeout.total_seconds()
        try:
            addr = read_signed(self._store, MANAGER_ADDR_KEY, token, scope, wait_s, self._log)
            self._replica_id = read_signed(self._store, REPLICA_ID_KEY, token, scope, wait_s, self._log)
        except (DistStoreError, DistNetworkError) as e:
            raise TimeoutError(
                f"group rank {self._group_rank}: group rank 0 did not publish its manager address in the store "
                f"{plan.host}:{plan.port} (keys under {prefix}/) within {self._connect_timeout.total_seconds():.0f}s; "
                "is group rank 0 running, with the same store and the same TORCHELASTIC_RESTART_COUNT?"
            ) from e
        self._log.extra["replica_id"] = self._replica_id  # type: ignore[index]
        if self._server is not None:
            from rallypoint.manager._local import LocalManagerClient

            self._client = LocalManagerClient(self._server)  # no gRPC round trip to ourselves
        else:
            # Our rank key's digest in the group's store first: the server binds our rank to it.
            rank_key = new_rank_key()
            self._store.set(RANK_KEY_STORE_KEY.format(rank=self._group_rank), rank_key_digest(rank_key))
            self._client = ManagerClient(addr, connect_timeout=self._connect_timeout, rank_key=rank_key)
        if self._group_world_size > 1:
            self._relay = PeerDownRelay(self._store_host, self._store_port, self._group_rank, self._on_peer_down,
                                        self._connect_timeout, prefix=prefix, on_lease_left=self._on_lease_left,
                                        token=token, scope=scope)
            if not is_master:
                self._relay.start()
        self._log.info("manager ready: server %s, store %s:%d", addr, self._store_host, self._store_port)

    def _on_peer_down(self, replica_id: str, reason: str) -> None:
        """The lighthouse says ``replica_id`` died (rank 0's liveness stream, or the relay):
        tell the group's other ranks (rank 0), then let FailFast abort what blocks on it."""
        if self._group_rank == 0 and self._relay is not None:
            self._relay.publish(replica_id, reason)
        self._ff.peer_down(replica_id, reason)

    def _on_lease_left(self, replica_id: str, reason: str, quorum_id: int, after_step: int) -> None:
        """A member left the lease of ``quorum_id`` after ``after_step`` (rank 0's stream, or the relay)."""
        if self._group_rank == 0 and self._relay is not None:
            self._relay.publish(replica_id, reason, lease=(quorum_id, after_step))
        self._ff.left_lease(replica_id, reason, quorum_id, after_step)


__all__ = ["MANAGER_ADDR_KEY", "REPLICA_ID_KEY", "GroupConnection", "publish_signed", "read_signed"]
