"""The user's state that healing moves: the ``state_dict``/``load_state_dict`` pairs
registered with the ``Manager`` (``register_state_dict_fn``).

Why a separate object with its own lock: the quorum thread reads the state to serve it
while the training thread may register another pair or apply a received state; one
re-entrant lock orders them, and nothing else of the Manager needs it.

The read gate (torchft's ``disallow_state_dict_read`` / ``allow_state_dict_read``): a
trainer that mutates its state outside the optimizer step (an outer DiLoCo sync of its own)
closes the gate first; :meth:`UserState.snapshot` on another thread then waits until it
opens again (at most the Manager's timeout: a ``TimeoutError`` that fails that heal, never
a torn read), and closing waits for a snapshot in progress to end. The thread that closed
the gate still reads (a heal served on the training thread inside the region would
otherwise wait for itself).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class UserState:
    """Registered ``(load, save)`` pairs by key."""

    def __init__(self, read_timeout_s: float = 60.0) -> None:
        self.lock = threading.RLock()
        self._save: dict[str, Callable[[], Any]] = {}
        self._load: dict[str, Callable[[Any], None]] = {}
        self.read_timeout_s = read_timeout_s
        self._gate = threading.Condition()
        self._closed_by: int | None = None  # the thread that closed the read gate

    def disallow_read(self) -> None:
        """Close the read gate (no-op when it is closed): waits for a snapshot in progress."""
        with self._gate:
            if self._closed_by is not None:
                return
            self._closed_by = threading.get_ident()
        with self.lock:  # a snapshot holds it while it reads: wait for it to end
            pass

    def allow_read(self) -> None:
        """Open the read gate (no-op when it is open) and wake the readers waiting on it."""
        with self._gate:
            self._closed_by = None
            self._gate.notify_all()

    def read_allowed(self) -> bool:
        """Whether the read gate is open."""
        return self._closed_by is None

    def _wait_gate(self) -> None:
        me = threading.get_ident()
        deadline = time.monotonic() + self.read_timeout_s
        with self._gate:
            while self._closed_by is not None and self._closed_by != me:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the state dict stayed closed to reads (disallow_state_dict_read) for "
                                       f"{self.read_timeout_s:g}s: not served")
                self._gate.wait(left)

    def register(self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]) -> None:
        with self.lock:
            if key in self._save:
                raise ValueError(f"state dict key {key!r} is already registered")
            self._load[key] = load_state_dict
            self._save[key] = state_dict

    def has_state(self) -> bool:
        """Whether any ``state_dict`` callback is registered."""
        return bool(self._save)

    def snapshot(self, counters: Callable[[], dict[str, int]]) -> dict[str, Any]:
        """What a healing peer receives: ``{"user": {key: state}, "torchft": counters()}``
        (torchft's layout, so either side may be torchft's). Waits while the read gate is
        closed by another thread."""
        me = threading.get_ident()
        while True:
            self._wait_gate()
            with self.lock:
                if self._closed_by not in (None, me):
                    continue  # closed between the gate and the lock: its closer may be mutating now
                if not self._save:
                    raise RuntimeError("no user state_dict registered: pass state_dict= or call register_state_dict_fn")
                return {"user": {k: fn() for k, fn in self._save.items()}, "torchft": counters()}

    def apply(self, received: dict[str, Any], counters: Callable[[dict[str, int]], None]) -> None:
        """Load a received snapshot: the Manager's counters, then every registered key
        (a key the sender lacks is an error that names what it has)."""
        with self.lock:
            counters(received["torchft"])
            user = received["user"]
            for key, load in self._load.items():
                if key not in user:
                    raise KeyError(f"received state has no {key!r} entry (has {sorted(user)})")
                load(user[key])


__all__ = ["UserState"]
