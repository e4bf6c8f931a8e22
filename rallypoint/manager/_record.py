"""One record per round: what happened between one ``start_quorum`` and its
``should_commit``.

Why one object: the guards read the same facts -- the lighthouse scores stragglers from
the step-time split each group reports, the goodput ledger sums rounds by outcome, the
corruption checks name the round they failed. Scattered counters on the ``Manager``
(which round the quorum arrived in, which round served a heal, ...) had to be read
together and could disagree. A :class:`StepRecord` is created by ``start_quorum``,
filled in by the quorum thread and the training thread, and closed by
``should_commit``; ``Manager.step_records()`` keeps the last :data:`KEEP` of them.

The split of a step's time (all seconds, on this rank's clock):

- ``step_s``: from the end of the previous round (its ``should_commit``) to the end of
  this one; the first round counts from its ``start_quorum``.
- ``quorum_wait_s``: the training thread blocked waiting for the quorum (an async quorum
  that arrives during forward costs nothing here).
- ``heal_s``: the training thread fetching and applying a heal, or serving one
  (``heal_on_training_thread``); a quorum-thread transfer shows up as quorum wait. Only
  the part before the first collective comes off ``compute_s``.
- ``compute_s``: the time before this round's first cross-replica collective, less the
  two above: forward and the start of backward (and the previous optimizer step). It is
  the part of a step that no peer can slow down, which is why straggler scores use it: a
  fast group waiting for a slow one waits inside its collectives, so its wait lands in
  ``comm_s`` and the slow group's own slowness in ``compute_s``. Without a collective,
  everything up to the commit vote.
- ``comm_s``: from the first collective issued to the last one finished.
- ``commit_s``: ``should_commit`` from its start: the corruption checks' exchange (when
  on) and the commit vote (its barrier with the group).
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rallypoint.manager.recovery import QuorumResult

#: Rounds a Manager remembers (``Manager.step_records()``).
KEEP = 256
#: What the ManagerServer accepts (``rules.MAX_STEP_STATS_BYTES``), less a margin.
MAX_STATS_BYTES = 1000


def _secs(x: float) -> float:
    """Seconds rounded to microseconds, never negative (clocks of two threads)."""
    return round(max(0.0, x), 6) if math.isfinite(x) else 0.0


def cause_of(e: BaseException) -> str:
    """Why a round failed, from its first error (for the goodput ledger's buckets): a peer
    the lighthouse reported dead, a collective that failed, the quorum, an injected fault,
    a corruption check, or anything else."""
    text = str(e)
    if text.startswith("injected fault") or "injected fault" in text[:200]:
        return "injected"
    if text.startswith("silent data corruption"):
        return "sdc"
    if isinstance(e, ConnectionError) and "went down" in text:
        return "peer_down"
    if "quorum" in text[:200] and isinstance(e, (TimeoutError, ConnectionError, ValueError)):
        return "quorum"
    if isinstance(e, (ConnectionError, TimeoutError)) or "allreduce" in text[:200] or "Gloo" in text[:200] \
            or "NCCL" in text[:200] or "abort" in text[:200].lower():
        return "comm"
    return "error"


@dataclass
class StepRecord:
    """What happened in one round (see the module docstring for the time split).

    ``step`` is the step the round ran at (as exchanged with peers); ``outcome`` is
    ``"pending"`` until ``should_commit`` returns, then ``"committed"`` or ``"failed"``
    (``error`` says why: the first error the step recorded, or the vote's), or
    ``"abandoned"`` when the next ``start_quorum`` came without a ``should_commit``."""

    round: int
    step: int
    since: float  # monotonic: the end of the previous round (or this round's start)
    started: float  # monotonic: start_quorum
    quorum_id: int | None = None
    replica_rank: int | None = None
    replica_world_size: int = 0
    participants: tuple[str, ...] = ()
    participating_rank: int | None = None
    participating_world_size: int = 0
    max_step: int | None = None
    reconfigured: bool = False
    healing: bool = False
    heal_source: int | None = None  # the replica rank healed from
    served_to: tuple[int, ...] = ()  # replica ranks that may fetch our state this round
    quorum_arrived: float | None = None  # monotonic
    configure_s: float = 0.0
    quorum_wait_s: float = 0.0
    heal_s: float = 0.0
    heal_before_s: float = 0.0  # the part of heal_s before the first collective (comes off compute_s)
    first_collective: float | None = None  # monotonic: the first collective issued
    last_collective_done: float | None = None  # monotonic: the last one finished
    collectives: int = 0
    commit_started: float | None = None
    ended: float | None = None
    outcome: str = "pending"
    error: str | None = None
    cause: str | None = None  # why it failed, one of rules.STEP_CAUSES (see cause_of)
    extra: dict[str, Any] = field(default_factory=dict)  # what guards add (checks, injections)

    # ------------------------------------------------------------------ derived
    @property
    def spare(self) -> bool:
        """In the quorum but not contributing (FIXED_WITH_SPARES beyond min size, or a
        synchronous heal's first round)."""
        return self.quorum_id is not None and self.participating_rank is None and not self.healing

    @property
    def quorum_s(self) -> float | None:
        """From ``start_quorum`` to the quorum's answer (on the quorum thread)."""
        return None if self.quorum_arrived is None else _secs(self.quorum_arrived - self.started)

    @property
    def step_s(self) -> float | None:
        return None if self.ended is None else _secs(self.ended - self.since)

    @property
    def commit_s(self) -> float | None:
        if self.ended is None or self.commit_started is None:
            return None
        return _secs(self.ended - self.commit_started)

    @property
    def compute_s(self) -> float | None:
        if self.ended is None:
            return None
        until = self.first_collective if self.first_collective is not None else self.commit_started
        if until is None:
            until = self.ended
        return _secs(until - self.since - self.quorum_wait_s - self.heal_before_s)

    @property
    def comm_s(self) -> float:
        if self.first_collective is None or self.last_collective_done is None:
            return 0.0
        return _secs(self.last_collective_done - self.first_collective)

    @property
    def kind(self) -> str:
        """How the round counts for the guards: ``healing`` and ``spare`` rounds did no
        comparable work; otherwise the outcome."""
        if self.healing:
            return "healing"
        if self.spare and self.outcome == "committed":
            return "spare"
        return "committed" if self.outcome == "committed" else "failed"  # "abandoned": no should_commit

    # ------------------------------------------------------------------ views
    def stats(self) -> dict[str, Any] | None:
        """The step statistics reported to the lighthouse with the next quorum request
        (``x-rallypoint-step-stats``); None while the round is still open."""
        if self.ended is None:
            return None
        stats = {
            "step": self.step,
            "round": self.round,
            "outcome": self.kind,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "quorum_wait_s": _secs(self.quorum_wait_s),
            "comm_s": self.comm_s,
            "heal_s": _secs(self.heal_s),
            "commit_s": self.commit_s,
            "configure_s": _secs(self.configure_s),
            "cause": self.cause if self.kind == "failed" else None,
            "ckpt": self.extra.get("ckpt"),  # a DurableCheckpoint's figures (rules.check_ckpt)
        }
        if self.kind == "failed" and self.cause == "sdc" and self.extra.get("sdc_failed"):
            stats["sdc"] = self.extra["sdc_failed"]
            names = [str(n)[:256] for n in self.extra.get("sdc_bad", [])][:8]
            # The server refuses stats over MAX_STATS_BYTES: name fewer groups rather than lose the round.
            while names and len(json.dumps({**stats, "sdc_bad": names}, separators=(",", ":"))) > MAX_STATS_BYTES:
                names.pop()
            stats["sdc_bad"] = names
        return {k: v for k, v in stats.items() if v is not None}  # an abandoned round never voted

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view (the raw monotonic stamps left out: they mean nothing elsewhere)."""
        d = asdict(self)
        for k in ("since", "started", "quorum_arrived", "first_collective", "last_collective_done",
                  "commit_started", "ended"):
            d.pop(k)
        d["participants"] = list(self.participants)
        d["served_to"] = list(self.served_to)
        d.update(spare=self.spare, quorum_s=self.quorum_s, step_s=self.step_s, compute_s=self.compute_s,
                 comm_s=self.comm_s, commit_s=self.commit_s, kind=self.kind)
        return d


class RoundLog:
    """The last :data:`KEEP` finished rounds (appended by the training thread; a deque's
    append and read are safe to race with a reader on another thread)."""

    def __init__(self) -> None:
        self._done: deque[StepRecord] = deque(maxlen=KEEP)

    def since(self, now: float) -> float:
        """Where the next round's time starts: the end of the last one (or ``now``)."""
        last = self.last()
        return last.ended if last is not None and last.ended is not None else now

    def close(self, rec: StepRecord, now: float, outcome: str, works: list[Any]) -> None:
        """End ``rec`` (its collectives' last finish time from ``works``) and keep it."""
        done = [w.done_at for w in works if getattr(w, "done_at", None) is not None]
        if done:
            rec.last_collective_done = max(done)
        rec.ended, rec.outcome = now, outcome
        self._done.append(rec)

    def last(self) -> StepRecord | None:
        return self._done[-1] if self._done else None

    def all(self) -> list[StepRecord]:
        return list(self._done)


@dataclass(eq=False)
class Round:
    """One round: its :class:`StepRecord` (what happened, kept afterwards) and the
    hand-offs between the quorum thread and the training thread (dropped at its end)."""

    rec: StepRecord
    heal_plan: QuorumResult | None = None  # a heal to serve/fetch on the training thread
    pending: dict[str, Any] | None = None  # received state, applied at the next safe point
    apply_due: bool = False  # healing: contributes zeros until ``pending`` is applied
    quorum_error: Exception | None = None  # raised by should_commit / wait_quorum
    served_here: bool = False  # the training thread served a heal in this round
    skipped: bool = False  # allreduce skipped a collective (the step had already failed)


__all__ = ["KEEP", "Round", "RoundLog", "StepRecord", "cause_of"]
