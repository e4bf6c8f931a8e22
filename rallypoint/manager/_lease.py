"""Quorum leases, the replica group's side (``rallypoint/lighthouse/LEASES.md``): the
ManagerServer keeps the lease it was granted and answers a round from it, without asking
the lighthouse, while the rule below allows.

:func:`lease_refusal` is the rule, a pure function over plain values; :class:`LeaseHolder`
is the state, shared by the server's event loop (grant, take) and the liveness stream's
thread (revoke), so it takes a lock.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Hashable, MutableMapping

from rallypoint.lighthouse.client import Quorum
from rallypoint.manager.recovery import QuorumResult, compute_quorum_result

#: what :func:`leased_result` keeps per caller's key: (the lease's quorum, init_sync, result)
ResultCache = MutableMapping[Hashable, "tuple[Quorum, bool, QuorumResult]"]


@dataclass(frozen=True)
class Lease:
    """A quorum granted as a lease, and the step of the next round it may serve."""

    quorum: Quorum
    next_step: int
    report_every: int = 1  # report step stats at steps that are multiples of this (the grant says)

    @property
    def quorum_id(self) -> int:
        return self.quorum.quorum_id


def lease_refusal(lease: Lease | None, revoked_upto: int, step: int, commit_failures: int,
                  shrink_only: bool) -> str | None:
    """Why the group's round at ``step`` must ask the lighthouse, or None when the lease
    serves it.

    The lease serves only the round right after the last one it served (or after the
    round that granted it), and only when that round committed: a group that failed a
    step, skipped one or went back is no longer where its peers are, and asking the
    lighthouse is how it says so (the lighthouse then revokes the lease for everyone). A
    shrink is a membership change, which only the lighthouse makes."""
    if lease is None:
        return "no lease held"
    if lease.quorum_id <= revoked_upto:
        return f"the lease of quorum {lease.quorum_id} was revoked"
    if commit_failures > 0:
        return f"the group failed its last step ({commit_failures} commit failure(s))"
    if shrink_only:
        return "a rank asked for shrink_only"
    if step != lease.next_step:
        return f"the group is at step {step}, the lease's next round is step {lease.next_step}"
    return None


def leased_quorum(quorum: Quorum, step: int) -> Quorum:
    """The quorum a round at ``step`` gets from the lease: the leased members, every one at
    ``step`` (a member that is anywhere else does not use the lease: see
    :func:`lease_refusal`), so nobody heals and the quorum_id (and the process group) stay."""
    members = tuple(dataclasses.replace(m, step=step, commit_failures=0, shrink_only=False, data="")
                    for m in quorum.members)
    return Quorum(quorum.quorum_id, members, quorum.created)


def leased_result(cache: ResultCache, key: Hashable, base: Quorum, step: int, replica_id: str,
                  group_rank: int, init_sync: bool) -> QuorumResult:
    """Group rank ``group_rank``'s result for the leased round at ``step`` of the lease
    whose quorum is ``base``.

    Every member of a leased round is at the round's step, so past step 0 (where
    ``init_sync`` may make peers heal) the result differs from round to round of one lease
    only in ``max_step``: it is computed once per lease, rank and ``init_sync`` (kept in
    ``cache`` under ``key``, which the caller bounds) and then only ``max_step`` moves. A
    cached entry counts only for the same ``base`` object, so a new lease recomputes."""
    known = cache.get(key)
    if step > 0 and known is not None and known[0] is base and known[1] == init_sync:
        return dataclasses.replace(known[2], max_step=step)
    result = compute_quorum_result(leased_quorum(base, step), replica_id, group_rank, init_sync)
    if step > 0:
        cache[key] = (base, init_sync, result)
    else:
        cache.pop(key, None)
    return result


class LeaseHolder:
    """The lease a ManagerServer holds (at most one) and the highest quorum_id revoked.

    A grant is taken up only when its id is above every revoke heard: the grant rides the
    Quorum answer and the revoke the liveness stream, so a revoke can overtake the grant
    it ends; every quorum formed after a revoke has a larger id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._revoked_upto = 0
        self.served = 0  # rounds answered from a lease
        self.report_every = 1  # of the lease that served the last round

    def held(self) -> int:
        """The quorum_id of the lease held, 0 when none (for the stream's hello)."""
        with self._lock:
            lease = self._lease
            return lease.quorum_id if lease is not None and lease.quorum_id > self._revoked_upto else 0

    def grant(self, quorum: Quorum, report_every: int = 1) -> bool:
        """Take up ``quorum`` as a lease (it came with a grant). False when a revoke of its
        id arrived first."""
        next_step = max((m.step for m in quorum.members), default=0) + 1
        with self._lock:
            if quorum.quorum_id <= self._revoked_upto:
                self._lease = None
                return False
            self._lease = Lease(quorum, next_step, max(1, report_every))
            return True

    def revoke(self, quorum_id: int) -> bool:
        """Every lease up to ``quorum_id`` ends. True when the one held did."""
        with self._lock:
            self._revoked_upto = max(self._revoked_upto, quorum_id)
            ended = self._lease is not None and self._lease.quorum_id <= quorum_id
            if ended:
                self._lease = None
            return ended

    def take(self, step: int, commit_failures: int, shrink_only: bool) -> tuple[Quorum | None, str]:
        """The quorum for the group's round at ``step`` from the lease, or None and why
        not. A refused lease is dropped: the group asks, and its asking ends the lease at
        the lighthouse too."""
        quorum, why = self.take_base(step, commit_failures, shrink_only)
        return (None, why) if quorum is None else (leased_quorum(quorum, step), "")

    def take_base(self, step: int, commit_failures: int, shrink_only: bool) -> tuple[Quorum | None, str]:
        """:meth:`take`, returning the lease's quorum as granted (the same object for every
        round of the lease, so a caller may keep what it derived from it); the round's
        quorum is ``leased_quorum(quorum, step)``."""
        with self._lock:
            lease = self._lease
            why = lease_refusal(lease, self._revoked_upto, step, commit_failures, shrink_only)
            if why is not None or lease is None:
                self._lease = None
                return None, why or "no lease held"
            self._lease = Lease(lease.quorum, step + 1, lease.report_every)
            self.served += 1
            self.report_every = lease.report_every
            return lease.quorum, ""


#: The step-stats fields that are durations: summed over the rounds a report covers.
SUMMED = ("step_s", "compute_s", "quorum_wait_s", "comm_s", "heal_s", "commit_s", "configure_s")

#: A group on a lease reports about this often (seconds), however short its steps: see report_pace().
REPORT_INTERVAL_S = 0.05
#: The most rounds one paced report covers, as a multiple of the lease's ``report_every``.
MAX_PACE = 64


def report_pace(step_s: float | None, interval_s: float = REPORT_INTERVAL_S, cap: int = MAX_PACE) -> int:
    """How many times the lease's ``report_every`` a group lets pass between step reports
    when its rounds take ``step_s`` seconds: the smallest power of two whose rounds last at
    least ``interval_s`` (at most ``cap``); 1 when the step time is unknown.

    Why: with steps of a few milliseconds, a report per step costs the lighthouse more CPU
    than the whole step costs the group (on a shared host, the groups' too). Why a power
    of two: groups that pick different paces still report at common steps (every multiple
    of the larger one), where the straggler scorer compares them; each report says how many
    rounds it sums (``rounds``), so the scorer compares per-round figures."""
    if step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return 1
    pace = 1
    while pace < cap and pace * step_s < interval_s:
        pace *= 2
    return pace


class StatsBatch:
    """The step stats of leased rounds between two reports. A report is due at steps that
    are multiples of ``every`` (the grant's ``report_every``) times the group's pace
    (:func:`report_pace`, from the step time of the last report), and it sums the durations
    of the rounds since the last one and says how many (``rounds``), so straggler scores
    compare groups at the same steps per round while the goodput ledger still gets every
    second. A round whose outcome differs from the ones gathered so far (a heal, say) is
    never summed with them: what was gathered goes out first. Used by one thread at a time
    (the ManagerServer's event loop, or a one-rank group's training thread)."""

    def __init__(self) -> None:
        self._data: dict | None = None
        self.pace = 1

    def add(self, data: dict, step: int, every: int) -> list[dict]:
        """Take the report ``data`` of the round at ``step``; the reports due now (0-2)."""
        out: list[dict] = []
        acc = self._data
        stats, held = data.get("step_stats"), (acc or {}).get("step_stats")
        if acc is not None and stats is not None and held is not None and held.get("outcome") != stats.get("outcome"):
            out.append(acc)
            acc = held = None
        merged = dict(data)
        if stats is not None and held is not None:
            merged["step_stats"] = {**stats, **{k: held[k] + stats[k] for k in SUMMED if k in held and k in stats},
                                    "rounds": held.get("rounds", 1) + 1}
        elif held is not None:
            merged["step_stats"] = held
        every *= self.pace
        if every <= 1 or step % every == 0:
            out.append(merged)
            self._data = None
            done = merged.get("step_stats")
            if isinstance(done, dict) and isinstance(done.get("step_s"), (int, float)):
                self.pace = report_pace(done["step_s"] / done.get("rounds", 1))
        else:
            self._data = merged
        return out

    def flush(self) -> dict | None:
        """What was gathered and not reported yet (the lease ended), or None."""
        data, self._data = self._data, None
        return data


__all__ = ["MAX_PACE", "REPORT_INTERVAL_S", "SUMMED", "Lease", "LeaseHolder", "StatsBatch", "lease_refusal",
           "leased_quorum", "report_pace"]
