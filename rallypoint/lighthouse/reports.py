"""Events that ``rallypoint run`` supervisors report to the lighthouse (``ReportEvent``):
their validation (a pure function), a per-group rate limit (pure: ``now`` is an
argument) and the intake that records what passes in the event log.

Why here and not in the supervisor's own log only: the lighthouse's event log is where an
operator looks when a replica group leaves and rejoins a quorum (``/events``, the
dashboard, ``rallypoint status``); the supervisor's restart line says *why* (exit code,
signal, hang) and how long the group was gone. Anything that holds the job token can call
the RPC, so everything is bounded before use: the sizes (``_net/limits.py``), the shape of
the details (a flat JSON object, so the dashboard can show it as ``key=value``), and the
rate per group and overall, so a buggy or hostile caller cannot push the real events (joins,
crashes, quorums) out of the event log's ring.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from rallypoint._net.limits import MAX_EVENT_DETAILS_BYTES, MAX_REASON_BYTES, utf8_len
from rallypoint._net.ratelog import Throttle, left_out_note
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse.state import Event, StateStore
from rallypoint.lighthouse.validate import MAX_COUNTER, InvalidRequest, replica_id

log = logging.getLogger("rallypoint.lighthouse")

#: What a supervisor may report; recorded in the event log as ``run.<kind>``, so the
#: lighthouse's own kinds (``start``, ``join``, ``crash``, ...) never collide with them.
EVENT_KINDS: tuple[str, ...] = ("restart", "gave_up", "stopped", "started")
KIND_PREFIX = "run."
MAX_KIND_BYTES = 64
MAX_DETAIL_KEYS = 32
MAX_DETAIL_LIST = 16
MAX_DETAIL_STRING_BYTES = MAX_REASON_BYTES
#: Keys the event log's ``record_event(kind, replica_id, **detail)`` takes itself.
RESERVED_KEYS = frozenset({"kind", "replica_id", "self"})
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

#: Per group: a supervisor reports one event per restart, and restarts are seconds apart
#: (a rank has to start first); a burst of 10 lets a short crash loop through whole.
GROUP_RATE_PER_S = 2.0
GROUP_BURST = 10
#: Over all groups, so many group names cannot flood the log either. At this rate the
#: 10,000-event ring would take over 8 minutes of sustained flood to turn over.
TOTAL_RATE_PER_S = 20.0
TOTAL_BURST = 100
#: Groups whose buckets are remembered (least recently seen forgotten first).
MAX_TRACKED_GROUPS = 4096
#: A dropped-events log line at most this often.
DROP_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Report:
    """A validated supervisor event: ``group`` (the replica group's label), ``kind`` (one
    of :data:`EVENT_KINDS`) and ``details`` (flat: scalars and short lists of scalars)."""

    group: str
    kind: str
    details: dict[str, Any]

    @property
    def log_kind(self) -> str:
        """The kind as it appears in the lighthouse's event log."""
        return KIND_PREFIX + self.kind


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"details contains {name}: only finite numbers are accepted")


def _scalar(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_COUNTER:
            raise InvalidRequest(f"{where} is implausibly large: {str(value)[:40]}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"{where} is not a finite number")
        return value
    if isinstance(value, str):
        size = utf8_len(value)
        if size > MAX_DETAIL_STRING_BYTES:
            raise InvalidRequest(f"{where} is {size} bytes; the limit is {MAX_DETAIL_STRING_BYTES}")
        if not value.isprintable():
            raise InvalidRequest(f"{where} {value[:80]!r} contains non-printable characters")
        return value
    raise InvalidRequest(f"{where} is a JSON {type(value).__name__}: values must be scalars or lists of scalars")


def details(value: str, field: str = "details") -> dict[str, Any]:
    """``details``: empty (no fields) or a JSON object of at most 4 KiB whose keys are
    identifiers and whose values are scalars or lists of at most 16 scalars."""
    if not value:
        return {}
    size = utf8_len(value)
    if size > MAX_EVENT_DETAILS_BYTES:
        raise InvalidRequest(f"{field} is {size} bytes; the limit is {MAX_EVENT_DETAILS_BYTES}")
    try:
        parsed = json.loads(value, parse_constant=_reject_constant)
    except InvalidRequest:
        raise
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise InvalidRequest(f"{field} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{field} must be a JSON object, got a JSON {type(parsed).__name__}")
    if len(parsed) > MAX_DETAIL_KEYS:
        raise InvalidRequest(f"{field} has {len(parsed)} keys; the limit is {MAX_DETAIL_KEYS}")
    out: dict[str, Any] = {}
    for key, item in parsed.items():
        if not _KEY.fullmatch(key):
            raise InvalidRequest(f"{field} key {key[:80]!r} is not an identifier of at most 64 characters")
        if key in RESERVED_KEYS:
            raise InvalidRequest(f"{field} key {key!r} is reserved by the event log")
        where = f"{field}.{key}"
        if isinstance(item, list):
            if len(item) > MAX_DETAIL_LIST:
                raise InvalidRequest(f"{where} has {len(item)} items; the limit is {MAX_DETAIL_LIST}")
            out[key] = [_scalar(v, f"{where}[{i}]") for i, v in enumerate(item)]
        else:
            out[key] = _scalar(item, where)
    return out


def supervisor_event(group: str, kind: str, detail_json: str) -> Report:
    """Check the fields of a ``SupervisorEvent`` (sizes first); InvalidRequest names the
    field that is wrong."""
    label = replica_id(group, "group")
    if utf8_len(kind) > MAX_KIND_BYTES or kind not in EVENT_KINDS:
        raise InvalidRequest(f"kind {kind[:MAX_KIND_BYTES]!r} is not one of {', '.join(EVENT_KINDS)}")
    return Report(label, kind, details(detail_json))


class RateLimiter:
    """Token buckets by key: ``rate`` per second, up to ``burst`` at once. Pure apart from
    its own buckets: the caller passes ``now``. At most ``max_keys`` buckets are held; the
    least recently used is forgotten first (it comes back full, which a caller rotating
    keys cannot exploit past the overall limit)."""

    def __init__(self, rate: float, burst: float, max_keys: int = MAX_TRACKED_GROUPS) -> None:
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError(f"need rate > 0, burst >= 1, max_keys >= 1; got {rate}, {burst}, {max_keys}")
        self.rate, self.burst, self.max_keys = rate, float(burst), max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def allow(self, key: str, now: float) -> bool:
        """Take one token of ``key``'s bucket if it has one."""
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


class EventIntake:
    """Records accepted reports in the event log; drops (and counts) those over the rate
    limits. Runs on the lighthouse's loop thread, like the core."""

    def __init__(self, store: StateStore, metrics: LighthouseMetrics, *,
                 per_group: tuple[float, float] = (GROUP_RATE_PER_S, GROUP_BURST),
                 total: tuple[float, float] = (TOTAL_RATE_PER_S, TOTAL_BURST),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._metrics, self._clock = store, metrics, clock
        self._groups = RateLimiter(*per_group)
        self._total = RateLimiter(*total, max_keys=1)
        self.dropped = 0
        self._log_throttle = Throttle(DROP_LOG_INTERVAL_S, clock)

    def accept(self, report: Report, peer: str = "") -> Event | None:
        """The recorded event, or None when a rate limit dropped it."""
        now = self._clock()
        # The group's bucket first: a flooding group must not use up the overall budget.
        if not (self._groups.allow(report.group, now) and self._total.allow("*", now)):
            self._drop(report, peer, now)
            return None
        self._metrics.run_event(report.kind)
        level = logging.WARNING if report.kind in ("restart", "gave_up") else logging.INFO
        log.log(level, "[%s] rallypoint run reported %s%s", report.group, report.kind,
                "".join(f" {k}={v}" for k, v in report.details.items()))
        return self._store.record_event(report.log_kind, report.group, **report.details)

    def _drop(self, report: Report, peer: str, now: float) -> None:
        self.dropped += 1
        self._metrics.rejected("rate_limited")
        left_out = self._log_throttle.ready(now)
        if left_out is None:
            return
        more = left_out_note(left_out, "more")
        log.warning("[%s] dropped a reported %s event from %s: over the rate limit (%g/s per group, %g/s "
                    "overall)%s; %d dropped in all", report.group, report.kind, peer or "a caller",
                    self._groups.rate, self._total.rate, more, self.dropped)


__all__ = ["EVENT_KINDS", "KIND_PREFIX", "EventIntake", "RateLimiter", "Report", "details", "supervisor_event"]
