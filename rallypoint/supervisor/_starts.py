"""Where ``rallypoint run``'s ranks and standbys come from: a ready standby, a fork of the
group's zygote, or a new process (``policy.rank_source``); a thin shell over the pool
(``_standby.py``) and the zygote's client (``_forks.py``), called from the supervisor's
main thread only (every child is forked there, see ``_procs.py``).

The zygote (``_zygote.py``) is started with the group when standbys are on (Linux): it
imports torch, rallypoint and ``--preload`` once, at normal priority, then every rank of
the first start is forked from it (one import for the group instead of one per rank), and
standbys are forked from it at once, ready (no import, no CPU taken from the group), so a
failure seconds after a start or a restart still finds them. The supervisor becomes a
child subreaper to adopt the forks. When the zygote cannot get ready (a ``--preload`` that
raises, another thread after the imports, not ready within ``ZYGOTE_READY_S``), cannot fork
or dies, it is given up for good, said once in the log, and ranks and standbys start
cold, as without it.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import IO

from rallypoint.supervisor._forks import Zygote, reap_orphans, set_subreaper
from rallypoint.supervisor._procs import Lifeline, RankProcess, Wakeup
from rallypoint.supervisor._standby import StandbyPool
from rallypoint.supervisor.args import RunConfig
from rallypoint.supervisor.envs import READY_ENV, log_prefix
from rallypoint.supervisor.policy import (
    ZYGOTE_FAILED, ZYGOTE_OFF, ZYGOTE_READY, ZYGOTE_STARTING, describe_exit, rank_source, zygote_wanted,
)  # fmt: skip

log = logging.getLogger("rallypoint.run")

ZYGOTE_READY_S = 300.0  # the longest a start waits for the zygote's imports before starting cold


class Starts:
    """The group's standby pool and zygote. ``standby_env(rank)``: a standby's environment
    as far as it is known before its go (the next incarnation's, without its progress file)."""

    def __init__(self, cfg: RunConfig, standby_env: Callable[[int], dict[str, str]], wake: Wakeup,
                 lifeline: Lifeline, outputs: tuple[IO[bytes], IO[bytes]],
                 locks: tuple[threading.Lock, threading.Lock], rundir: str, name: str) -> None:
        self.cfg, self._standby_env, self._wake, self._lifeline = cfg, standby_env, wake, lifeline
        self._outputs, self._locks, self._name = outputs, locks, name
        self.pool = StandbyPool(cfg.nproc, self.standby, rundir, name) if cfg.standby else None
        self.zygote: Zygote | None = None

    # ------------------------------------------------------------------ state
    def zygote_state(self) -> str:
        return ZYGOTE_OFF if self.zygote is None else self.zygote.state

    def source(self, rank: int) -> str:
        """``policy.rank_source`` for ``rank`` now."""
        standby = "none" if self.pool is None else self.pool.state(rank)
        return rank_source(standby, self.zygote_state())

    def pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None else []

    # ------------------------------------------------------------------ processes
    def _argv(self, module: str, head: list[str]) -> list[str]:
        cfg = self.cfg
        return [sys.executable, "-m", module, *head, *(["-m"] if cfg.module else []), cfg.target, *cfg.script_args]

    def _preload(self) -> list[str]:
        return ["--preload", ",".join(self.cfg.preload)] if self.cfg.preload else []

    def start_zygote(self, env: dict[str, str]) -> None:
        """With standbys on (Linux, the subreaper set), start the group's zygote with ``env``."""
        linux = sys.platform.startswith("linux")
        if not zygote_wanted(self.cfg.standby, self.cfg.standby and linux and set_subreaper(), linux):
            return
        try:
            self.zygote = Zygote(self._argv("rallypoint.supervisor._zygote", self._preload()), env, self._lifeline,
                                 log_prefix(self.cfg.group_id, "zygote"), self._wake, self._outputs, self._locks)
        except OSError as e:
            log.warning("%s: cannot start the zygote (%s); ranks and standbys start cold", self._name, e)

    def rank(self, rank: int, incarnation: int, env: dict[str, str], prefix: str) -> RankProcess:
        """``rank`` of ``incarnation`` with ``env``: from its standby, the zygote or a new
        process, as ``policy.rank_source`` says."""
        source = self.source(rank)
        proc = self.pool.take(rank) if source == "standby" and self.pool is not None else \
            self._forked(rank, None, prefix) if source == "zygote" else None
        if proc is not None and proc.activate(env, incarnation, prefix):
            return proc
        return RankProcess(self._argv("rallypoint.supervisor._rank", []), env, rank, incarnation, prefix, self._wake,
                           self._lifeline, self._outputs, self._locks)

    def standby(self, rank: int, ready_path: str) -> RankProcess:
        """A standby for ``rank`` (the pool's callback): forked from the ready zygote, else a
        new process."""
        env = self._standby_env(rank)
        prefix = log_prefix(self.cfg.group_id, f"r{env['RANK']} standby")
        forked = self._forked(rank, ready_path, prefix) if self.zygote_state() == ZYGOTE_READY else None
        if forked is not None:
            return forked
        env[READY_ENV] = ready_path
        return RankProcess(self._argv("rallypoint.supervisor._rank", ["--standby", *self._preload()]), env, rank,
                           None, prefix, self._wake, self._lifeline, self._outputs, self._locks)

    def _forked(self, rank: int, ready_path: str | None, prefix: str) -> RankProcess | None:
        """A child of the zygote waiting for its go (None, and the zygote given up, when it cannot)."""
        assert self.zygote is not None
        try:
            child = self.zygote.fork(ready_path)
        except OSError as e:
            self.zygote_failed(f"could not fork ({e})")
            return None
        return RankProcess([], {}, rank, None, prefix, self._wake, self._lifeline, self._outputs, self._locks,
                           forked=child)

    # ------------------------------------------------------------------ the zygote's events
    def on_zygote(self, kind: str, arg: object) -> None:
        """``("zygote", kind, arg)`` from the wakeup queue."""
        z = self.zygote
        if z is None:
            return
        if kind == "ready" and z.state == ZYGOTE_STARTING:
            z.state = ZYGOTE_READY
            log.info("%s: the zygote (pid %d) is ready (imports took %ss): ranks and standbys are forked from it",
                     self._name, z.pid, arg)
        elif kind == "failed":
            self.zygote_failed(f"could not get ready: {arg}")
        elif kind == "exit":
            self.zygote_failed(f"exited ({describe_exit(int(arg))})")  # type: ignore[call-overload]

    def zygote_failed(self, why: str) -> None:
        """Fall back to cold ranks and standbys for good, saying so once."""
        z = self.zygote
        if z is None or z.state == ZYGOTE_FAILED:
            return
        log.warning("%s: the zygote (pid %d) %s; ranks and standbys start cold from now on", self._name, z.pid, why)
        z.close(1.0)

    def reap(self) -> None:
        """Reap the orphans adopted as a subreaper (only with a zygote)."""
        if self.zygote is not None:
            reap_orphans()

    def close(self) -> None:
        """Stop every standby and the zygote."""
        if self.pool is not None:
            self.pool.close()
        if self.zygote is not None:
            self.zygote.close()
            reap_orphans()


__all__ = ["ZYGOTE_READY_S", "Starts"]
