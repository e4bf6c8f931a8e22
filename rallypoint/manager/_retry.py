"""Retrying failed heals and start rounds: pure decisions, tested with plain numbers.

Why: a failed heal (its source died mid-transfer, a timeout) must not end the job or fail
every later step. The healing replica first tries the other up-to-date sources of the same
quorum (:func:`source_order`); if every one fails, the step fails, and the next quorum
(a new one: the failure is reported with it) assigns a source again, after a backoff that
grows with the consecutive failed heals (:func:`heal_backoff_s`) so a replica whose every
heal fails does not hammer its peers. DiLoCo's start round retries the same way for as long
as the manager's quorum timeout allows (:func:`keep_retrying`), not a fixed count."""

from __future__ import annotations

#: The first pause after a failed heal, and the longest.
HEAL_BACKOFF_BASE_S = 0.1
HEAL_BACKOFF_MAX_S = 5.0


def heal_backoff_s(failed_heals: int, base: float = HEAL_BACKOFF_BASE_S, cap: float = HEAL_BACKOFF_MAX_S) -> float:
    """Seconds to wait before the next quorum after ``failed_heals`` consecutive failed
    heals: 0 after none, then ``base``, doubling, at most ``cap``."""
    if failed_heals <= 0:
        return 0.0
    return min(cap, base * 2.0 ** min(failed_heals - 1, 30))


def source_order(assigned: int, sources: list[int], failed: set[int]) -> list[int]:
    """The replica ranks to fetch a heal from, in order: the assigned one first, then the
    other up-to-date ``sources`` (each once), leaving out those that already ``failed``."""
    out: list[int] = []
    for r in [assigned, *sources]:
        if r not in failed and r not in out:
            out.append(r)
    return out


def keep_retrying(started: float, now: float, budget_s: float) -> bool:
    """Whether a retried round (DiLoCo's start round) may try again: its first attempt
    began at ``started``, and the budget (the manager's quorum timeout) is not spent."""
    return now - started < budget_s


def retry_pause_s(attempt: int, started: float, now: float, budget_s: float) -> float:
    """The pause before retry ``attempt`` (1 = after the first failure): 50 ms, doubling,
    at most 1 s (a round itself takes a quorum), never past the budget."""
    return max(0.0, min(heal_backoff_s(attempt, base=0.05, cap=1.0), budget_s - (now - started)))


__all__ = ["HEAL_BACKOFF_BASE_S", "HEAL_BACKOFF_MAX_S", "heal_backoff_s", "keep_retrying", "retry_pause_s",
           "source_order"]
