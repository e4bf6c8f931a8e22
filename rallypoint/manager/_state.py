"""The user's state that healing moves: the ``state_dict``/``load_state_dict`` pairs
registered with the ``Manager`` (``register_state_dict_fn``).

Why a separate object with its own lock: the quorum thread reads the state to serve it
while the training thread may register another pair or apply a received state; one
re-entrant lock orders them, and nothing else of the Manager needs it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class UserState:
    """Registered ``(load, save)`` pairs by key."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._save: dict[str, Callable[[], Any]] = {}
        self._load: dict[str, Callable[[Any], None]] = {}

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
        (torchft's layout, so either side may be torchft's)."""
        with self.lock:
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
