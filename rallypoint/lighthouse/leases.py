"""Quorum leases, the lighthouse's side: when a quorum is granted as a lease, and what
revokes it. The protocol, its states and its invariants are in ``LEASES.md`` beside
this file.

The decisions are pure functions over plain values (:func:`grant_refusal`,
:func:`revoke_for_request`, :func:`revoke_at_attach`, :func:`after_step`); :class:`LeaseDesk`
holds the one piece of state (the lease in force, and whether the next quorum needs a new
id) for the core, which runs on the lighthouse's event loop and needs no lock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from rallypoint._proto import rallypoint_pb2 as rpb
from rallypoint.lighthouse.quorum import Quorum

#: Step reports the lighthouse takes per step of a lease, at most (summed over its members).
REPORTS_PER_STEP = 32

#: Why revokes happen; the label values of ``rallypoint_lease_revokes_total``.
REVOKE_REASONS = ("joiner", "member_asked", "member_gone", "evicted", "injection", "kill", "stale")


@dataclass(frozen=True)
class Revoke:
    """A revoke to push: every lease with an id at or below ``quorum_id`` ends. When
    ``replica_id`` is set, that member takes part in no round of the lease at a step
    above ``after_step``."""

    quorum_id: int
    why: str  # one of REVOKE_REASONS
    reason: str  # for people: the logs, the event log
    replica_id: str = ""
    after_step: int = -1

    def to_pb(self) -> rpb.AttachResponse:
        return rpb.AttachResponse(lease_revoke=rpb.LeaseRevoke(
            quorum_id=self.quorum_id, reason=self.reason, replica_id=self.replica_id, after_step=self.after_step))


def grant_refusal(members: Collection[str], takes_leases: Mapping[str, bool], enabled: bool = True) -> str | None:
    """Why a quorum of ``members`` is not granted as a lease, or None when it is.

    ``takes_leases``: the replicas whose liveness stream is attached now, and whether
    its hello said it takes leases. A quorum of one is never leased: nothing but its own
    collectives could stop a member that lost touch with the lighthouse, and a quorum of
    one has no collective that another replica's absence would fail (LEASES.md, "Why a
    quorum of one is never leased"). A member without a stream (torchft's client, or one
    reconnecting) could never hear a revoke."""
    if not enabled:
        return "leases are off (--leases off)"
    if len(members) < 2:
        return "a quorum of one is never leased"
    for rid in sorted(members):
        if rid not in takes_leases:
            return f"member {rid} has no liveness stream attached"
        if not takes_leases[rid]:
            return f"member {rid} does not take leases (a torchft client, or leases turned off there)"
    return None


def report_every(members: int, per_step: int = REPORTS_PER_STEP) -> int:
    """How often (in steps) each member of a lease of ``members`` groups reports its step
    stats: every step up to ``per_step`` members, then less often, so that the lighthouse
    takes at most about ``per_step`` reports per step however large the job. Every member
    reports the same steps (multiples of the result), so straggler scores still compare
    groups at the same step; each report sums the rounds since the last one, so the goodput
    ledger still sees all of them."""
    return max(1, math.ceil(members / max(1, per_step)))


def after_step(step: int, commit_failures: int) -> int:
    """The last step of a lease whose rounds may go on without a member that now asks at
    ``step``: ``step - 1``, whether or not it failed its last round.

    One that committed asks at the next step, which it has not started. One that failed
    its last round (``commit_failures``) retries that round's step, and whether it took
    part in that round's collectives is not known here: a local failure before them
    (an injected allreduce error, an exception in the forward pass) leaves its peers
    waiting in them until the collective timeout. So the peers' round at ``step`` fails
    too: at worst a peer that had finished the collectives redoes the step with it (one
    failed round, nothing wrong committed), never a wait for the timeout. ``commit_failures``
    is kept in the signature for that reason, documented, not used."""
    del commit_failures
    return step - 1


def revoke_for_request(lease: Quorum | None, requester: str, step: int, commit_failures: int) -> Revoke | None:
    """The revoke a Quorum request causes, or None (no lease in force).

    A member asking for a quorum itself (it failed a step, needs to shrink, or lost its
    lease) takes part in no later round of the lease; anyone else asking is a replica
    waiting to join, and the members' next round must ask so that the lighthouse can form
    a quorum that takes it in."""
    if lease is None:
        return None
    if requester in lease.replica_id_set:
        return Revoke(lease.quorum_id, "member_asked", f"member {requester} asked for a quorum at step {step}",
                      requester, after_step(step, commit_failures))
    return Revoke(lease.quorum_id, "joiner", f"replica {requester} asks to join")


def revoke_at_attach(lease: Quorum | None, replica_id: str, held: int, quorum_id: int) -> Revoke | None:
    """What a replica (re)attaching with lease ``held`` (0: none) must be told.

    When the lease in force has it as a member, it may keep it: a revoke of every older
    id (one still in flight from before the stream broke) is all it needs. Otherwise
    every lease up to the lighthouse's last ``quorum_id`` is revoked: a revoke pushed
    while its stream was down never reached it, and a grant still on its way must not be
    taken up (this lighthouse may have restarted and knows no lease at all)."""
    if lease is not None and replica_id in lease.replica_id_set:
        return Revoke(lease.quorum_id - 1, "stale", "older leases") if lease.quorum_id > 1 else None
    upto = max(quorum_id, held)
    if upto <= 0:
        return None
    return Revoke(upto, "stale", f"the lighthouse holds no lease of quorum {held} for {replica_id}" if held
                  else "no lease is in force for this replica")


def left_notice(revoked: Quorum | None, left_sent: bool, requester: str, step: int,
                commit_failures: int) -> Revoke | None:
    """The notice a member of a just-revoked lease causes when it asks, or None.

    A revoke reaches the members a moment apart, so one may start a round on the lease
    just before it hears the revoke while another, which heard it first, asks the
    lighthouse for that same round instead. The first member to ask after the revoke
    tells the others that it takes part in no round of the lease past ``after_step``:
    whoever started such a round fails it at once and asks too, instead of waiting for a
    collective that can never finish. One notice per revoke is enough (the members are at
    the same step), and none when the revoke itself named a member that asked."""
    if revoked is None or left_sent or requester not in revoked.replica_id_set:
        return None
    return Revoke(revoked.quorum_id, "member_asked", f"member {requester} asked for a quorum at step {step}",
                  requester, after_step(step, commit_failures))


class LeaseDesk:
    """The lease in force (at most one: the last quorum, when it was granted), and the
    rule that the quorum after a revoke gets a new id, so that a member still on a revoked
    lease never shares a process group with the members that moved on."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.lease: Quorum | None = None
        self.revoked_lease: Quorum | None = None  # the lease revoked since the last quorum formed
        self.left_sent = False  # a member of it asked and the others were told (left_notice)
        self.left: Revoke | None = None  # that notice (or the member_asked revoke), replayed at re-attach
        self.fresh_id = False
        self.report_every = 1  # of the lease in force (see report_every())
        self.granted = 0
        self.revoked = 0

    def grant(self, quorum: Quorum, takes_leases: Mapping[str, bool]) -> str | None:
        """Called for every quorum formed: grants it (returns None) or says why not. A
        quorum formed after a revoke has a new id; the desk's rule is spent by it."""
        self.fresh_id = False
        self.revoked_lease, self.left_sent, self.left = None, False, None
        why = grant_refusal(quorum.replica_ids, takes_leases, self.enabled)
        self.lease = quorum if why is None else None
        if why is None:
            self.granted += 1
            self.report_every = report_every(len(quorum.members))
        return why

    def revoke(self, revoke: Revoke | None) -> Revoke | None:
        """End the lease ``revoke`` names (when it is the one in force); the next quorum
        gets a new id. Returns the revoke when a lease ended, else None."""
        if revoke is None or self.lease is None or self.lease.quorum_id > revoke.quorum_id:
            return None
        self.revoked_lease, self.left_sent = self.lease, bool(revoke.replica_id)
        self.left = revoke if revoke.replica_id else None
        self.lease = None
        self.fresh_id = True
        self.revoked += 1
        return revoke

    def restored(self, last: Quorum | None) -> None:
        """A lighthouse starting on saved state (a restart, an HA election): its last
        quorum may be leased by groups that this process never told anything. Treat it as
        a just-revoked lease: the first member to ask tells the others (left_notice), and
        the next quorum gets a new id."""
        if last is not None and self.enabled and len(last.members) >= 2:  # a quorum of one is never leased
            # No new id here: a member that held the lease re-attaches with it, and that bumps
            # the id (revoke_at_attach); a restored quorum nobody leased keeps its fast path.
            self.revoked_lease, self.left_sent, self.left = last, False, None

    def holds(self, replica_id: str) -> int:
        """The quorum_id of the lease in force when ``replica_id`` is a member, else 0."""
        lease = self.lease
        return lease.quorum_id if lease is not None and replica_id in lease.replica_id_set else 0

    def status(self) -> dict:
        lease = self.lease
        return {
            "enabled": self.enabled,
            "quorum_id": lease.quorum_id if lease is not None else None,
            "members": list(lease.replica_ids) if lease is not None else [],
            "report_every": self.report_every if lease is not None else None,
            "granted_total": self.granted,
            "revoked_total": self.revoked,
        }


__all__ = ["REPORTS_PER_STEP", "REVOKE_REASONS", "report_every", "LeaseDesk", "Revoke", "after_step", "grant_refusal", "left_notice", "revoke_at_attach",
           "revoke_for_request"]
