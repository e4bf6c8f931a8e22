"""The lighthouse's quorum rules as pure functions over plain data.

Nothing here reads a clock, touches the network or mutates its inputs: ``now`` is an
argument and the result is a :class:`Decision`. The gRPC server is a thin shell that
collects heartbeats and pending requests, calls :func:`decide` whenever something
changes (and at ``Decision.next_check``), and answers waiters when a quorum forms.
Keeping the rules here lets tests drive every branch with a table of plain values.

The rules (docs/design.md, "The lighthouse"):

1. healthy = replicas whose last heartbeat is younger than ``heartbeat_timeout``, plus
   every replica with a pending Quorum request (a waiting request keeps its replica
   alive); participants = replicas with a pending Quorum request.
2. Fast path: when a previous quorum exists and all its members are participants, form
   now with all participants (only the previous members if a participant asked
   ``shrink_only``).
3. Otherwise no quorum while participants < ``min_replicas``, or while participants are
   not more than half of the healthy replicas (no split brain).
4. Otherwise wait for healthy replicas that have not asked yet, until ``join_timeout``
   after the first participant asked (members of a just-revoked lease: until
   ``View.expected`` says, if later); then form.
5. Members are sorted by replica_id; ``quorum_id`` increases when the member list
   changes or a member reports ``commit_failures > 0``, and after a lease was revoked
   (``View.fresh_id``; ``leases.py``). Reconfigure handles (torchft 0.3) are carried, not
   compared, as torchft's lighthouse does: torch's native handle embeds the communicator
   id, so it changes at every reconfigure and comparing would reconfigure every step; a
   group that rebuilt its process group (a restart) is already a membership change, a
   commit failure or a revoked lease.

Exclusion (``View.excluded``, set by the straggler policy ``--stragglers evict``,
:mod:`rallypoint.lighthouse.stragglers`): until its cool-down ends, an excluded replica
is not a participant, is not waited for, and does not count among the healthy replicas of
rule 3, nor among the previous members of rule 2's fast path. Its pending request stays
pending (its Quorum call just waits); when the cool-down ends (reported as
``next_check``) it is a participant again and joins the next quorum, behind, so it heals.
Exclusion never takes the job below ``min_replicas``: while fewer than ``min_replicas``
healthy replicas would remain without the excluded ones, the exclusion is waived.

Differences from torchft 0.2.0, on purpose: ``shrink_only`` can never produce an empty
quorum or one below ``min_replicas`` (it restricts the candidates to previous members
and then the usual minimum applies), and the fast path also respects ``min_replicas``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Member:
    """One replica group's request, as carried by ``torchft.QuorumMember``."""

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    commit_failures: int = 0
    data: str = ""
    #: torchft 0.3: each group rank's process-group reconfigure handle (index = group rank;
    #: ``''`` for a rank without one), empty when the group sent none (rallypoint/_net/handles.py)
    reconfigure_handles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Restored from JSON (state file, etcd) the handles are a list: kept as a tuple, so a
        # Member stays hashable and equal to the one that was saved.
        handles = self.reconfigure_handles
        if not isinstance(handles, tuple):
            if not isinstance(handles, (list, tuple)):
                raise TypeError(f"reconfigure_handles must be a list of strings, got {type(handles).__name__}")
            object.__setattr__(self, "reconfigure_handles", tuple(handles))
        if not all(isinstance(h, str) for h in self.reconfigure_handles):
            raise TypeError("reconfigure_handles must be a list of strings")


@dataclass(frozen=True)
class Quorum:
    """A formed quorum. ``created`` is wall-clock seconds since the epoch."""

    quorum_id: int
    members: tuple[Member, ...]
    created: float = 0.0

    @functools.cached_property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)

    @functools.cached_property
    def replica_id_set(self) -> frozenset[str]:
        return frozenset(self.replica_ids)

    @property
    def participants(self) -> list[Member]:
        """The members as torchft's ``Quorum.participants`` names them (a list, as its
        binding returns), so torchft code reading a quorum from our client runs unchanged."""
        return list(self.members)


@dataclass(frozen=True)
class Pending:
    """A participant: a replica with an outstanding Quorum request since ``joined``."""

    member: Member
    joined: float


@dataclass(frozen=True)
class Options:
    """Rule parameters, in seconds."""

    min_replicas: int
    join_timeout: float = 60.0
    heartbeat_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if not (self.join_timeout >= 0 and self.heartbeat_timeout > 0):  # also refuses NaN
            raise ValueError(
                f"join_timeout must be >= 0 and heartbeat_timeout > 0, got "
                f"{self.join_timeout} and {self.heartbeat_timeout}"
            )


@dataclass(frozen=True)
class View:
    """What the rules look at: heartbeats (monotonic seconds), pending requests, the
    previous quorum, the last quorum_id handed out, and the excluded replicas (replica ->
    monotonic time its exclusion ends; an entry at or before ``now`` is no exclusion)."""

    heartbeats: Mapping[str, float] = field(default_factory=dict)
    pending: Mapping[str, Pending] = field(default_factory=dict)
    previous: Quorum | None = None
    quorum_id: int = 0
    excluded: Mapping[str, float] = field(default_factory=dict)
    #: A lease was revoked since the last quorum: the next one gets a new id (leases.py).
    fresh_id: bool = False
    #: Members of a just-revoked lease that have not asked yet -> monotonic time until which
    #: they are waited for even past join_timeout: they are finishing a round on the lease
    #: and ask at its end (leases.py; LEASES.md, "A joiner arrives").
    expected: Mapping[str, float] = field(default_factory=dict)


class Rule(str, enum.Enum):
    """Which rule produced a decision; also the label of the decisions metric."""

    FAST_PATH = "fast_path"
    FORMED = "formed"
    FORMED_AFTER_JOIN_TIMEOUT = "formed_after_join_timeout"
    NO_PARTICIPANTS = "no_participants"
    WAIT_MIN_REPLICAS = "wait_min_replicas"
    WAIT_MAJORITY = "wait_majority"
    WAIT_STRAGGLERS = "wait_stragglers"


@dataclass(frozen=True)
class Decision:
    """Outcome of one evaluation.

    ``members`` is the sorted member list when a quorum forms, else ``None``.
    ``quorum_id`` is the id the formed quorum carries (unchanged when waiting).
    ``next_check`` is the monotonic time at which the decision could change with no new
    input (a heartbeat expiring, the join timeout passing); ``None`` when only new input
    can change it.
    """

    rule: Rule
    reason: str
    members: tuple[Member, ...] | None = None
    quorum_id: int = 0
    next_check: float | None = None

    @property
    def formed(self) -> bool:
        return self.members is not None


def healthy_replicas(now: float, view: View, options: Options) -> set[str]:
    """Replicas heard from within ``heartbeat_timeout``, plus every pending requester."""
    # Written as ``last + timeout > now`` (not ``last > now - timeout``) so that it is the
    # exact float expression _expiry_check reports as next_check: decided at that
    # next_check, the heartbeat has expired, never reported again as next_check == now.
    timeout = options.heartbeat_timeout
    healthy = {rid for rid, last in view.heartbeats.items() if last + timeout > now}
    healthy.update(view.pending)
    return healthy


def next_quorum_id(previous: Quorum | None, quorum_id: int, members: tuple[Member, ...], fresh: bool = False) -> int:
    """Rule 5: a new id when membership changed or anyone reports commit failures, and
    (``fresh``) after a lease was revoked. Reconfigure handles do not count (module docstring)."""
    if fresh or previous is None or previous.replica_ids != tuple(m.replica_id for m in members):
        return quorum_id + 1
    if any(m.commit_failures > 0 for m in members):
        return quorum_id + 1
    return quorum_id


def _expiry_check(
    now: float, view: View, options: Options, healthy: set[str], pending: Mapping[str, Pending]
) -> float | None:
    """Earliest time a healthy non-participant's heartbeat expires (changes rule 3/4)."""
    times = [
        view.heartbeats[rid] + options.heartbeat_timeout
        for rid in healthy
        if rid not in pending and rid in view.heartbeats
    ]
    return min(times) if times else None


def exclusion(now: float, view: View, options: Options, healthy: set[str]) -> tuple[frozenset[str], float | None, str]:
    """The replicas left out of this decision, when their exclusion next changes, and a
    note for the reason (empty when nothing is excluded).

    Only healthy replicas matter (an excluded replica that went silent is out anyway).
    When fewer than ``min_replicas`` healthy replicas would remain, nobody is left out:
    exclusion is a performance measure and must never stop the job.
    """
    active = {rid: until for rid, until in view.excluded.items() if until > now and rid in healthy}
    if not active:
        return frozenset(), None, ""
    shown = ", ".join(sorted(active)[:5]) + (" ..." if len(active) > 5 else "")
    if len(healthy) - len(active) < options.min_replicas:
        return frozenset(), None, f", exclusion of {shown} waived (min_replicas={options.min_replicas})"
    return frozenset(active), min(active.values()), f", {len(active)} excluded ({shown})"


def _min_time(*times: float | None) -> float | None:
    present = [t for t in times if t is not None]
    return min(present) if present else None


def decide(now: float, view: View, options: Options) -> Decision:
    """Apply the rules once. Pure: same inputs, same decision."""
    healthy = healthy_replicas(now, view, options)
    excluded, excluded_check, excluded_note = exclusion(now, view, options, healthy)
    pending: Mapping[str, Pending] = view.pending
    previous = view.previous
    prev_ids = previous.replica_id_set if previous is not None else frozenset()
    # When an excluded replica that is still asking gets back in: decide again then.
    readmit_check = min((view.excluded[rid] for rid in excluded if rid in view.pending), default=None)
    if excluded:
        pending = {rid: p for rid, p in pending.items() if rid not in excluded}
        healthy = healthy - excluded
        prev_ids = prev_ids - excluded
    shrink_only = any(p.member.shrink_only for p in pending.values())

    candidates = list(pending)
    restricted = False
    shrinking = False
    if shrink_only and previous is not None:
        kept = [rid for rid in candidates if rid in prev_ids]
        # Shrink-only keeps newcomers out, but only relative to a previous quorum that
        # still has someone asking; with nobody from it left there is nothing to shrink.
        if kept:
            shrinking = True
            restricted = len(kept) != len(candidates)
            candidates = kept
    candidates.sort()
    n = len(candidates)
    tag = (
        f"[{n} candidates, {len(pending)} participating, {len(healthy)} healthy, "
        f"shrink_only={shrink_only}{', newcomers held back' if restricted else ''}{excluded_note}]"
    )

    if not pending:
        return Decision(
            Rule.NO_PARTICIPANTS, f"no quorum requests pending {tag}", quorum_id=view.quorum_id,
            next_check=readmit_check,
        )

    def formed(rule: Rule, why: str) -> Decision:
        members = tuple(pending[rid].member for rid in candidates)
        qid = next_quorum_id(previous, view.quorum_id, members, view.fresh_id)
        change = "same members" if qid == view.quorum_id else f"quorum_id {view.quorum_id} -> {qid}"
        return Decision(rule, f"{why}; {change} {tag}", members=members, quorum_id=qid, next_check=readmit_check)

    expiry = _min_time(_expiry_check(now, view, options, healthy, pending), excluded_check)

    if n < options.min_replicas:
        return Decision(
            Rule.WAIT_MIN_REPLICAS,
            f"waiting: {n} candidate(s), need min_replicas={options.min_replicas} {tag}",
            quorum_id=view.quorum_id,
            next_check=expiry,
        )

    if previous is not None and prev_ids and prev_ids.issubset(pending):
        return formed(Rule.FAST_PATH, "fast path: every member of the previous quorum is asking")

    # Rule 3 counts participants (every pending requester, as torchft does), not only
    # the candidates: newcomers held back by shrink_only are still asking and must not
    # count against the quorum, or it would wait forever for them to go away.
    if 2 * len(pending) <= len(healthy):
        return Decision(
            Rule.WAIT_MAJORITY,
            f"waiting: {len(pending)} participant(s) are not more than half of {len(healthy)} healthy replicas "
            f"(split-brain guard) {tag}",
            quorum_id=view.quorum_id,
            next_check=expiry,
        )

    # While shrink_only is in force only previous members could still join: do not wait
    # for a healthy newcomer that would be held back anyway.
    stragglers = sorted(
        rid for rid in healthy if rid not in pending and (not shrinking or rid in prev_ids)
    )
    if stragglers:
        first_joined = min(pending[rid].joined for rid in candidates)
        deadline = first_joined + options.join_timeout
        due = [view.expected[rid] for rid in stragglers if rid in view.expected]
        if due:
            deadline = max(deadline, max(due))
        if now < deadline:
            shown = ", ".join(stragglers[:5]) + (" ..." if len(stragglers) > 5 else "")
            return Decision(
                Rule.WAIT_STRAGGLERS,
                f"valid quorum of {n}, waiting up to {deadline - now:.3f}s for "
                f"{len(stragglers)} healthy straggler(s) ({shown}) {tag}",
                quorum_id=view.quorum_id,
                next_check=_min_time(deadline, expiry),
            )
        return formed(
            Rule.FORMED_AFTER_JOIN_TIMEOUT,
            f"formed without {len(stragglers)} straggler(s) after join_timeout",
        )
    return formed(Rule.FORMED, "every healthy candidate is asking")


def forgettable(now: float, heartbeats: Mapping[str, float], pending: Mapping[str, Pending], horizon: float) -> list[str]:
    """Replicas silent for longer than ``horizon`` seconds and not waiting: safe to
    drop from memory so state and /status stay small when many ids come and go."""
    limit = now - horizon
    return [rid for rid, last in heartbeats.items() if last < limit and rid not in pending]
