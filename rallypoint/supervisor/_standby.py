"""Warm standbys for ``rallypoint run``: at most one waiting process per rank, started
ahead of a failure with torch, rallypoint and the ``--preload`` modules imported (see
``_rank.py``), handed to the next incarnation instead of a cold process.

A thin shell over ``policy.standby_refill_delay``: the supervisor decides *when* to fill
the pool (``policy.standby_start_due``) and calls :meth:`StandbyPool.fill` from its main
thread (every child is forked there, see ``_procs.py``); the pool keeps the slots, notices
deaths, and stops making standbys when they keep dying before they are ready (a
``--preload`` module that raises, a host out of memory), saying so once: the ranks then
start cold, as without standbys.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

from rallypoint.supervisor._procs import RankProcess
from rallypoint.supervisor.policy import STANDBY_DEATHS_MAX, describe_exit, standby_refill_delay

log = logging.getLogger("rallypoint.run")

KILL_WAIT_S = 5.0


class StandbyPool:
    """One slot per rank. ``start(rank, ready_path)`` makes a standby process for ``rank``
    that creates ``ready_path`` once its imports are done."""

    def __init__(self, nproc: int, start: Callable[[int, str], RankProcess], rundir: str, name: str) -> None:
        self._slots: list[RankProcess | None] = [None] * nproc
        self._start, self._rundir, self._name = start, rundir, name
        self._ready_paths: dict[int, str] = {}  # pid -> its ready file
        self._serial = 0
        self.deaths = 0  # in a row, none ready in between
        self.disabled = False
        self._retry_at = 0.0  # monotonic: no new standby before this (after a death)
        self._retired: list[RankProcess] = []  # discarded ones, reaped at close

    # ------------------------------------------------------------------ state
    def missing(self) -> list[int]:
        """Ranks without a standby (none when standbys are off for good)."""
        return [] if self.disabled else [r for r, p in enumerate(self._slots) if p is None]

    def ready(self, rank: int) -> bool:
        """Has ``rank``'s standby finished its imports?"""
        p = self._slots[rank]
        return p is not None and os.path.exists(self._ready_paths.get(p.pid, ""))

    def state(self, rank: int) -> str:
        """``rank``'s standby: ``ready``, ``importing`` or ``none``."""
        if self._slots[rank] is None:
            return "none"
        return "ready" if self.ready(rank) else "importing"

    def pids(self) -> list[int]:
        return [p.pid for p in self._slots if p is not None]

    def due(self, now: float) -> float:
        """Seconds until a refill may start (0: now)."""
        return max(0.0, self._retry_at - now)

    # ------------------------------------------------------------------ actions
    def fill(self, now: float) -> list[int]:
        """Start a standby for every empty slot (unless a death's delay is still running);
        the ranks started for. An ``OSError`` (no memory, no pids) counts as a death."""
        if self.disabled or now < self._retry_at:
            return []
        started = []
        for rank in self.missing():
            self._serial += 1
            path = os.path.join(self._rundir, f"standby.{self._serial}.r{rank}.ready")  # its pid inside (_rank.py)
            try:
                proc = self._start(rank, path)
            except OSError as e:
                log.warning("%s: cannot start a standby for rank %d: %s", self._name, rank, e)
                self._count_death(now)
                break
            self._slots[rank] = proc
            self._ready_paths[proc.pid] = path
            started.append(rank)
        return started

    def take(self, rank: int) -> RankProcess | None:
        """The standby for ``rank``, removed from the pool (None if there is none)."""
        proc, self._slots[rank] = self._slots[rank], None
        if proc is not None and os.path.exists(self._ready_paths.get(proc.pid, "")):
            self.deaths = 0  # this one made it: a later death starts a new count
        return proc

    def died(self, proc: RankProcess, returncode: int, now: float) -> None:
        """A standby exited before its go (``("standby_exit", proc, rc)``)."""
        if proc in self._retired:
            return  # discarded by us
        for rank, p in enumerate(self._slots):
            if p is proc:
                self._slots[rank] = None
        ready = os.path.exists(self._ready_paths.pop(proc.pid, ""))
        proc.finish(1.0)  # its last lines (a preload traceback) first
        if ready:
            self.deaths = 0
        what = "after it was ready" if ready else "while it was still importing"
        log.warning("%s: the standby for rank %d (pid %d) exited (%s) %s", self._name, proc.rank, proc.pid,
                    describe_exit(returncode), what)
        if not ready:
            self._count_death(now)
        else:
            self._retry_at = now + (standby_refill_delay(0) or 0.0)

    def _count_death(self, now: float) -> None:
        self.deaths += 1
        delay = standby_refill_delay(self.deaths)
        if delay is None:
            self.disabled = True
            for rank, p in enumerate(self._slots):  # the rest would fail alike
                if p is not None:
                    self._slots[rank] = None
                    self._retired.append(p)
                    p.discard()
            log.error("%s: %d standbys in a row died before they were ready; no more standbys, ranks restart cold "
                      "(see the standby's output above: a --preload module that fails to import?)",
                      self._name, STANDBY_DEATHS_MAX)
            return
        self._retry_at = now + delay

    def close(self) -> None:
        """Stop every standby (they are idle or importing: no grace needed) and reap them."""
        procs = [p for p in self._slots if p is not None] + self._retired
        self._slots = [None] * len(self._slots)
        self._retired = procs
        for p in procs:
            p.discard()
        deadline = time.monotonic() + KILL_WAIT_S
        for p in procs:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - best effort on the way out
                p.signal(signal.SIGKILL, group=True)
            p.drain(0.5)


__all__ = ["StandbyPool"]
