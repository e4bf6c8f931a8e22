"""The bounded backoff while no quorum call gets through.

Why: with the lighthouse (or the group's own manager server) down, every step's quorum
fails at once, and a training loop that retries would fail ~40 steps a second, each one
logged (issue 16's "also found"). So each new quorum first waits ``pause`` seconds,
doubling from 0.05 up to :data:`OUTAGE_PAUSE_MAX_S`: a failed step a second at most,
one warning when the outage starts and one when it ends.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

#: The longest a quorum waits before asking again while no quorum call gets through.
OUTAGE_PAUSE_MAX_S = 1.0


class Outage:
    """How long the next quorum waits, and the outage's start and failure count."""

    def __init__(self, log: logging.LoggerAdapter) -> None:
        self._log = log
        self.pause = 0.0
        self.since: float | None = None
        self.failures = 0

    def failed(self, e: Exception) -> None:
        """A quorum call could not get through: say so once, then back off (bounded)."""
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            self._log.warning("quorum failed: %s; the lighthouse (or this group's manager server) is unreachable: "
                              "failing steps at most every %.0f s until a quorum call gets through", e,
                              OUTAGE_PAUSE_MAX_S)
        else:
            self._log.debug("quorum failed again (%d in a row): %s", self.failures, e)
        self.pause = min(max(0.05, 2 * self.pause), OUTAGE_PAUSE_MAX_S)

    def passed(self) -> None:
        """A quorum call got through: the outage (if any) is over."""
        if self.since is not None:
            self._log.warning("quorum calls get through again after %.1f s and %d failed steps",
                              time.monotonic() - self.since, self.failures)
        self.since, self.failures, self.pause = None, 0, 0.0




# torchft 0.2 reports a quorum timeout with its gRPC status text; callers (and torchft's
# own tests) match it, so rallypoint's timeout messages carry the same words.
TORCHFT_TIMEOUT_STATUS = 'status: Cancelled, message: "Timeout expired"'


def quorum_failure(e: Exception, who: str, step: int, timeout: timedelta, lighthouse: str) -> Exception | None:
    """The error ``should_commit``/``wait_quorum`` raise for a failed quorum call, or None
    when the step just fails (a connection error: the next quorum retries). A
    ``ValueError`` is a configuration error (e.g. groups of different sizes) that retrying
    cannot fix; a timeout means no quorum formed in time, which a caller must hear about."""
    if isinstance(e, ValueError):
        return ValueError(f"{who}: {e}")
    if isinstance(e, TimeoutError):
        return TimeoutError(
            f"{who}: no quorum formed for step {step} within {timeout.total_seconds():g}s (lighthouse {lighthouse}; "
            f"are at least min_replicas replica groups running and reaching it?): {e} ({TORCHFT_TIMEOUT_STATUS})"
        )
    return None


__all__ = ["OUTAGE_PAUSE_MAX_S", "TORCHFT_TIMEOUT_STATUS", "Outage", "quorum_failure"]
