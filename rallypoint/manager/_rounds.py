"""The Manager's quorum round, from the call to the plan: a mixin of
:class:`~rallypoint.manager.manager.Manager`, which provides the attributes named in
:class:`QuorumRounds`'s annotations.

A round is asked for on the quorum thread (``_async_quorum``: the lighthouse, through the
group's ManagerServer), except a round the group's lease serves while the server is in
this process and the group has one rank: that one is answered on the training thread
(``_leased_round``), so a step on a lease costs no thread hand-off. Either way
``_took_quorum`` acts on the answer: who participates, whether the process group is
(re)configured, and what is healed or served.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from datetime import timedelta
from typing import Any

from rallypoint._net.inject import parse_injections
from rallypoint.manager._config import WorldSizeMode
from rallypoint.manager._failfast import FailFast
from rallypoint.manager._heal import Healer
from rallypoint.manager._inject import Injector
from rallypoint.manager._outage import Outage, quorum_failure
from rallypoint.manager._reconfig import Configurer
from rallypoint.manager._record import Round as _Round
from rallypoint.manager.recovery import QuorumResult
from rallypoint.transports.base import CheckpointTransportLike


class QuorumRounds:
    """Asking for a round's quorum and acting on it (see the module's docstring)."""

    _client: Any
    _group_rank: int
    _step: int
    _commit_failures: int
    _init_sync: bool
    _use_async_quorum: bool
    _world_size_mode: WorldSizeMode
    _min_replica_size: int
    _replica_id: str
    _lighthouse_addr: str | None
    _participating_rank: int | None
    _participating_world_size: int
    _last_quorum: QuorumResult | None
    _closing: threading.Event
    _log: logging.LoggerAdapter
    _outage: Outage
    _healer: Healer
    _ff: FailFast
    _injector: Injector
    _configurer: Configurer
    _transport: CheckpointTransportLike[dict[str, Any]]

    def report_error(self, e: Exception) -> None: ...

    def _manager_state_dict(self) -> dict[str, Any]:  # pragma: no cover - the Manager's
        raise NotImplementedError

    @property
    def heal_on_training_thread(self) -> bool:  # pragma: no cover - the Manager's
        raise NotImplementedError

    def _async_quorum(self, rnd: _Round, allow_heal: bool, shrink_only: bool, timeout: timedelta,
                      stats: dict[str, Any] | None) -> None:
        try:
            self._quorum_round(rnd, allow_heal, shrink_only, timeout, stats)
        finally:
            self._ff.setup_done()

    def _leased_round(self, rnd: _Round, allow_heal: bool, shrink_only: bool,
                      stats: dict[str, Any] | None) -> cf.Future | None:
        """This round answered from the group's lease on the training thread, with no
        hand-off to the quorum thread (a one-rank group whose server is in this process:
        ``ManagerServer.leased_local_quorum``); a finished future, or None when the round
        must take the quorum thread (no lease, a failed last step, a backoff, ...)."""
        leased = getattr(self._client, "leased_quorum", None)
        if leased is None or self._outage.pause or self._healer.backoff_s():
            return None
        try:
            q = leased(self._group_rank, self._step, self._transport.metadata(), shrink_only,
                       commit_failures=self._commit_failures, init_sync=self._init_sync, step_stats=stats,
                       **self._configurer.quorum_kwargs(leased))
        except Exception as e:  # noqa: BLE001 - e.g. not a member of its own lease: the lighthouse's path says why
            self._log.warning("leased quorum refused (%s); asking the lighthouse", e)
            return None
        if q is None:
            return None
        fut: cf.Future = cf.Future()
        try:
            self._took_quorum(rnd, q, allow_heal)
        except Exception as e:  # noqa: BLE001 - as on the quorum thread: reported by _wait_future
            fut.set_exception(e)
        else:
            fut.set_result(None)
        finally:
            self._ff.setup_done()
        return fut

    def _quorum_round(self, rnd: _Round, allow_heal: bool, shrink_only: bool, timeout: timedelta,
                      stats: dict[str, Any] | None) -> None:
        assert self._client is not None
        if self._outage.pause or self._healer.backoff_s():  # bounded backoffs (no lighthouse; failed heals)
            self._closing.wait(max(self._outage.pause, self._healer.backoff_s()))  # shutdown ends it
        try:
            q = self._client._quorum(
                group_rank=self._group_rank,
                step=self._step,
                checkpoint_metadata=self._transport.metadata(),
                shrink_only=shrink_only,
                timeout=timeout,
                commit_failures=self._commit_failures,
                init_sync=self._init_sync,
                step_stats=stats,
                **self._configurer.quorum_kwargs(self._client._quorum),  # the group's reconfigure handle
            )
        except Exception as e:  # noqa: BLE001
            if isinstance(e, ConnectionError):
                self._outage.failed(e)
            else:
                self._log.warning("quorum failed: %s", e)
            self._participating_rank, self._participating_world_size = None, 0
            rnd.quorum_error = quorum_failure(e, f"replica {self._replica_id} (group rank {self._group_rank})",
                                              self._step, timeout, self._lighthouse_addr or "via group rank 0")
            self.report_error(e)
            return
        self._took_quorum(rnd, q, allow_heal)

    def _state_to_land_in(self) -> Any:
        """Our state, for a quorum-thread heal to land in later (only its layout is read
        here); None, receiving fresh memory as before, when the state cannot be read now or
        holds DTensors (heals of DTensor state belong on the training thread: only a
        caller's explicit ``heal_on_training_thread=False`` brings them here)."""
        from rallypoint.manager._heal_thread import holds_dtensor

        try:
            state = self._manager_state_dict()
        except Exception as e:  # noqa: BLE001 - a state_dict callback that fails off the training thread
            self._log.info("heal: receiving into fresh memory, the state could not be read here: %s", e)
            return None
        return None if holds_dtensor(state) else state

    def _took_quorum(self, rnd: _Round, q: Any, allow_heal: bool) -> None:
        """Act on this round's quorum ``q``: participation, (re)configure, heal plans."""
        rec = rnd.rec
        self._outage.passed()
        self._last_quorum = q
        self._ff.quorum_arrived(q.replica_ids)
        if q.inject:
            try:
                self._injector.add(parse_injections(q.inject))
            except ValueError as e:
                self._log.warning("ignored malformed injections: %s", e)
        if self._use_async_quorum or not allow_heal:
            prank, pws = q.max_replica_rank, q.max_world_size
        else:
            prank, pws = q.replica_rank, q.replica_world_size
        if self._world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
            pws = min(pws, self._min_replica_size)
            if prank is not None and prank >= self._min_replica_size:
                prank = None
        self._participating_rank, self._participating_world_size = prank, pws
        rec.quorum_arrived = time.monotonic()
        rec.quorum_id, rec.replica_rank, rec.replica_world_size = q.quorum_id, q.replica_rank, q.replica_world_size
        rec.participants, rec.max_step = tuple(q.replica_ids), q.max_step
        rec.participating_rank, rec.participating_world_size = prank, pws

        if q.quorum_id != self._ff.quorum_id:  # configure or reconfigure: see _reconfig.py
            rec.reconfigured = True
            t0 = time.monotonic()
            try:
                self._ff.quorum_id = q.quorum_id
                self._configurer.apply(q)
            except Exception as e:  # noqa: BLE001
                self._log.warning("process group configure failed: %s", e)
                self.report_error(e)
                return
            finally:
                rec.configure_s = time.monotonic() - t0

        serves = self._healer.serves(q)
        if not allow_heal or not (q.heal or serves):
            return
        rec.served_to = tuple(serves)
        if q.heal:
            rnd.apply_due = rec.healing = True  # contributes zeros until the state is applied
            rec.heal_source = q.recover_src_replica_rank
        if self.heal_on_training_thread:
            rnd.heal_plan = q  # served / fetched by _heal_here on the training thread
            return
        try:
            if serves:
                # Served now, so the healing peer finds it as soon as it asks (guarded
                # by the transport: see _heal.py); frozen or withdrawn in should_commit.
                # User state_dict callbacks therefore run on this thread
                # (heal_on_training_thread moves them).
                self._healer.serve(q, self._manager_state_dict())
            if q.heal:
                # Into pooled buffers, verified here; swapped into the state's own tensors
                # by the training thread when it applies them (_heal_step): no second pass
                # over the bytes and no fresh pages for a replica that heals again.
                into = self._state_to_land_in() if self._healer.lands_later() else None
                rnd.pending = self._healer.fetch(q, into=into, defer=into is not None)
        except Exception as e:  # noqa: BLE001
            self._log.warning("recovery failed: %s", e)
            self.report_error(e)


__all__ = ["QuorumRounds"]
