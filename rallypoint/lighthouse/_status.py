"""The lighthouse's ``GET /status`` document, built from its core's state (on the loop
thread). Kept apart from ``core.py`` so that the state machine stays about decisions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rallypoint.lighthouse.core import LighthouseCore


def core_status(core: "LighthouseCore") -> dict:
    """What ``GET /status`` shows of a lighthouse core (called on its loop thread)."""
    now = core._clock()
    prev = core.previous
    ids = set(core.heartbeats) | set(core.pending) | set(core._attached) | set(core._dead)
    if prev is not None:
        ids.update(prev.replica_ids)
    replicas = []
    for rid in sorted(ids):
        last = core.heartbeats.get(rid)
        replicas.append(
            {
                "replica_id": rid,
                "heartbeat_age_s": None if last is None else round(now - last, 3),
                "participating": rid in core.pending,
                "attached": rid in core._attached,
                "dead": rid in core._dead,
                "step": core._steps.get(rid),
                "address": core._addresses.get(rid, ""),
                "straggler": _straggler_status(core, rid, now),
                "checkpoint": core.checkpoints.status(rid, now),
            }
        )
    d = core.last_decision
    return {
        "quorum_id": core.quorum_id,
        "quorum": None
        if prev is None
        else {
            "quorum_id": prev.quorum_id,
            "created": prev.created,
            "members": [m.__dict__.copy() for m in prev.members],
        },
        "replicas": replicas,
        "last_decision": None
        if d is None
        else {"rule": d.rule.value, "reason": d.reason, "time": core.last_decision_time},
        "options": {
            "min_replicas": core.options.min_replicas,
            "join_timeout_ms": int(core.options.join_timeout * 1000),
            "heartbeat_timeout_ms": int(core.options.heartbeat_timeout * 1000),
        },
        "stragglers": {
            **core.stragglers.policy.as_dict(),
            "flagged": core.stragglers.flagged(),
            "excluded": sorted(core.stragglers.excluded(now)),
            "evictions_total": core.stragglers.evictions,
        },
        "goodput": core.goodput.summary(),  # without its time series (GET /goodput has that)
        "lease": core.leases.status(),
    }


def _straggler_status(core: "LighthouseCore", rid: str, now: float) -> dict:
    """A replica's straggler score for /status, with ``excluded_until`` in wall-clock
    seconds (or None)."""
    snap = core.stragglers.snapshot(rid)
    until = snap["excluded_until"]
    snap["excluded_until"] = None if until is None or until <= now else round(core._to_wall(until, now), 3)
    return snap
