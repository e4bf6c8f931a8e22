"""``Manager``: what a training loop holds (torchft 0.2's ``Manager`` semantics).

One step looks like::

    manager.start_quorum()          # quorum computed on a background thread
    loss = model(batch); loss.backward()
    for p in params: manager.allreduce(p.grad).wait()   # mean over participating replicas
    if manager.should_commit():     # the step's barrier; applies a pending heal first
        optimizer.step()

Errors during a step (allreduce, configure, heal) are recorded with :meth:`report_error`
and turn :meth:`should_commit` false; they are never raised mid-step. The first
communication error also aborts the process group, so peers blocked in the same
collective fail at once instead of waiting for their timeout; so does the lighthouse's
notice that a member of the quorum died (relayed to every rank of the group).

Healing never writes user state while forward/backward may read it: how the sender serves
and the receiver applies, on which thread, is described in ``_heal.py``.

Each round leaves a :class:`StepRecord` (:meth:`step_records`: quorum, time split, outcome),
whose step stats go to the lighthouse with the next quorum request. Guards: corruption
checks before the vote (``sdc_check``, ``sdc_check_every``: ``_guard.py``); injected faults
(``rallypoint inject``: ``_inject.py``) happen at :meth:`start_quorum`, a step boundary.

A quorum that does not form within ``quorum_timeout`` is not a communication hiccup:
:meth:`should_commit` and :meth:`wait_quorum` raise a ``TimeoutError`` that names the
replica and the lighthouse. A quorum that cannot work as configured (replica groups of
different sizes, a request the lighthouse rejects) raises a ``ValueError`` the same way.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
from torch.distributed import ReduceOp

from rallypoint.manager import _progress, _reconfig
from rallypoint.manager._config import ReplicaLog as _ReplicaLog, WorldSizeMode, env as _env, td as _td
from rallypoint.manager._connect import GroupConnection
from rallypoint.manager._failfast import FailFast
from rallypoint.manager._guard import SdcGuard
from rallypoint.manager._heal import Healer
from rallypoint.manager._heal_step import heal_here
from rallypoint.manager._heal_thread import HealThread
from rallypoint.manager._inject import Injector
from rallypoint.manager._outage import Outage
from rallypoint.manager._peer_relay import PeerDownRelay
from rallypoint.manager._record import Round as _Round, RoundLog, StepRecord, cause_of
from rallypoint.manager._rounds import QuorumRounds
from rallypoint.manager._state import UserState
from rallypoint.manager._torchft_api import TorchftApi
from rallypoint.manager._work import DoneWork, ManagedWork, allreduce_args, neutral_fill
from rallypoint.manager.recovery import QuorumResult
from rallypoint.process_groups.protocols import ReconfigurableProcessGroup
from rallypoint.transports.base import CheckpointTransportLike

T = TypeVar("T")
log = logging.getLogger("rallypoint.manager")


class Manager(GroupConnection, QuorumRounds, TorchftApi):
    """Fault-tolerant data-parallel training for one rank of one replica group.

    Arguments mirror torchft 0.2.0's; those left unset fall back to the environment
    (docs/environment.md). A ``*_TIMEOUT_SEC`` variable, when set, wins over its argument.

    Args:
        pg: the process group across replica groups: ours (``ProcessGroupGloo``, ``...NCCL``, ``...Baby*``),
            torchft's, or (torch >= 2.14) torch's own created with ``enable_reconfigure=True`` (``_reconfig.py``).
        load_state_dict: applies a healed state, what ``state_dict`` returned on a peer (key ``"default"``).
        state_dict: returns the state a healing peer receives (model, optimizer, ...).
        min_replica_size: fewest participating replica groups a step needs to commit.
        use_async_quorum: compute the quorum on a background thread while forward runs (True).
        timeout: collectives, heals and the commit vote (60 s; ``RALLYPOINT_TIMEOUT_SEC``).
        quorum_timeout: how long a quorum may take to form (60 s; ``RALLYPOINT_QUORUM_TIMEOUT_SEC``).
        connect_timeout: reaching the lighthouse, rank 0 and the store (60 s; ``RALLYPOINT_CONNECT_TIMEOUT_SEC``).
        rank: this rank's index in its replica group (``RANK``; 0).
        world_size: ranks per replica group (``WORLD_SIZE``; 1).
        world_size_mode: ``DYNAMIC`` (all live groups) or ``FIXED_WITH_SPARES`` (``min_replica_size`` contribute).
        store_addr: the group's store host (``MASTER_ADDR``; unset: group rank 0 hosts one).
        store_port: the group's store port (``MASTER_PORT``).
        lighthouse_addr: the lighthouse or an HA list ``a,b`` (``RALLYPOINT_LIGHTHOUSE``, ``TORCHFT_LIGHTHOUSE``).
        replica_id: this group's name; a unique suffix is added (``REPLICA_GROUP_ID``).
        port: group rank 0's ManagerServer port (``RALLYPOINT_MANAGER_PORT``; 0: the OS picks).
        hostname: the address peers reach this rank's servers at (the host's name).
        heartbeat_interval: between heartbeats to the lighthouse (100 ms).
        checkpoint_transport: how heals move state (``HTTPTransport`` on ``RALLYPOINT_HEAL_HOST``'s network).
        init_sync: at step 0, non-primary groups heal from the primary, so all start equal (True).
        max_retries: raise after this many consecutive failed steps (None: never).
        quorum_retries: retries of a failed quorum call before the step fails (0).
        heal_on_training_thread: True: serve and fetch heals on the training thread, never reading the
            state while forward runs (what FSDP2 needs). False: on the quorum thread, overlapped with
            forward, for state that may be read then. None (the default): decided at the first
            ``start_quorum`` from the registered state: True when it holds DTensors (``_heal_thread.py``).
        sdc_check: compare gradients across replicas before each commit (``RALLYPOINT_SDC_CHECK``).
        sdc_check_every: compare parameter hashes every N commits (``RALLYPOINT_SDC_CHECK_EVERY``; 0: off).
    """

    def __init__(
        self,
        pg: ReconfigurableProcessGroup | Any,
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
        checkpoint_transport: CheckpointTransportLike[dict[str, Any]] | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        heal_on_training_thread: bool | None = None,
        sdc_check: bool | None = None,
        sdc_check_every: int | None = None,
    ) -> None:
        pg, kind = _reconfig.adapt(pg)  # TypeError for a group that can be neither (re)configured
        self._pg = pg
        #: ``heal_mesh``: a mesh for received DTensors that the current state lacks (e.g. a
        #: fresh replica's optimizer state) when none of its own has the sender's shape.
        self._heal_thread = HealThread(heal_on_training_thread)
        self.heal_mesh: Any = None
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

        self._user_state = UserState(read_timeout_s=self._timeout.total_seconds())
        self.step_hooks: list[Any] = []  # at_boundary()/close() at each round's start / shutdown: rallypoint/checkpoint
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._step = 0  # committed rounds, as exchanged with peers (setup rounds included)
        self._setup_rounds = 0  # of those, rounds that were no training step (see _count_setup_round)
        self._batches_committed = 0
        self._commit_failures = 0
        self._closing = threading.Event()
        self._relay: PeerDownRelay | None = None
        self._lighthouse_addr: str | None = None
        self._participating_rank: int | None = None
        self._participating_world_size = 0
        self._quorum_future: cf.Future | None = None
        self._last_quorum: QuorumResult | None = None
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rallypoint-quorum")
        self._server: Any = None
        self._client: Any = None  # ManagerClient, or LocalManagerClient on group rank 0
        self._log: logging.LoggerAdapter = _ReplicaLog(log, {"replica_id": replica_id, "group_rank": self._group_rank})
        self._outage = Outage(self._log)  # the bounded backoff while no quorum call gets through
        now = time.monotonic()  # the current round (start_quorum .. should_commit), then the finished ones
        self._cur = _Round(StepRecord(round=0, step=0, since=now, started=now))
        self._rounds = RoundLog()  # the finished ones
        self._configurer = _reconfig.Configurer(pg, kind, self._group_rank, self._group_world_size, self._timeout,
                                                self._log)
        self._ff = FailFast(pg, self._log, str(replica_id), self._timeout, on_error=self._note_error)
        self._guard = SdcGuard.from_settings(sdc_check, sdc_check_every, self._log)  # or RALLYPOINT_SDC_CHECK*
        self._injector = Injector(str(replica_id), lambda: self._user_state.snapshot(dict)["user"], self._closing)

        self._own_transport = checkpoint_transport is None
        if checkpoint_transport is None:
            from rallypoint._net.heal_host import heal_address_from_env
            from rallypoint.transports.http import HTTPTransport

            heal = heal_address_from_env(os.environ, hostname)  # RALLYPOINT_HEAL_HOST: the heal network
            checkpoint_transport = HTTPTransport(timeout=self._timeout, bind=heal.bind_spec(),
                                                 advertise_host=heal.advertise)
        else:
            from rallypoint.manager._heal import warn_if_unguarded

            warn_if_unguarded(checkpoint_transport, self._log)
        self._transport: CheckpointTransportLike[dict[str, Any]] = checkpoint_transport
        self._healer = Healer(checkpoint_transport, self._group_rank, self._timeout, self._connect_timeout, self._log)

        try:
            self._connect(store_addr, store_port, lighthouse_addr, replica_id, port, hostname, heartbeat_interval,
                          quorum_retries)
        except BaseException:
            self.shutdown(wait=False)
            raise
        self._ff.replica_id = self._injector.replica = self._replica_id
        self._configurer.set_replica(self._replica_id, hostname)
        self._configurer.prepare()  # the handle store opens here, not in the first step
        if os.environ.get("RALLYPOINT_CHECKPOINT_DIR"):  # durable checkpoints with no code change
            from rallypoint.checkpoint.durable import attach_from_env
            attach_from_env(self)

    # ------------------------------------------------------------------ state dicts
    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]) -> None:
        """Add state under ``key`` to what heals send (``state_dict``) and apply (``load_state_dict``)."""
        self._user_state.register(key, load_state_dict, state_dict)
        self._heal_thread.registered()  # auto: look at the state again at the next start_quorum

    @property
    def heal_on_training_thread(self) -> bool:
        """Whether heals are served and fetched on the training thread (``_heal.py``): as
        asked for, or decided from the registered state (``_heal_thread.py``). Setting
        True/False (``rallypoint.integrations.fsdp`` sets True) wins; None decides again."""
        return self._heal_thread.on

    @heal_on_training_thread.setter
    def heal_on_training_thread(self, on: bool | None) -> None:
        self._heal_thread.set(on)

    def register_sdc_params(self, params: Any) -> None:
        """The parameters the corruption check compares across replicas every
        ``sdc_check_every`` steps (rallypoint's DistributedDataParallel registers its own)."""
        self._guard.register_params(params)

    def _manager_state_dict(self) -> dict[str, Any]:
        return self._user_state.snapshot(self.state_dict)

    def state_dict(self) -> dict[str, int]:
        """``step`` (what :meth:`current_step` says) and ``batches_committed``, as in
        torchft; ``setup_rounds`` only when a setup round was committed (a torchft
        Manager ignores the extra key)."""
        sd = {"step": self.current_step(), "batches_committed": self._batches_committed}
        if self._setup_rounds:
            sd["setup_rounds"] = self._setup_rounds
        return sd

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore the step counters of :meth:`state_dict` (from a checkpoint)."""
        setup = int(state_dict.get("setup_rounds", 0))
        self._step = int(state_dict["step"]) + setup
        self._setup_rounds = setup
        self._batches_committed = int(state_dict["batches_committed"])

    def _count_setup_round(self) -> None:
        """The round :meth:`should_commit` just committed set the replicas up rather
        than trained (DiLoCo's start round, which makes every replica begin from the
        primary's parameters). It stays a step on the wire, where peers compare steps
        to decide who heals, but :meth:`current_step` and :meth:`batches_committed`
        leave it out, so they count training steps as torchft does."""
        self._setup_rounds += 1
        self._batches_committed -= self._participating_world_size

    # ------------------------------------------------------------------ errors
    def report_error(self, e: Exception) -> None:
        """Mark this step failed (it will not commit); the next quorum recovers."""
        self._ff.report_error(e)

    def errored(self) -> Exception | None:
        """The error that failed this step, or None."""
        return self._ff.errored()

    def _note_error(self, e: Exception, cause: str | None) -> None:
        self._cur.rec.error, self._cur.rec.cause = f"{type(e).__name__}: {e}", cause or cause_of(e)

    # ------------------------------------------------------------------ quorum
    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None) -> None:
        """Begin this step's quorum (on a background thread unless ``use_async_quorum``
        is off); the process group is reconfigured if the membership changed."""
        if self._quorum_future is not None:
            self._wait_future()
        for hook in self.step_hooks:  # the last round committed and the optimizer stepped: a durable checkpoint
            hook.at_boundary()
        self._heal_thread.at_boundary(self._manager_state_dict, self._user_state.has_state(), self._log)
        now = time.monotonic()
        prev = self._cur.rec
        if prev.round and prev.ended is None:  # a round that never reached should_commit
            self._close_round(prev, now, "abandoned")
        last = self._rounds.last()
        stats = last.stats() if last is not None else None
        rnd = self._cur = _Round(StepRecord(round=prev.round + 1, step=self._step, since=self._rounds.since(now),
                                            started=now))
        self._ff.new_round(rnd.rec.round, self._step)
        self._guard.new_round()
        # A step boundary: injected faults (`rallypoint inject`) happen here.
        base = None if prev.compute_s is None else prev.compute_s - prev.extra.get("injected_sleep_s", 0.0)
        rnd.rec.extra.update(self._injector.at_step_start(self.current_step(), base))
        self._quorum_future = self._leased_round(rnd, allow_heal, shrink_only, stats) or self._executor.submit(
            self._async_quorum, rnd, allow_heal, shrink_only, timeout or self._quorum_timeout, stats
        )
        if not self._use_async_quorum:
            self.wait_quorum()

    def _wait_future(self) -> None:
        fut = self._quorum_future
        if fut is None:
            return
        limit = (self._quorum_timeout + 2 * self._timeout + self._connect_timeout).total_seconds()
        t0 = time.monotonic()
        try:
            fut.result(timeout=limit)
        except cf.TimeoutError:
            self.report_error(TimeoutError(f"quorum did not finish within {limit:.0f}s"))
        except Exception as e:  # noqa: BLE001 - _async_quorum records its own errors
            self.report_error(e)
        self._cur.rec.quorum_wait_s += time.monotonic() - t0

    def wait_quorum(self) -> None:
        """Wait for the quorum; serve or apply a heal (call it outside forward/backward).
        Raises ``TimeoutError`` when no quorum formed within ``quorum_timeout``."""
        if self._quorum_future is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        self._wait_future()
        self._heal_here()
        quorum_error = self._cur.quorum_error
        if quorum_error is not None:
            raise quorum_error

    def _heal_here(self) -> None:
        heal_here(self)  # see _heal_step.py

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: ReduceOp = ReduceOp.AVG) -> Any:  # type: ignore[assignment]  # stubs: RedOpType
        """Sum (``SUM``) or mean (``AVG``) over the participating replicas; returns a work
        with ``wait()``. A healing or spare replica contributes zeros. Never raises for a
        communication failure: it is recorded and the step will not commit.

        ``should_quantize``: exchange row-wise scaled int8 instead of the full tensor (about
        a quarter of the bytes for fp32; SUM/AVG only; see
        :mod:`rallypoint.process_groups.quantization` for the error it introduces). The
        argument order is torchft's; a ``ReduceOp`` passed second is taken as ``reduce_op``."""
        should_quantize, reduce_op = allreduce_args(should_quantize, reduce_op, False, f"replica {self._replica_id}")
        done = self._before_collective(tensor, should_quantize, reduce_op)
        if done is not None:
            return done
        divisor = max(1, self._participating_world_size) if reduce_op == ReduceOp.AVG else None
        managed = self._ff.add_work(lambda: ManagedWork.post(self._ff, self._pg, tensor, should_quantize, reduce_op,
                                                             divisor))
        return DoneWork(tensor) if managed is None else managed

    def allreduce_last(self, tensor: torch.Tensor) -> Any:
        """The mean of the step's last gradient bucket over the participating replicas,
        with the corruption checks' rows riding in the same collective (:mod:`._ride`: the
        step makes no collective of its own for them). rallypoint's DDP calls it for that
        bucket. Returns the work (its ``averaged()`` is ``tensor`` itself, holding the
        mean once the sum has been divided into it), or None when the rows cannot ride
        (checks off, or a bucket that cannot carry them): the caller then posts
        ``allreduce(tensor)`` as for any other bucket. Every replica group must use the
        same wrapper (its collectives must match)."""
        if not self._guard.can_ride(tensor):
            return None
        done = self._before_collective(tensor, False, ReduceOp.AVG, observe=False)
        if done is not None:
            return done
        if not self._checks_exchange(self._cur):
            self._guard.observe(tensor, self.is_participating())
            managed = self._ff.add_work(lambda: ManagedWork.post(self._ff, self._pg, tensor, False, ReduceOp.AVG,
                                                                 max(1, self._participating_world_size)))
            return DoneWork(tensor) if managed is None else managed
        assert self._last_quorum is not None  # _checks_exchange
        work = self._guard.post_riding(self._pg, self._last_quorum, not self._cur.rec.healing, tensor,
                                       self.is_participating(), max(1, self._participating_world_size),
                                       self._replica_id, self._ff)
        return DoneWork(tensor) if work is None else work

    def _before_collective(self, tensor: torch.Tensor, should_quantize: bool, reduce_op: Any,
                           observe: bool = True) -> Any:
        """What every gradient collective does before it is posted: wait for the quorum,
        refuse once the step failed (a done work: the tensor untouched), put in the op's
        identity when this replica does not contribute, the fault injector's turn, the
        corruption checks' norm (unless ``observe`` is False: the caller takes it), the
        round's record. None: go on and post it."""
        if self.errored() is None:
            self._wait_future()
        if self.errored() is not None:
            self._cur.skipped = True  # this round's collectives are out of step with its peers'
            return DoneWork(tensor)
        zeros = not self.is_participating() or self._participating_world_size < self._quorum_size()
        allreduce_args(should_quantize, reduce_op, zeros, f"replica {self._replica_id}")
        contributes = self.is_participating()
        if not contributes:
            neutral_fill(reduce_op, tensor)  # zeros for SUM/AVG; -inf for MAX, ...
        if self._injector.on_collective(tensor, contributes) == "drop":
            self._ff.abort(RuntimeError("injected fault: drop-collective"), "injected")
            return DoneWork(tensor)
        if observe:
            self._guard.observe(tensor, contributes)  # before the collective changes it in place
        rec = self._cur.rec
        if rec.first_collective is None:
            rec.first_collective = time.monotonic()
        rec.collectives += 1
        return None

    def gradients_posted(self) -> None:
        """The step's gradient allreduces are all posted (rallypoint's DDP calls this after
        its last bucket's). With the corruption checks on, their exchange is posted now,
        right behind the gradients, and ``should_commit`` only reads its result instead of
        paying a round trip of its own. Every replica group must use the same wrapper (the
        exchange's place among the collectives must match)."""
        if self._guard.enabled and self._checks_exchange(self._cur):
            assert self._last_quorum is not None
            self._guard.post_early(self._pg, self._last_quorum, not self._cur.rec.healing, self._replica_id, self._ff)

    def _checks_exchange(self, rnd: _Round) -> bool:
        """Whether this round's corruption checks exchange rows: not after skipping its
        collectives (the peers are still in those) nor once the process group failed."""
        return rnd.rec.quorum_id is not None and self._last_quorum is not None and not rnd.skipped \
            and self._pg.errored() is None

    def _quorum_size(self) -> int:
        q = self._last_quorum
        return q.replica_world_size if q is not None else 0

    # ------------------------------------------------------------------ commit
    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """The step's barrier: True when every rank of the group may apply the step."""
        assert self._client is not None
        if self._quorum_future is None:
            raise RuntimeError("should_commit() called before start_quorum()")
        self._wait_future()
        rnd = self._cur
        if self._guard.enabled and self._checks_exchange(rnd):
            # Before a training-thread heal, so no peer waits in the exchange for it.
            assert self._last_quorum is not None
            rnd.rec.extra.update(self._guard.check_round(self._pg, self._last_quorum, not rnd.rec.healing,
                                                         self._timeout, self._replica_id, self._ff))
        else:
            self._guard.drop_early()
        self._heal_here()
        rnd.rec.commit_started = time.monotonic()
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
        self._log.info("should_commit step %d: %s (local %s, participants %d/%d, error %s)", self._step, decision,
                       local, self._participating_world_size, self._min_replica_size, self.errored())
        self._healer.after_vote(rnd.served_here)  # the optimizer may step now: guard what we serve
        if rnd.quorum_error is not None:
            self._commit_failures += 1
            self._close_round(rnd.rec, time.monotonic(), "failed")
            raise rnd.quorum_error
        if decision:
            self._step += 1
            self._batches_committed += self._participating_world_size
            self._commit_failures = 0
            _progress.committed(self.current_step())  # tells a supervising `rallypoint run`
        else:
            self._commit_failures += 1
            if rnd.rec.error is None:
                rnd.rec.error, rnd.rec.cause = ("the group's commit vote failed (another rank of this group voted "
                                                "false)", "vote") if local else (
                    f"too few participants ({self._participating_world_size} < {self._min_replica_size})", "participants")
        self._close_round(rnd.rec, time.monotonic(), "committed" if decision else "failed")
        if not decision and self._max_retries is not None and self._commit_failures > self._max_retries:
            raise RuntimeError(
                f"[{self._replica_id}] {self._commit_failures} consecutive failed steps "
                f"(max_retries={self._max_retries}); last error: {self.errored()}"
            )
        return decision

    def _close_round(self, rec: StepRecord, now: float, outcome: str) -> None:
        self._rounds.close(rec, now, outcome, self._ff.works())

    def step_record(self) -> StepRecord | None:
        """The record of the last finished round (None before the first): its quorum,
        participants, time split and outcome (see :mod:`rallypoint.manager._record`)."""
        return self._rounds.last()

    def step_records(self) -> list[StepRecord]:
        """The records of the last rounds (at most 256), oldest first."""
        return self._rounds.all()

    # ------------------------------------------------------------------ queries
    def current_step(self) -> int:
        """Committed training steps (a setup round is not one; see _count_setup_round)."""
        return self._step - self._setup_rounds

    def batches_committed(self) -> int:
        """Batches committed so far, summed over the participants of each committed step."""
        return self._batches_committed

    def num_participants(self) -> int:
        """Replica groups taking part in this step (waits for the quorum; 0 before the first)."""
        if self._quorum_future is None:
            return 0
        self._wait_future()
        return self._participating_world_size

    def participating_rank(self) -> int | None:
        """This group's rank among the participants of this step (None: it does not contribute)."""
        if self._quorum_future is None:
            return None
        self._wait_future()
        return self._participating_rank

    def is_participating(self) -> bool:
        """Whether this group contributes to this step (not healing, not a spare, not sitting out)."""
        return self._participating_rank is not None and not self._cur.apply_due \
            and not self._guard.sitting_out(self._replica_id)

    @property
    def replica_id(self) -> str:
        """This replica group's id as the lighthouse knows it (``REPLICA_GROUP_ID`` plus a suffix)."""
        return self._replica_id

    @property
    def group_rank(self) -> int:
        """This rank's index inside its replica group (torchrun's ``RANK``)."""
        return self._group_rank

    @property
    def group_world_size(self) -> int:
        """The number of ranks in each replica group (torchrun's ``WORLD_SIZE``)."""
        return self._group_world_size

    def shutdown(self, wait: bool = True) -> None:
        """Stop the quorum thread, the transport, the client and (rank 0) the server."""
        _progress.finished(self.current_step())  # a supervising `rallypoint run` stops timing this rank
        self._closing.set()
        for hook in getattr(self, "step_hooks", ()):
            hook.close()
        self._executor.shutdown(wait=wait, cancel_futures=True)
        if self._relay is not None:
            self._relay.close()
        if self._own_transport and getattr(self, "_transport", None) is not None:
            self._transport.shutdown(wait=wait)
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.shutdown()
        self._log.info("manager shut down")


__all__ = ["Manager", "WorldSizeMode"]
