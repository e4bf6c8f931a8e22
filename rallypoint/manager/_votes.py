"""Who may speak for a group rank, and the group's commit vote: the ManagerServer's rules
that decide whether a step commits, apart from its gRPC shell (the vote's folding and
decision are pure functions in :mod:`rallypoint.manager.rules`; this keeps the futures).

Why rank keys: the job token says a caller belongs to the job, not which rank it is. Any
token holder could otherwise vote True for another rank (and a step that rank failed
would commit) or send a ``Quorum`` for another rank that rewrites where healing peers
fetch that rank's state. So each rallypoint rank sends a random key of its own
(:data:`RANK_KEY_HEADER`) with its ``Quorum`` and ``ShouldCommit`` calls; the server binds
the first key it sees for a rank to that rank for its own lifetime, and refuses every
other caller for it. When the server can read the group's store (a Manager's group rank
0), that first key must also be the one the rank published there (its digest, under
:data:`RANK_KEY_STORE_KEY`, written before the rank's first call): the binding goes to the
rank the group's own store names, not to whichever token holder called first. A rank that restarts restarts its whole replica group (torchrun
and ``rallypoint run`` do), so the new server has no binding yet. torchft's clients send
no key: a rank that never sent one keeps torchft's rules (no binding).

The vote: a decision exists only once every rank of the group voted for that step; any
False wins and stands (a later True for the same rank and step changes nothing); a
decided step answers the same decision to a retry; a vote for another step is counted
only for that step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from rallypoint.manager.rules import fold_vote, vote_decision

log = logging.getLogger("rallypoint.manager")

#: gRPC metadata key carrying a rank's key (lower case, as gRPC requires).
RANK_KEY_HEADER = "x-rallypoint-rank-key"
#: Longest rank key accepted (ours are 32 hex characters).
MAX_RANK_KEY_CHARS = 128
#: Decided rounds remembered, so a retried vote gets the same answer.
DECIDED_KEEP = 16


def new_rank_key() -> str:
    """A fresh random key for one rank's client (never logged, never stored)."""
    return secrets.token_hex(16)


def claim_rank(bound: Mapping[int, str], rank: int, key: str | None) -> str | None:
    """Whether a caller presenting ``key`` may speak for ``rank``, given the keys bound so
    far: None if it may (the caller then binds ``key`` if the rank had none), else why not."""
    if key is not None and not (0 < len(key) <= MAX_RANK_KEY_CHARS):
        return f"the {RANK_KEY_HEADER} metadata must be 1..{MAX_RANK_KEY_CHARS} characters"
    held = bound.get(rank)
    if held is None:
        return None
    if key is None:
        return (f"group rank {rank} is held by a rallypoint rank that identifies itself with a rank key; "
                "a caller without it may not speak for that rank")
    if not hmac.compare_digest(held.encode(), key.encode()):
        return (f"group rank {rank} is held by another process (a different rank key); two processes claim "
                "the same group rank, or a rank restarted without its replica group: restart the whole group")
    return None


#: The group's store key under which group rank ``rank`` publishes its rank key's digest.
RANK_KEY_STORE_KEY = "rank_key/{rank}"


def rank_key_digest(key: str) -> str:
    """What a rank publishes in the group's store for its rank key: a digest, so whoever
    reads the store learns nothing it could present to the server."""
    return hashlib.sha256(b"rallypoint-rank-key\n" + key.encode("utf-8", "replace")).hexdigest()


def confirm_rank(published: str | None, rank: int, key: str | None) -> str | None:
    """Whether the group's own store confirms ``key`` for ``rank`` (``published``: the
    digest rank ``rank`` wrote there, None if none): None if it does (or the caller sent no
    key: torchft's rules), else why not. Checked before a rank's first key is bound, so the
    binding goes to the rank the store names, not to the first caller."""
    if key is None:
        return None
    if published is None:
        return (f"group rank {rank} has published no rank key in the group's store "
                f"({RANK_KEY_STORE_KEY.format(rank=rank)}); only that rank's own process may speak for it")
    if not hmac.compare_digest(published.encode(), rank_key_digest(key).encode()):
        return (f"the rank key is not the one group rank {rank} published in the group's store; another process "
                "claims that rank (or it restarted without its replica group: restart the whole group)")
    return None


def new_future() -> asyncio.Future:
    """A future on the running loop whose unobserved failure is not logged (the server's
    rounds use it: a failure nobody is left waiting for is not worth a warning)."""
    fut = asyncio.get_running_loop().create_future()
    # A failure nobody is left waiting for (every rank gave up) is not worth a warning.
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


@dataclass
class CommitRound:
    """The votes of one step, and the decision every voter waits on."""

    votes: dict[int, bool] = field(default_factory=dict)
    decision: asyncio.Future = field(default_factory=new_future)


class CommitVotes:
    """The group's should_commit rounds (used on the server's event loop only).

    ``superseded(old, new)`` builds the exception given to the waiters of an older step
    that can never be decided once step ``new`` is; ``on_decided(step, decision)`` runs
    once per decision, before any voter hears it (the next round's hand-out)."""

    def __init__(self, world_size: int, label: str, superseded: Callable[[int, int], Exception],
                 on_decided: Callable[[int, bool], None] | None = None) -> None:
        self.world_size = world_size
        self.label = label
        self.rounds: dict[int, CommitRound] = {}
        self.decided: dict[int, bool] = {}
        self._superseded = superseded
        self._on_decided = on_decided  # called once per decision, before any voter hears it

    def forget_decisions(self) -> None:
        """A new quorum round is a new attempt: a remembered decision (a failed step being
        retried) must not answer it."""
        self.decided.clear()

    async def vote(self, rank: int, step: int, vote: bool) -> bool:
        """Count ``rank``'s vote for ``step`` and wait for the group's decision.
        Cancelling the caller withdraws an undecided vote."""
        if step in self.decided:
            return self.decided[step]
        rnd = self.rounds.get(step)
        if rnd is None:
            rnd = self.rounds[step] = CommitRound()
        # A False stands (rules.fold_vote): a later True for the same rank and step
        # (a retry, or a forged vote) cannot turn a failed step into a committed one.
        rnd.votes = fold_vote(rnd.votes, rank, vote)
        decision = vote_decision(rnd.votes, self.world_size)
        if decision is not None:
            self._decide(step, rnd, decision)
        try:
            return await asyncio.shield(rnd.decision)
        except asyncio.CancelledError:
            if not rnd.decision.done() and self.rounds.get(step) is rnd:
                rnd.votes.pop(rank, None)
                if not rnd.votes:
                    del self.rounds[step]
            raise

    def _decide(self, step: int, rnd: CommitRound, decision: bool) -> None:
        del self.rounds[step]
        self.decided[step] = decision
        while len(self.decided) > DECIDED_KEEP:
            del self.decided[min(self.decided)]
        if decision:  # a line per step per group: the failures are what an operator looks for
            log.debug("[%s] should_commit for step %d: True", self.label, step)
        else:
            log.info("[%s] should_commit for step %d: False (votes %s)", self.label, step, dict(sorted(rnd.votes.items())))
        if self._on_decided is not None:
            self._on_decided(step, decision)
        rnd.decision.set_result(decision)
        # Older undecided rounds can never be used now: release their waiters.
        for old in [s for s in self.rounds if s < step]:
            stale = self.rounds.pop(old)
            if not stale.decision.done():
                stale.decision.set_exception(self._superseded(old, step))

    def fail_all(self, exc_for: Callable[[], Exception]) -> None:
        for rnd in self.rounds.values():
            if not rnd.decision.done():
                rnd.decision.set_exception(exc_for())
        self.rounds.clear()


__all__ = ["DECIDED_KEEP", "MAX_RANK_KEY_CHARS", "RANK_KEY_HEADER", "CommitRound", "CommitVotes", "claim_rank",
           "new_future", "new_rank_key"]
