"""The hang watchdog's view of one incarnation (see ``supervisor.py``'s docstring): each
rank's progress file, looked at from the main loop, and when it last changed. The rules
are ``policy``'s pure functions; this is the shell that reads the files."""

from __future__ import annotations

import os
import time

from rallypoint.supervisor.policy import hung_ranks, parse_progress, poll_period, progress_change_time, watch_wait


class ProgressWatch:
    """The hang watchdog's view of one incarnation: each rank's progress file, looked at
    from the main loop (``check``) at most every poll period, and when it changed. The
    rules are ``policy``'s."""

    def __init__(self, paths: list[str], timeout_s: float, now: float) -> None:
        self._paths, self.timeout_s = paths, timeout_s
        self._period = poll_period(timeout_s) or 0.0
        self._seen: list[tuple[int, int, bytes] | None] = [None] * len(paths)
        self.last_change: list[float | None] = [None] * len(paths)
        self.steps: list[int | None] = [None] * len(paths)
        self._polled = self._next = now

    def wait(self, now: float) -> float:
        """How long the main loop may sleep before the next ``check``."""
        w = watch_wait(now, self.last_change, self.timeout_s)
        return max(0.0, min(self._next - now, self.timeout_s if w is None else w))

    def forget(self, rank: int) -> None:
        """A rank that exited is no longer timed."""
        self.last_change[rank] = None

    def check(self, now: float, exited: list[bool]) -> list[int]:
        """Look at the files if a poll or a deadline is due; the hung ranks, longest silent first."""
        if now >= self._next or hung_ranks(now, self.last_change, self.timeout_s):
            self._poll(now, exited)
        return hung_ranks(now, self.last_change, self.timeout_s)

    def _poll(self, now: float, exited: list[bool]) -> None:
        wall = time.time()
        for rank, path in enumerate(self._paths):
            if exited[rank]:
                continue
            try:
                with open(path, "rb") as f:
                    st, content = os.fstat(f.fileno()), f.read(64)
            except OSError:
                continue  # no report yet
            sig = (st.st_ino, st.st_mtime_ns, content)
            if sig != self._seen[rank]:
                self._seen[rank] = sig
                self.steps[rank], finished = parse_progress(content)
                self.last_change[rank] = None if finished else progress_change_time(
                    now, self._polled, wall - st.st_mtime_ns / 1e9)
        self._polled, self._next = now, now + self._period


__all__ = ["ProgressWatch"]
