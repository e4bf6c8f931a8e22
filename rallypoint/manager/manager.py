"""``Manager``: what a training loop holds (torchft 0.2's ``Manager`` semantics).

One step looks like::

    manager.start_quorum()          # quorum computed on a background thread
    loss = model(batch); loss.backward()
    for p in params: manager.allreduce(p.grad).wait()   # mean over participating replicas
    if manager.should_commit():     # the step's barrier; applies a pending heal first
        optimizer.step()

Errors during a step (allreduce, configure, heal) are recorded with :meth:`report_error`
and turn :meth:`should_commit` false; they are never raised mid-step. A replica that is
behind receives the state of an up-to-date peer through the checkpoint transport on the
quorum thread; the state is applied on the training thread (in :meth:`should_commit`,
:meth:`wait_quorum`, or in :meth:`start_quorum` when the quorum is synchronous), never
while the forward/backward pass may be reading the model.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
import threading
import uuid
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, TypeVar

import torch
from torch.distributed import ReduceOp, TCPStore

from rallypoint.manager.client import ManagerClient
from rallypoint.manager.recovery import QuorumResult

T = TypeVar("T")

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"

log = logging.getLogger("rallypoint.manager")


class WorldSizeMode(Enum):
    """DYNAMIC: every up-to-date replica contributes. FIXED_WITH_SPARES: exactly
    ``min_replica_size`` contribute; the others stay in sync and contribute zeros."""

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


def _td(value: Any, env: tuple[str, ...], default: timedelta) -> timedelta:
    for name in env:
        raw = os.environ.get(name)
        if raw:
            return timedelta(seconds=float(raw))
    if value is None:
        return default
    return value if isinstance(value, timedelta) else timedelta(seconds=float(value))


def _env(value: Any, *names: str) -> Any:
    if value is not None:
        return value
    for name in names:
        raw = os.environ.get(name)
        if raw:
            return raw
    return None


class _ReplicaLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['replica_id']}/{self.extra['group_rank']}] {msg}", kwargs  # type: ignore[index]


class _DoneWork:
    """A completed no-op work (what allreduce returns once the step has failed)."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def exception(self) -> None:
        return None


class _ManagedWork(_DoneWork):
    """Wraps a process-group work: on ``wait`` finishes the mean, and routes a failure
    to the manager instead of raising it."""

    def __init__(self, manager: "Manager", inner: Any, tensor: torch.Tensor, divisor: int | None) -> None:
        super().__init__(tensor)
        self._manager = manager
        self._inner = inner
        self._tensor = tensor
        self._divisor = divisor
        self._done = False
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._lock:
            if self._done:
                return True
            try:
                ok = self._inner.wait(timeout if timeout is not None else self._manager._timeout)
                if ok is False:
                    raise TimeoutError("allreduce did not complete in time")
                if self._divisor:
                    if self._tensor.is_floating_point() or self._tensor.is_complex():
                        self._tensor.div_(self._divisor)
                    else:
                        self._tensor.div_(self._divisor, rounding_mode="trunc")
            except Exception as e:  # noqa: BLE001 - recorded, the step will not commit
                self._manager.report_error(e)
            self._done = True
            return True

    def is_completed(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return super().get_future()


class Manager:
    """Fault-tolerant data-parallel training for one rank of one replica group.

    Arguments mirror torchft 0.2.0. Unset arguments fall back to the environment:
    ``RALLYPOINT_LIGHTHOUSE``/``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHFT_MANAGER_PORT``,
    ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC``, ``TORCHFT_CONNECT_TIMEOUT_SEC``.
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: Any = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
    ) -> None:
        self._pg = pg
        self._min_replica_size = int(min_replica_size)
        self._use_async_quorum = use_async_quorum
        self._timeout = _td(timeout, ("RALLYPOINT_TIMEOUT_SEC", "TORCHFT_TIMEOUT_SEC"), timedelta(seconds=60))
        self._quorum_timeout = _td(
            quorum_timeout, ("RALLYPOINT_QUORUM_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC"), timedelta(seconds=60)
        )
        self._connect_timeout = _td(
            connect_timeout, ("RALLYPOINT_CONNECT_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC"), timedelta(seconds=60)
        )
        self._world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._group_rank = int(_env(rank, "RANK") or 0)
        self._group_world_size = int(_env(world_size, "WORLD_SIZE") or 1)
        if not 0 <= self._group_rank < self._group_world_size:
            raise ValueError(f"rank {self._group_rank} is not in a replica group of {self._group_world_size}")

        self._user_state_dicts: dict[str, Callable[[], Any]] = {}
        self._load_state_dicts: dict[str, Callable[[Any], None]] = {}
        self._state_lock = threading.RLock()
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._errored: Exception | None = None
        self._err_lock = threading.Lock()
        self._healing = False
        self._pending_state_dict: dict[str, Any] | None = None
        self._participating_rank: int | None = None
        self._participating_world_size = 0
        self._quorum_future: cf.Future | None = None
        self._last_quorum: QuorumResult | None = None
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rallypoint-quorum")
        self._server: Any = None
        self._client: ManagerClient | None = None
        self._log: logging.LoggerAdapter = _ReplicaLog(log, {"replica_id": replica_id, "group_rank": self._group_rank})

        self._own_transport = checkpoint_transport is None
        if checkpoint_transport is None:
            from rallypoint.transports.http import HTTPTransport

            checkpoint_transport = HTTPTransport(timeout=self._timeout, bind="0.0.0.0:0", advertise_host=hostname)
        self._transport = checkpoint_transport

        try:
            self._connect(store_addr, store_port, lighthouse_addr, replica_id, port, hostname, heartbeat_interval,
                          quorum_retries)
        except BaseException:
            self.shutdown(wait=False)
            raise

    # ------------------------------------------------------------------ setup
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
        store_host = _env(store_addr, "MASTER_ADDR") or hostname
        sport = _env(store_port, "MASTER_PORT")
        is_master = self._group_rank == 0
        if sport is None and not is_master:
            raise ValueError("MASTER_PORT (store_port) is required for group ranks other than 0")
        self._store = TCPStore(
            host_name=store_host,
            port=int(sport or 0),
            is_master=is_master,
            wait_for_workers=False,
            timeout=self._connect_timeout,
        )
        if is_master:
            lh = _env(lighthouse_addr, "RALLYPOINT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE")
            if lh is None:
                raise ValueError("no lighthouse address: pass lighthouse_addr or set RALLYPOINT_LIGHTHOUSE")
            rid = _env(replica_id, "REPLICA_GROUP_ID")
            rid = f"{rid}:{uuid.uuid4()}" if rid else str(uuid.uuid4())
            mport = int(_env(port, "RALLYPOINT_MANAGER_PORT", "TORCHFT_MANAGER_PORT") or 0)
            from rallypoint.manager.server import ManagerServer

            self._server = ManagerServer(
                replica_id=rid,
                lighthouse_addr=lh,
                hostname=hostname,
                bind=f"0.0.0.0:{mport}",
                store_addr=f"{hostname}:{self._store.port}",
                world_size=self._group_world_size,
                heartbeat_interval=heartbeat_interval,
                connect_timeout=self._connect_timeout,
                quorum_retries=quorum_retries,
                on_peer_down=self._on_peer_down,
            )
            self._store.set(MANAGER_ADDR_KEY, self._server.address())
            self._store.set(REPLICA_ID_KEY, rid)
        addr = self._store.get(MANAGER_ADDR_KEY).decode()
        self._replica_id = self._store.get(REPLICA_ID_KEY).decode()
        self._log.extra["replica_id"] = self._replica_id  # type: ignore[index]
        self._client = ManagerClient(addr, connect_timeout=self._connect_timeout)
        self._log.info("manager ready: server %s, store %s:%d", addr, store_host, self._store.port)

    def _on_peer_down(self, replica_id: str, reason: str) -> None:
        # Runs on the liveness thread. Abort only when the dead peer is in our group, so
        # a blocked collective fails now instead of after the full timeout.
        q = self._last_quorum
        if q is not None and replica_id in q.replica_ids:
            self._log.warning("peer %s is down (%s): aborting the process group", replica_id, reason)
            self.report_error(ConnectionError(f"peer replica {replica_id} went down: {reason}"))
            try:
                self._pg.abort()
            except Exception as e:  # noqa: BLE001
                self._log.warning("abort after peer loss failed: %s", e)

    # ------------------------------------------------------------------ state dicts
    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]) -> None:
        with self._state_lock:
            if key in self._user_state_dicts:
                raise ValueError(f"state dict key {key!r} is already registered")
            self._load_state_dicts[key] = load_state_dict
            self._user_state_dicts[key] = state_dict

    def _manager_state_dict(self) -> dict[str, Any]:
        with self._state_lock:
            if not self._user_state_dicts:
                raise RuntimeError("no user state_dict registered: pass state_dict= or call register_state_dict_fn")
            return {"user": {k: fn() for k, fn in self._user_state_dicts.items()}, "torchft": self.state_dict()}

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    # ------------------------------------------------------------------ quorum
    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None) -> None:
        """Begin this step's quorum (on a background thread unless ``use_async_quorum``
        is off); the process group is reconfigured if the membership changed."""
        if self._quorum_future is not None:
            self._wait_future()
        with self._err_lock:
            self._errored = None
        self._healing = False
        self._pending_state_dict = None
        self._quorum_future = self._executor.submit(
            self._async_quorum, allow_heal, shrink_only, timeout or self._quorum_timeout
        )
        if not self._use_async_quorum:
            self.wait_quorum()

    def _wait_future(self) -> None:
        fut = self._quorum_future
        if fut is None:
            return
        limit = (self._quorum_timeout + 2 * self._timeout + self._connect_timeout).total_seconds()
        try:
            fut.result(timeout=limit)
        except cf.TimeoutError:
            self.report_error(TimeoutError(f"quorum did not finish within {limit:.0f}s"))
        except Exception as e:  # noqa: BLE001 - _async_quorum records its own errors
            self.report_error(e)

    def wait_quorum(self) -> None:
        """Wait for the quorum; then apply a received heal (call it outside forward/backward)."""
        if self._quorum_future is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        self._wait_future()
        if self._healing:
            self._apply_pending_state_dict()

    def _async_quorum(self, allow_heal: bool, shrink_only: bool, timeout: timedelta) -> None:
        assert self._client is not None
        try:
            q = self._client._quorum(
                group_rank=self._group_rank,
                step=self._step,
                checkpoint_metadata=self._transport.metadata(),
                shrink_only=shrink_only,
                timeout=timeout,
                commit_failures=self._commit_failures,
                init_sync=self._init_sync,
            )
        except Exception as e:  # noqa: BLE001
            self._log.warning("quorum failed: %s", e)
            self._participating_rank, self._participating_world_size = None, 0
            self.report_error(e)
            return
        self._last_quorum = q
        if self._use_async_quorum or not allow_heal:
            prank, pws = q.max_replica_rank, q.max_world_size
        else:
            prank, pws = q.replica_rank, q.replica_world_size
        if self._world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
            pws = min(pws, self._min_replica_size)
            if prank is not None and prank >= self._min_replica_size:
                prank = None
        self._participating_rank, self._participating_world_size = prank, pws

        if q.quorum_id != self._quorum_id:
            store = f"{q.store_address}/rallypoint/{q.quorum_id}/{self._group_rank}"
            self._log.info(
                "reconfiguring for quorum %d: replica rank %d/%d, store %s, max_step %d",
                q.quorum_id, q.replica_rank, q.replica_world_size, store, q.max_step,
            )
            try:
                self._quorum_id = q.quorum_id
                self._pg.configure(
                    store, self._replica_id, q.replica_rank, q.replica_world_size,
                    quorum_id=q.quorum_id, group_rank=self._group_rank, group_world_size=self._group_world_size,
                )
            except Exception as e:  # noqa: BLE001
                self._log.warning("process group configure failed: %s", e)
                self.report_error(e)
                return

        if not allow_heal:
            return
        try:
            if q.recover_dst_replica_ranks:
                self._log.info("serving step %d to replica ranks %s", q.max_step, q.recover_dst_replica_ranks)
                self._transport.send_checkpoint(
                    dst_ranks=q.recover_dst_replica_ranks, step=q.max_step,
                    state_dict=self._manager_state_dict(), timeout=self._timeout,
                )
            if q.heal:
                self._healing = True
                src = q.recover_src_replica_rank
                assert src is not None, "heal without a recovery source"
                self._log.info("healing to step %d from replica rank %d (%s)", q.max_step, src,
                               q.recover_src_manager_address)
                with ManagerClient(q.recover_src_manager_address, connect_timeout=self._connect_timeout) as peer:
                    meta = peer._checkpoint_metadata(self._group_rank, timeout=self._timeout)
                self._pending_state_dict = self._transport.recv_checkpoint(
                    src_rank=src, metadata=meta, step=q.max_step, timeout=self._timeout
                )
                self._log.info("received the state of step %d; it is applied before the optimizer step", q.max_step)
        except Exception as e:  # noqa: BLE001
            self._log.warning("recovery failed: %s", e)
            self.report_error(e)

    def _apply_pending_state_dict(self) -> None:
        pending = self._pending_state_dict
        self._pending_state_dict = None
        self._healing = False
        if pending is None:
            if self.errored() is None:
                self.report_error(RuntimeError("healing was required but no state was received"))
            return
        try:
            with self._state_lock:
                self.load_state_dict(pending["torchft"])
                user = pending["user"]
                for key, load in self._load_state_dicts.items():
                    if key in user:
                        load(user[key])
                    else:
                        raise KeyError(f"received state has no {key!r} entry (has {sorted(user)})")
            self._log.info("applied healed state: step %d", self._step)
        except Exception as e:  # noqa: BLE001
            self.report_error(e)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG) -> Any:
        """Sum (``SUM``) or mean (``AVG``) over the participating replicas; returns a work
        with ``wait()``. A healing or spare replica contributes zeros. Never raises for a
        communication failure: it is recorded and the step will not commit."""
        if self.errored() is not None:
            return _DoneWork(tensor)
        self._wait_future()
        if self.errored() is not None:
            return _DoneWork(tensor)
        if not self.is_participating():
            tensor.zero_()
        avg = reduce_op == ReduceOp.AVG
        try:
            work = self._pg.allreduce([tensor], ReduceOp.SUM if avg else reduce_op)
        except Exception as e:  # noqa: BLE001
            self.report_error(e)
            return _DoneWork(tensor)
        return _ManagedWork(self, work, tensor, max(1, self.num_participants()) if avg else None)

    def report_error(self, e: Exception) -> None:
        """Mark this step failed (it will not commit); the next quorum recovers."""
        with self._err_lock:
            if self._errored is None:
                self._log.warning("step %d error: %s", self._step, e)
                self._errored = e

    def errored(self) -> Exception | None:
        with self._err_lock:
            return self._errored

    # ------------------------------------------------------------------ commit
    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """The step's barrier: True when every rank of the group may apply the step."""
        assert self._client is not None
        if self._quorum_future is None:
            raise RuntimeError("should_commit() called before start_quorum()")
        self._wait_future()
        if self._healing:
            self._apply_pending_state_dict()
        pg_err = self._pg.errored()
        if pg_err is not None:
            self.report_error(pg_err)
        enough = self._participating_world_size >= self._min_replica_size
        local = enough and self.errored() is None
        try:
            decision = self._client.should_commit(self._group_rank, self._step, local, timeout or self._timeout)
        except Exception as e:  # noqa: BLE001
            self.report_error(e)
            decision = False
        self._log.info(
            "should_commit step %d: %s (local %s, participants %d/%d, error %s)",
            self._step, decision, local, self._participating_world_size, self._min_replica_size, self.errored(),
        )
        try:
            self._transport.disallow_checkpoint()
        except Exception as e:  # noqa: BLE001
            self._log.warning("disallow_checkpoint failed: %s", e)
        if decision:
            self._step += 1
            self._batches_committed += self._participating_world_size
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise RuntimeError(
                    f"[{self._replica_id}] {self._commit_failures} consecutive failed steps "
                    f"(max_retries={self._max_retries}); last error: {self.errored()}"
                )
        return decision

    # ------------------------------------------------------------------ queries
    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        if self._quorum_future is None:
            return 0
        self._wait_future()
        return self._participating_world_size

    def participating_rank(self) -> int | None:
        if self._quorum_future is None:
            return None
        self._wait_future()
        return self._participating_rank

    def is_participating(self) -> bool:
        return self._participating_rank is not None and not self._healing

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def shutdown(self, wait: bool = True) -> None:
        """Stop the quorum thread, the transport, the client and (rank 0) the server."""
        self._executor.shutdown(wait=wait, cancel_futures=True)
        if self._own_transport and getattr(self, "_transport", None) is not None:
            self._transport.shutdown(wait=wait)
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.shutdown()
        self._log.info("manager shut down")


__all__ = ["Manager", "WorldSizeMode"]
