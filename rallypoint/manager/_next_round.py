"""The next round, handed out with the commit vote: on a quorum lease, the ranks of a replica
group with several ranks take their next round from the answer to their vote instead of
asking group rank 0's ``ManagerServer`` for it.

Why: every step, each rank of such a group made two calls to its group's server, ``Quorum``
and ``ShouldCommit``. On a lease (``rallypoint/lighthouse/LEASES.md``) the answer to the next
``Quorum`` is known the moment the vote passes: the same members, every one a step further.
So when the whole group voted to commit and every rank asked for it (:data:`NEXT_ROUND_HEADER`
with its vote), the server takes the lease for the next step right then, at the decision,
and tells each rank in its vote's answer the next step and a digest of the exact result it
would answer that rank's ``Quorum`` for that step with (:data:`NEXT_ROUND_KEY`). The rank
derives that result from its current one (:func:`steady_next`: in a steady round only
``max_step`` moves), checks the digest, and starts its next round from it: one call per
step instead of two.

Safe whichever way a rank goes: the server answers a ``Quorum`` for the handed-out step with
the very same quorum, so a rank that does not take the hand-out (a digest that does not
match, a torchft client, a changed checkpoint address, a ``shrink_only`` ask) asks as before
and gets what its peers took. What changes: the lease is taken at the vote, not when the
ranks next ask, so a revoke that arrives in between takes effect one step later (the next
round still runs on the old quorum; a member that died fails that round, as on any lease,
and the round after asks the lighthouse), and a ``shrink_only`` asked for in that round
applies to the round after it. The ranks' step stats of a handed-out round ride their next
vote and are reported when it is decided. ``RALLYPOINT_LEASES=0`` turns this off with the
leases.

The pure parts are here (encoding, the derivation, the rule for using a held round);
:class:`NextRound` is a client's bookkeeping; the server's side is
:mod:`rallypoint.manager._server_next`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from rallypoint.manager._result_pb import result_to_pb
from rallypoint.manager.recovery import QuorumResult
from rallypoint.manager.rules import STEP_STATS_HEADER, encode_step_stats

log = logging.getLogger("rallypoint.manager.client")

#: Invocation metadata of a ``ShouldCommit`` whose rank takes its next round from the answer.
NEXT_ROUND_HEADER = "x-rallypoint-next-round"
#: Trailing metadata of the answer: ``"<next step> <digest>"`` (:func:`encode_next`).
NEXT_ROUND_KEY = "rallypoint-next-round"
#: The longest value of :data:`NEXT_ROUND_KEY` a client reads (a step and 32 hex digits fit).
MAX_NEXT_ROUND_CHARS = 64
_DIGEST_CHARS = 32


def result_digest(r: QuorumResult) -> str:
    """A digest of the fields of ``r`` that torchft's answer carries (32 hex digits):
    what a rank compares the result it derived with."""
    return hashlib.sha256(result_to_pb(r).SerializeToString(deterministic=True)).hexdigest()[:_DIGEST_CHARS]


def encode_next(step: int, digest: str) -> str:
    """The value of :data:`NEXT_ROUND_KEY` for the round at ``step``."""
    return f"{step} {digest}"


def parse_next(value: Any) -> tuple[int, str] | None:
    """``(step, digest)`` from a :data:`NEXT_ROUND_KEY` value, or None when it is missing,
    too long or malformed (the rank then asks, which is always right)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or len(value) > MAX_NEXT_ROUND_CHARS:
        return None
    parts = value.split(" ")
    if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != _DIGEST_CHARS:
        return None
    if any(c not in "0123456789abcdef" for c in parts[1]):
        return None
    return int(parts[0]), parts[1]


def steady_next(q: QuorumResult, step: int) -> QuorumResult | None:
    """The result of the round at ``step`` on the same lease, derived from ``q`` (the round
    just before it), or None when ``q`` was not a steady round: someone healed or served,
    a member was at another step, the group had failed a step, or it carried injections.
    In a steady round every member is at the same step, so the next result differs only in
    ``max_step`` (the server's digest confirms it)."""
    if q.heal or q.recover_src_replica_rank is not None or q.recover_dst_replica_ranks \
            or q.recover_src_replica_ranks or q.stripe_dst_replica_ranks or q.inject or q.commit_failures \
            or q.max_world_size != q.replica_world_size or q.max_replica_rank != q.replica_rank \
            or q.max_step + 1 != step:
        return None
    return dataclasses.replace(q, max_step=step)


@dataclass(frozen=True)
class Held:
    """A round handed out with the last vote, for one rank."""

    group_rank: int
    step: int
    checkpoint_metadata: str  # what the rank last sent: the server still holds it
    result: QuorumResult


def held_refusal(held: Held | None, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                 commit_failures: int) -> str | None:
    """Why the rank must ask for its round at ``step`` instead of taking ``held``, or None
    when it may take it. Asking is always right (the server answers with the same quorum);
    taking needs the round to be the one handed out, and nothing the rank would tell the
    server to have changed."""
    if held is None:
        return "no round handed out"
    if held.group_rank != group_rank:
        return f"handed out to group rank {held.group_rank}, not {group_rank}"
    if held.step != step:
        return f"handed out for step {held.step}, the round is at step {step}"
    if commit_failures:
        return "the group failed its last step"
    if shrink_only:
        return "shrink_only asks the lighthouse"
    if held.checkpoint_metadata != checkpoint_metadata:
        return "the checkpoint metadata changed: the server must get it"
    return None


class NextRound:
    """One client's side (see the module's docstring): what it last asked for, the round
    handed out with its last vote, and the step stats that ride its next vote. Used from
    one rank's Manager, whose quorum and vote calls never overlap."""

    def __init__(self) -> None:
        self._last: tuple[int, str, QuorumResult] | None = None  # group rank, metadata, result
        self._held: Held | None = None
        self._stats: dict[str, Any] | None = None
        self.taken = 0  # rounds started from a hand-out (for tests and benchmarks)

    def asked(self, group_rank: int, checkpoint_metadata: str, result: QuorumResult) -> None:
        """The rank asked the server for its round and got ``result``."""
        self._last, self._held, self._stats = (group_rank, checkpoint_metadata, result), None, None

    def take(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool, commit_failures: int,
             step_stats: dict[str, Any] | None) -> QuorumResult | None:
        """The round at ``step`` from the hand-out, or None (then the rank asks). The
        round's ``step_stats`` go with its vote."""
        held, self._held = self._held, None
        why = held_refusal(held, group_rank, step, checkpoint_metadata, shrink_only, commit_failures)
        if why is not None or held is None:
            if held is not None:
                log.debug("group rank %d asks for step %d instead of the handed-out round: %s", group_rank, step, why)
            return None
        self._last, self._stats = (group_rank, checkpoint_metadata, held.result), step_stats
        self.taken += 1
        return held.result

    def vote_metadata(self) -> list[tuple[str, str]]:
        """The invocation metadata this rank's next vote adds: the ask for a hand-out, and
        the step stats of a handed-out round (sent once)."""
        stats, self._stats = self._stats, None
        out = [(NEXT_ROUND_HEADER, "1")]
        if stats is not None:
            out.append((STEP_STATS_HEADER, encode_step_stats(stats)))
        return out

    def voted(self, group_rank: int, step: int, decision: bool, trailing: Any) -> None:
        """The vote for ``step`` came back with ``decision`` and the answer's ``trailing``
        metadata: hold the next round when one was handed out and the derived result
        matches the server's digest."""
        self._held = None
        last = self._last
        if not decision or last is None or last[0] != group_rank:
            return
        got = parse_next(next((v for k, v in (trailing or ()) if k == NEXT_ROUND_KEY), None))
        if got is None or got[0] != step + 1:
            return
        derived = steady_next(last[2], got[0])
        if derived is None or result_digest(derived) != got[1]:
            log.debug("group rank %d: the round handed out for step %d is not the one derived; it will ask",
                      group_rank, got[0])
            return
        self._held = Held(group_rank, got[0], last[1], derived)


__all__ = ["MAX_NEXT_ROUND_CHARS", "NEXT_ROUND_HEADER", "NEXT_ROUND_KEY", "Held", "NextRound", "encode_next",
           "held_refusal", "parse_next", "result_digest", "steady_next"]
