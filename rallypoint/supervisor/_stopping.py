"""How ``rallypoint run``'s supervisor stops its ranks: the stack dumps of a hung group
(SIGUSR1, then a bounded wait for each rank's dump), the stop (SIGTERM, the grace period,
SIGKILL to each rank's process group) and the last-resort kill on the way out. A mixin of
:class:`~rallypoint.supervisor.supervisor.Supervisor`, so that module keeps the restart
loop; these methods use only the attributes declared below.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from rallypoint.supervisor._procs import RankProcess, Wakeup
from rallypoint.supervisor.args import RunConfig

log = logging.getLogger("rallypoint.run")

KILL_WAIT_S = 10.0  # after SIGKILL, for the kernel to reap
DUMP_WAIT_S = 1.0  # the longest wait for the stack dumps of a hung group
DUMP_QUIET_S = 0.2  # a rank's dump is complete once its stderr has been quiet this long


class RankStopping:
    """The supervisor's stack dumps, stop and last-resort kill of its ranks."""

    cfg: RunConfig
    _name: str
    _ranks: list[RankProcess]
    _wake: Wakeup
    _stop_signal: int

    def _other_event(self, ev: tuple[Any, ...]) -> None:  # pragma: no cover - the Supervisor's
        raise NotImplementedError

    def _finish_ranks(self) -> None:  # pragma: no cover - the Supervisor's
        raise NotImplementedError

    def _dump_stacks(self) -> None:
        """SIGUSR1 to every live rank (each dumps its Python stacks to its log, see
        ``_rank.py``), then wait until each one that is not stopped has printed something
        and been quiet for ``DUMP_QUIET_S``, at most ``DUMP_WAIT_S`` in all. A stop signal
        meanwhile is kept for ``_stop_ranks``."""
        pending = []
        for r in self._ranks:
            if r.popen.returncode is None:
                before = r.stderr_activity()[0]
                r.signal(signal.SIGUSR1)
                if not r.stopped():
                    pending.append((r, before))
        deadline = time.monotonic() + DUMP_WAIT_S
        while True:
            now = time.monotonic()
            pending = [(r, before) for r, before in pending if r.popen.returncode is None and not (
                r.stderr_activity()[0] > before and now - r.stderr_activity()[1] >= DUMP_QUIET_S)]
            if not pending or now >= deadline:
                return
            for ev in self._wake.wait(min(deadline - now, DUMP_QUIET_S / 4)):
                self._other_event(ev)
                if ev[0] == "signal":
                    self._stop_signal = self._stop_signal or ev[1]

    def _stop_ranks(self) -> None:
        """SIGTERM (and SIGCONT) to every live rank, SIGKILL (to its process group) after the
        grace period; a second stop signal meanwhile skips the rest of the grace period."""
        def alive() -> list[RankProcess]:
            return [r for r in self._ranks if r.popen.returncode is None]

        for r in alive():
            r.signal(signal.SIGTERM)
            r.signal(signal.SIGCONT)  # a stopped rank acts on the SIGTERM now, not after the grace period
        deadline, killed = time.monotonic() + self.cfg.grace_s, False
        while alive():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if killed:
                    log.error("%s: rank(s) %s still running %gs after SIGKILL", self._name,
                              [r.rank for r in alive()], KILL_WAIT_S)
                    break
                log.warning("%s: rank(s) %s still running after the %gs grace period: SIGKILL", self._name,
                            [r.rank for r in alive()], self.cfg.grace_s)
                for r in alive():
                    r.signal(signal.SIGKILL, group=True)
                deadline, killed = time.monotonic() + KILL_WAIT_S, True
                continue
            for ev in self._wake.wait(remaining):
                self._other_event(ev)
                if ev[0] == "signal":
                    if self._stop_signal:
                        deadline = 0.0  # asked twice: no more grace
                    self._stop_signal = self._stop_signal or ev[1]
        self._finish_ranks()

    def _kill_all(self) -> None:
        """Last resort on the way out (normally every rank has exited already)."""
        for r in self._ranks:
            if r.popen.returncode is None:
                r.signal(signal.SIGKILL, group=True)
        for r in self._ranks:
            try:
                r.popen.wait(KILL_WAIT_S)
            except Exception:  # noqa: BLE001
                pass


__all__ = ["DUMP_QUIET_S", "DUMP_WAIT_S", "KILL_WAIT_S", "RankStopping"]
