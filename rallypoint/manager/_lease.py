"""Quorum leases, the replica group's side (``rallypoint/lighthouse/LEASES.md``): the
ManagerServer keeps the lease it was granted and answers a round from it, without asking
the lighthouse, while the rule below allows.

:func:`lease_refusal` is the rule, a pure function over plain values; :class:`LeaseHolder`
is the state, shared by the server's event loop (grant, take) and the liveness stream's
thread (revoke), so it takes a lock.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from rallypoint.lighthouse.client import Quorum


@dataclass(frozen=True)
class Lease:
    """A quorum granted as a lease, and the step of the next round it may serve."""

    quorum: Quorum
    next_step: int

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

    def held(self) -> int:
        """The quorum_id of the lease held, 0 when none (for the stream's hello)."""
        with self._lock:
            lease = self._lease
            return lease.quorum_id if lease is not None and lease.quorum_id > self._revoked_upto else 0

    def grant(self, quorum: Quorum) -> bool:
        """Take up ``quorum`` as a lease (it came with a grant). False when a revoke of its
        id arrived first."""
        next_step = max((m.step for m in quorum.members), default=0) + 1
        with self._lock:
            if quorum.quorum_id <= self._revoked_upto:
                self._lease = None
                return False
            self._lease = Lease(quorum, next_step)
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
        with self._lock:
            lease = self._lease
            why = lease_refusal(lease, self._revoked_upto, step, commit_failures, shrink_only)
            if why is not None or lease is None:
                self._lease = None
                return None, why or "no lease held"
            self._lease = Lease(lease.quorum, step + 1)
            self.served += 1
            return leased_quorum(lease.quorum, step), ""


__all__ = ["Lease", "LeaseHolder", "lease_refusal", "leased_quorum"]
