"""One log line per interval for things that can come in floods (refused calls, dropped
reports, failed sends): the lines left out are counted, and the next line says how many,
so a flood can neither fill the log nor go unseen."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class Throttle:
    """``ready()`` says whether a line may be logged now: ``None`` (leave it out; it is
    counted), else how many were left out since the last logged line."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -math.inf
        self._left_out = 0

    def ready(self, now: float | None = None) -> int | None:
        now = self._clock() if now is None else now
        if now - self._last < self.interval_s:
            self._left_out += 1
            return None
        left_out, self._last, self._left_out = self._left_out, now, 0
        return left_out


def left_out_note(n: int, what: str = "similar line(s)") -> str:
    """`` (and N <what> left out)``, or nothing when none were."""
    return f" (and {n} {what} left out)" if n else ""


__all__ = ["Throttle", "left_out_note"]
