"""Two replicas on threads of the test process, one ahead of the other: the first trains
until it says so (it sets the event it is given, e.g. at step 3), then the second starts
beside it and, being behind, heals from it. Used by the heal tests that need a live
sender and a late joiner in one process (tests/test_heal_default.py, test_heal_dtensor.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: The longest wait for the first replica to get ahead, and for each replica to finish.
AHEAD_S = 60.0
FINISH_S = 90.0


def done_together(manager: Any, target: int) -> bool:
    """True once ``manager`` reached ``target`` and has committed a round that both replicas
    were in with nobody healing (no heal on this side, none served to the other). Each
    replica of a pair trains until then, not only to ``target``: on a loaded machine the
    first may reach ``target`` before the second has even asked for a quorum, and alone it
    would leave nothing to heal from. The healing round itself is not enough: the sender
    commits it before the joiner has fetched the state, and leaving then fails the heal.
    After the heal both are at the same step, so both stop after the same joint round."""
    return manager.current_step() >= target and any(
        r.outcome == "committed" and r.replica_world_size >= 2 and not r.healing and not r.served_to
        for r in manager.step_records())


def early_then_late(first: Callable[[threading.Event], T], second: Callable[[], T], what: str) -> tuple[T, T]:
    """Run ``first(ahead)``; once it sets ``ahead``, run ``second()`` beside it; both results.
    Fails with ``what`` (or the first's own error) when the first never gets ahead."""
    ahead = threading.Event()
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(first, ahead)
        if not ahead.wait(AHEAD_S):
            raise AssertionError(a.exception(timeout=1) if a.done() else what)
        b = ex.submit(second)
        return a.result(timeout=FINISH_S), b.result(timeout=FINISH_S)
