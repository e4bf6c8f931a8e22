"""Two replicas on threads of the test process, one ahead of the other: the first trains
until it says so (it sets the event it is given, e.g. at step 3), then the second starts
beside it and, being behind, heals from it. Used by the heal tests that need a live
sender and a late joiner in one process (tests/test_heal_default.py, test_heal_dtensor.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: The longest wait for the first replica to get ahead, and for each replica to finish.
AHEAD_S = 60.0
FINISH_S = 90.0


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
