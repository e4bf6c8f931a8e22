"""The ManagerServer's rules as pure functions over plain data.

Nothing here touches the network, an event loop or a clock: times are arguments and
results are plain values. ``server.py`` (gRPC and the in-process path) and ``_votes.py``
(the commit vote's futures) are thin shells that gather the ranks' requests and call
these; tests drive every branch with tables of plain values, as they do for the
lighthouse's ``quorum.py`` and the manager's ``recovery.py``.

* :func:`aggregate_requests`: one lighthouse request for the whole replica group
  (``shrink_only`` if any rank asked, ``commit_failures`` the maximum, and ``data``: the
  group's step statistics, including the step stats of the rank that held it up).
* :func:`parse_step_stats`: a rank's step stats, as sent in the ``x-rallypoint-step-stats``
  metadata, checked against size, key and value limits before anything uses them.
* :func:`group_size_error`: replica groups of different sizes cannot share a quorum.
* :func:`fold_vote` / :func:`vote_decision`: the group's commit vote.
* :func:`lighthouse_budget` / :func:`retry_pause`: how long the group's lighthouse call
  may take, and whether a failed call is retried.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: gRPC metadata key carrying a rank's step stats (compact JSON text; lower case, as
#: gRPC requires). torchft's clients never send it: absent is normal.
STEP_STATS_HEADER = "x-rallypoint-step-stats"
#: Largest step-stats text accepted (UTF-8 bytes), checked before it is parsed.
MAX_STEP_STATS_BYTES = 1024
#: How a rank's previous round ended.
STEP_OUTCOMES = ("committed", "failed", "healing", "spare")
#: The step-stats fields holding durations in seconds.
STEP_STATS_SECONDS = ("step_s", "compute_s", "quorum_wait_s", "comm_s", "heal_s", "commit_s", "configure_s")
#: Why a failed round failed (``rallypoint.manager._record.cause_of``).
STEP_CAUSES = ("peer_down", "comm", "quorum", "vote", "participants", "injected", "sdc", "error")
#: The step-stats fields holding counters.
STEP_STATS_COUNTERS = ("step", "round")
#: Bounds of a duration field (seconds); a step of more than ~11 days is not a timing.
MAX_STEP_STATS_SECONDS = 1e6
#: Bound of a counter field (protobuf's int64, like the step itself).
MAX_STEP_STATS_COUNTER = 2**63 - 1
#: Which corruption check failed a round, and the replica groups it named (at most
#: MAX_SDC_NAMES ids of at most MAX_SDC_NAME_CHARS characters).
SDC_CHECKS = ("grad", "param")
MAX_SDC_NAMES = 8
MAX_SDC_NAME_CHARS = 256
#: The optional ``ckpt`` object: a group's durable checkpointing (``DurableCheckpoint``):
#: the last complete step and its age, and counters since the process started.
CKPT_COUNTERS = ("step", "writes", "bytes", "failures", "skipped")
CKPT_SECONDS = ("age_s", "stall_s")
#: Bounds of its fields: exact in a double (the dashboard's JavaScript), ~31 years of seconds.
MAX_CKPT_COUNTER = 2**53
MAX_CKPT_SECONDS = 1e9
_KNOWN = frozenset((*STEP_STATS_COUNTERS, "outcome", "cause", "sdc", "sdc_bad", "ckpt", *STEP_STATS_SECONDS))


# ------------------------------------------------------------------ step stats
def _show(value: Any) -> str:
    """``value`` for an error message, bounded (it came from the network)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_step_stats(value: Any) -> dict[str, Any]:
    """A decoded step-stats value, checked: a JSON object of known keys only, each of the
    right type and within bounds. Returns a new dict (durations as floats); raises
    ``ValueError`` naming the first bad field. Missing keys are fine (a rank reports
    what it measured)."""
    if not isinstance(value, dict):
        raise ValueError(f"step stats must be a JSON object, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in _KNOWN)
    if unknown:
        raise ValueError(f"step stats have unknown key(s) {', '.join(_show(k) for k in unknown)}; "
                         f"known keys: {', '.join(sorted(_KNOWN))}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key in STEP_STATS_COUNTERS:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP_STATS_COUNTER:
                raise ValueError(f"step stats field {key!r} must be an integer >= 0, got {_show(v)}")
            out[key] = v
        elif key == "outcome":
            if v not in STEP_OUTCOMES:
                raise ValueError(f"step stats field 'outcome' must be one of {', '.join(STEP_OUTCOMES)}, got {_show(v)}")
            out[key] = v
        elif key == "sdc":
            if v not in SDC_CHECKS:
                raise ValueError(f"step stats field 'sdc' must be one of {', '.join(SDC_CHECKS)}, got {_show(v)}")
            out[key] = v
        elif key == "sdc_bad":
            if not isinstance(v, list) or len(v) > MAX_SDC_NAMES \
                    or not all(isinstance(n, str) and 0 < len(n) <= MAX_SDC_NAME_CHARS for n in v):
                raise ValueError(f"step stats field 'sdc_bad' must be a list of at most {MAX_SDC_NAMES} replica ids")
            out[key] = list(v)
        elif key == "ckpt":
            out[key] = check_ckpt(v)
        elif key == "cause":
            if v not in STEP_CAUSES:
                raise ValueError(f"step stats field 'cause' must be one of {', '.join(STEP_CAUSES)}, got {_show(v)}")
            out[key] = v
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not 0 <= v <= MAX_STEP_STATS_SECONDS:
                raise ValueError(f"step stats field {key!r} must be a finite number of seconds in "
                                 f"[0, {MAX_STEP_STATS_SECONDS:g}], got {_show(v)}")
            out[key] = float(v)
    return out


def check_ckpt(value: Any) -> dict[str, Any]:
    """A step-stats ``ckpt`` object, checked: known keys only (:data:`CKPT_COUNTERS`,
    :data:`CKPT_SECONDS`), integers in ``[0, MAX_CKPT_COUNTER]``, seconds finite in
    ``[0, MAX_CKPT_SECONDS]``. Returns a new dict; ``ValueError`` names the first bad field."""
    if not isinstance(value, dict):
        raise ValueError(f"step stats field 'ckpt' must be a JSON object, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key in CKPT_COUNTERS:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_CKPT_COUNTER:
                raise ValueError(f"step stats field 'ckpt.{key}' must be an integer in [0, 2**53], got {_show(v)}")
            out[key] = v
        elif key in CKPT_SECONDS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and v > MAX_CKPT_SECONDS) \
                    or not math.isfinite(v) or not 0 <= v <= MAX_CKPT_SECONDS:
                raise ValueError(f"step stats field 'ckpt.{key}' must be a finite number of seconds in "
                                 f"[0, {MAX_CKPT_SECONDS:g}], got {_show(v)}")
            out[key] = float(v)
        else:
            raise ValueError(f"step stats field 'ckpt' has an unknown key {_show(str(key))}; known keys: "
                             f"{', '.join(sorted((*CKPT_COUNTERS, *CKPT_SECONDS)))}")
    return out


def merge_ckpt(parts: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The group's ``ckpt`` from its ranks' (None when none sent one): the newest complete
    step any rank knows of (with the youngest age), the counters summed (each rank writes
    its own share), and the stall the largest (ranks stage at once; the group waits for
    the slowest)."""
    got = [p for p in parts if p]
    if not got:
        return None
    out: dict[str, Any] = {}
    for key in ("writes", "bytes", "failures", "skipped"):
        if any(key in p for p in got):
            out[key] = min(MAX_CKPT_COUNTER, sum(int(p.get(key, 0)) for p in got))
    if any("stall_s" in p for p in got):
        out["stall_s"] = max(float(p.get("stall_s", 0.0)) for p in got)
    steps = [p for p in got if "step" in p]
    if steps:
        newest = max(int(p["step"]) for p in steps)
        out["step"] = newest
        ages = [float(p["age_s"]) for p in steps if p["step"] == newest and "age_s" in p]
        if ages:
            out["age_s"] = min(ages)
    return out


def parse_step_stats(text: str | bytes | None) -> dict[str, Any] | None:
    """A rank's step-stats metadata, checked (see :func:`check_step_stats`): None when
    absent; ``ValueError`` naming the problem when over :data:`MAX_STEP_STATS_BYTES`, not
    JSON, or any field is bad. The size is checked before the text is parsed."""
    if text is None:
        return None
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_STEP_STATS_BYTES:
        raise ValueError(f"step stats are {len(raw)} bytes; the limit is {MAX_STEP_STATS_BYTES}")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"step stats are not valid JSON: {e}") from None
    return check_step_stats(value)


def encode_step_stats(stats: Mapping[str, Any]) -> str:
    """The metadata text a client sends for ``stats``: compact JSON (ASCII, as gRPC's
    text metadata requires)."""
    return json.dumps(dict(stats), separators=(",", ":"))


def slowest_step_stats(stats: Mapping[int, Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The group's step stats: those of the rank that held the group up, i.e. the largest
    ``compute_s`` among the ranks that sent stats (ties, and ranks without ``compute_s``,
    go to the lowest group rank), plus ``"rank"``: that group rank. None when no rank
    sent stats. The lighthouse scores stragglers per replica group, and a group is as
    slow as its slowest rank."""
    sent = [(rank, s) for rank, s in stats.items() if s is not None]
    if not sent:
        return None
    rank, chosen = min(sent, key=lambda rs: (-float(rs[1].get("compute_s", -1.0)), rs[0]))
    return {**chosen, "rank": rank}


# ------------------------------------------------------------------ the group's request
@dataclass(frozen=True)
class RankRequest:
    """What one rank's ``Quorum`` request contributes to the group's lighthouse request."""

    group_rank: int
    shrink_only: bool = False
    commit_failures: int = 0
    init_sync: bool = True
    step_stats: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class GroupRequest:
    """The one lighthouse request a ManagerServer makes for its whole replica group."""

    shrink_only: bool
    commit_failures: int
    #: The JSON object sent as the lighthouse request's ``data``.
    data: dict[str, Any]


def aggregate_requests(step: int, world_size: int, requests: Iterable[RankRequest], first_at: float,
                       now: float) -> GroupRequest:
    """The group's lighthouse request from its ranks' requests for ``step``.

    ``shrink_only`` if any rank asked (one rank that cannot take a new member in speaks
    for the group); ``commit_failures`` the maximum (the lighthouse bumps the quorum id on
    any failure); ``data`` carries ``step``, ``group_world_size``, ``gather_s`` (seconds
    from the first rank's request, at ``first_at``, to ``now``), ``shrink_only_ranks``,
    ``commit_failures`` and, when any rank sent them, ``step_stats`` (see
    :func:`slowest_step_stats`). Raises ``ValueError`` when ``requests`` is empty."""
    reqs = sorted(requests, key=lambda r: r.group_rank)
    if not reqs:
        raise ValueError(f"no rank has asked for a quorum at step {step}")
    commit_failures = max(r.commit_failures for r in reqs)
    data: dict[str, Any] = {
        "step": step,
        "group_world_size": world_size,
        "gather_s": round(now - first_at, 6),
        "shrink_only_ranks": [r.group_rank for r in reqs if r.shrink_only],
        "commit_failures": commit_failures,
    }
    stats = slowest_step_stats({r.group_rank: r.step_stats for r in reqs})
    if stats is not None:
        ckpt = merge_ckpt((r.step_stats or {}).get("ckpt") for r in reqs)
        stats.pop("ckpt", None)
        if ckpt is not None:
            stats["ckpt"] = ckpt
        data["step_stats"] = stats
    return GroupRequest(shrink_only=any(r.shrink_only for r in reqs), commit_failures=commit_failures, data=data)


def group_size_error(quorum_id: int, sizes: Mapping[str, int]) -> str | None:
    """Why a quorum whose replica groups have these sizes (``replica_id -> world_size``;
    0 means not reported, and is skipped) cannot be used, or None when it can. Group rank
    g averages with group rank g of every other group: groups of different sizes would
    leave ranks without peers and hang in configure."""
    known = {rid: n for rid, n in sizes.items() if n}
    if len(set(known.values())) <= 1:
        return None
    return (f"replica groups of different sizes in quorum {quorum_id}: "
            + ", ".join(f"{rid} has {n} rank(s)" for rid, n in sorted(known.items()))
            + "; every replica group must have the same number of ranks")


# ------------------------------------------------------------------ the lighthouse call
def lighthouse_budget(deadlines: Iterable[float | None], now: float, quorum_timeout: float | None,
                      default: float) -> float:
    """Seconds the group's lighthouse call may take: until the latest of the waiting ranks'
    deadlines (``default`` when none has one), capped by ``quorum_timeout``; at least 1 ms."""
    known = [d for d in deadlines if d is not None]
    budget = max(known) - now if known else (quorum_timeout or default)
    if quorum_timeout is not None:
        budget = min(budget, quorum_timeout)
    return max(budget, 0.001)


def retry_pause(attempt: int, retries: int, now: float, end: float) -> float | None:
    """After failed (not timed-out) lighthouse call number ``attempt`` (from 0): the pause
    before retrying (0.1 s doubling, at most 1 s), or None to give up: ``retries`` (torchft's
    ``quorum_retries``) are spent, or the pause would run past ``end``."""
    pause = min(0.1 * 2**attempt, 1.0)
    if attempt >= retries or now + pause >= end:
        return None
    return pause


# ------------------------------------------------------------------ the commit vote
def fold_vote(votes: Mapping[int, bool], rank: int, vote: bool) -> dict[int, bool]:
    """The round's votes after ``rank`` voted ``vote`` (a new dict). A False stands: a later
    True for the same rank and step (a retry, or a forged vote) cannot turn a failed step
    into a committed one."""
    return {**votes, rank: votes.get(rank, True) and vote}


def vote_decision(votes: Mapping[int, bool], world_size: int) -> bool | None:
    """The group's decision: None while some rank in ``range(world_size)`` has not voted,
    else True only if every vote is True."""
    if any(rank not in votes for rank in range(world_size)):
        return None
    return all(votes.values())


__all__ = [
    "MAX_STEP_STATS_BYTES", "MAX_STEP_STATS_COUNTER", "MAX_STEP_STATS_SECONDS", "STEP_CAUSES", "STEP_OUTCOMES",
    "STEP_STATS_COUNTERS", "STEP_STATS_HEADER", "STEP_STATS_SECONDS", "GroupRequest", "RankRequest",
    "aggregate_requests", "check_ckpt", "check_step_stats", "encode_step_stats", "fold_vote", "group_size_error",
    "lighthouse_budget", "merge_ckpt", "parse_step_stats", "retry_pause", "slowest_step_stats", "vote_decision",
]
