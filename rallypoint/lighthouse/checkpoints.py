"""Durable checkpoints as the lighthouse sees them: each replica group's last complete
checkpoint step, its age, and its writes, bytes, stall and failures, for ``/status``,
``/metrics`` and the dashboard.

The figures come with the step stats a group already sends (a Quorum request's ``data``,
or a lease's step report): ``step_stats.ckpt``, built by ``DurableCheckpoint.report`` and
summed over the group's ranks by its ManagerServer. Nothing in ``data`` is trusted: the
object is parsed here with its own bounds (types, ranges, known keys only), and a bad one
is ignored without failing the request. The lighthouse keeps one small row per group it
still knows (``keep_only``), at most :data:`MAX_GROUPS`.

The age is sent as seconds since the commit (the groups' clocks need not agree with the
lighthouse's) and grows on the lighthouse's clock from the report's arrival.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

#: The step-stats key holding a group's checkpoint figures.
CKPT_KEY = "ckpt"
COUNTERS = ("step", "writes", "bytes", "failures", "skipped")
SECONDS = ("age_s", "stall_s")
#: Bounds: integers exact in a double (the dashboard's JavaScript); ~31 years of seconds.
MAX_COUNTER = 2**53
MAX_SECONDS = 1e9
#: Groups remembered at most (ids that come and go are dropped by ``keep_only``).
MAX_GROUPS = 4096


class BadCkpt(ValueError):
    """``step_stats.ckpt`` is present but malformed; the message names the field."""


@dataclass(frozen=True)
class CkptReport:
    """One group's checkpoint figures, as reported (``step``/``age_s``: None before its
    first complete checkpoint)."""

    step: int | None = None
    age_s: float | None = None
    writes: int = 0
    bytes: int = 0
    failures: int = 0
    skipped: int = 0
    stall_s: float = 0.0


def _reject_constant(name: str) -> Any:
    raise BadCkpt(f"step_stats contains {name}")


def check_ckpt(raw: Any) -> CkptReport:
    """A decoded ``ckpt`` object, checked; :class:`BadCkpt` names the first bad field."""
    if not isinstance(raw, dict):
        raise BadCkpt(f"step_stats.ckpt must be a JSON object, got a JSON {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, v in raw.items():
        if key in COUNTERS:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNTER:
                raise BadCkpt(f"step_stats.ckpt.{key} must be an integer in [0, 2**53], got {str(v)[:40]}")
            out[key] = v
        elif key in SECONDS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and v > MAX_SECONDS):
                raise BadCkpt(f"step_stats.ckpt.{key} must be a number of seconds, got {str(v)[:40]}")
            if not (math.isfinite(v) and 0 <= v <= MAX_SECONDS):
                raise BadCkpt(f"step_stats.ckpt.{key} must be finite and within [0, {MAX_SECONDS:g}], got {v}")
            out[key] = float(v)
        else:
            raise BadCkpt(f"step_stats.ckpt has an unknown key {str(key)[:40]!r}")
    return CkptReport(**out)


def parse_ckpt(data: str) -> CkptReport | None:
    """The ``step_stats.ckpt`` of a Quorum request's ``data`` (already within
    ``validate.data``'s size limit); None when absent. Raises :class:`BadCkpt`."""
    if not data or f'"{CKPT_KEY}"' not in data:  # cheap: most requests carry none
        return None
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except BadCkpt:
        raise
    except (ValueError, RecursionError) as e:
        raise BadCkpt(f"data is not valid JSON: {str(e)[:200]}") from None
    stats = doc.get("step_stats") if isinstance(doc, dict) else None
    if not isinstance(stats, dict) or CKPT_KEY not in stats:
        return None
    return check_ckpt(stats[CKPT_KEY])


class CheckpointBook:
    """The last :class:`CkptReport` of each replica group, with when it arrived (on the
    lighthouse's monotonic clock). Used on the lighthouse's loop thread."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[CkptReport, float]] = {}

    def observe(self, rid: str, report: CkptReport, now: float) -> None:
        """Keep ``report`` as ``rid``'s latest (the oldest group is dropped past MAX_GROUPS)."""
        self._rows.pop(rid, None)
        self._rows[rid] = (report, now)
        while len(self._rows) > MAX_GROUPS:
            del self._rows[next(iter(self._rows))]

    def keep_only(self, known: set[str]) -> None:
        """Forget groups the lighthouse no longer knows."""
        for rid in [r for r in self._rows if r not in known]:
            del self._rows[rid]

    def status(self, rid: str, now: float) -> dict[str, Any] | None:
        """``rid``'s figures for ``/status`` (None when it never reported any):
        ``last_complete_step``, ``age_s`` (as of ``now``), ``writes``, ``bytes``,
        ``stall_s``, ``failures``, ``skipped``."""
        row = self._rows.get(rid)
        if row is None:
            return None
        r, at = row
        age = None if r.age_s is None else round(r.age_s + max(0.0, now - at), 3)
        return {"last_complete_step": r.step, "age_s": age, "writes": r.writes, "bytes": r.bytes,
                "stall_s": r.stall_s, "failures": r.failures, "skipped": r.skipped}

    def rows(self, now: float) -> dict[str, dict[str, Any]]:
        """Every group's :meth:`status`, by replica id (for ``/metrics``)."""
        return {rid: s for rid in self._rows if (s := self.status(rid, now)) is not None}


__all__ = ["BadCkpt", "CheckpointBook", "CkptReport", "check_ckpt", "parse_ckpt"]
