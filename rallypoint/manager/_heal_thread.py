"""Which thread heals when the ``Manager`` was not told (``heal_on_training_thread=None``,
the default): the decision, and the one look at the registered state it needs.

Why "auto" rather than one fixed default: a heal served from the quorum thread overlaps
forward (the healing peer fetches while the sender computes), which is safe for state that
forward does not swap out: plain parameters and optimizer state are only changed by the
optimizer, and the live transport freezes them before it steps (``_heal.py``). FSDP2's
state is not that: its parameters are DTensors whose modules forward re-points at
unsharded buffers and frees again, and calling ``state_dict()`` then, from another
thread, crashed the serving process (torchtitan#4754). TorchTitan creates its Manager with
torchft's arguments, which have no say in this, so the Manager decides: state holding a
DTensor heals on the training thread, between steps; other state overlaps forward.

When: on the training thread, at the first :meth:`Manager.start_quorum` (a step boundary,
before forward: reading the state there is as safe as a training-thread heal) and again
at the first ``start_quorum`` after another ``state_dict`` callback is registered
(TorchTitan registers after creating the Manager). The answer is cached in between, so a
step pays one attribute check. A callback that raises when asked makes the choice the safe
one (training thread): such state is not known to be safe to read mid-forward.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("rallypoint.manager")


def heal_thread(requested: bool | None, holds_dtensors: bool | None) -> tuple[bool, str]:
    """Whether heals run on the training thread, and why (for the log).

    ``requested``: the Manager's ``heal_on_training_thread`` (None: decide). ``holds_dtensors``:
    whether the registered state holds a DTensor (FSDP2, tensor parallel); None when it could
    not be read."""
    if requested is not None:
        return bool(requested), "heal_on_training_thread=%s was asked for" % bool(requested)
    if holds_dtensors is None:
        return True, "the state could not be read to decide: on the training thread, the safe choice"
    if holds_dtensors:
        return True, ("the state holds DTensors (FSDP2): on the training thread, never read while forward "
                      "swaps its parameters")
    return False, "the state holds no DTensor: on the quorum thread, overlapped with forward"


def holds_dtensor(tree: Any) -> bool:
    """Whether a state tree (dicts, lists, tuples) holds a DTensor anywhere."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: no DTensor can exist
        return False
    todo = [tree]
    while todo:
        x = todo.pop()
        if isinstance(x, DTensor):
            return True
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return False


def decide(requested: bool | None, read_state: Callable[[], Any]) -> tuple[bool, str]:
    """:func:`heal_thread` for the state ``read_state()`` returns (called only when
    ``requested`` is None; a callback that raises: the state could not be read)."""
    if requested is not None:
        return heal_thread(requested, None)
    try:
        state = read_state()
    except Exception as e:  # noqa: BLE001 - decided the safe way, and said why
        log.info("heal thread: reading the state to decide failed: %s", e)
        return heal_thread(None, None)
    return heal_thread(None, holds_dtensor(state))


class HealThread:
    """The Manager's ``heal_on_training_thread``: what was asked for (None: decide) and what
    is in force. :attr:`on` is read by the quorum thread; it changes only in
    :meth:`at_boundary` (the training thread, before a round's quorum thread starts) and
    when a caller sets it."""

    def __init__(self, requested: bool | None) -> None:
        self.on = bool(requested)
        self.requested: bool | None = None
        self.why = ""
        self._stale = False
        self.set(requested)

    def set(self, requested: bool | None) -> None:
        """Asked for ``requested`` (True/False: in force at once; None: decided at the next
        step boundary)."""
        self.requested = None if requested is None else bool(requested)
        if self.requested is not None:
            self.on, self.why = heal_thread(self.requested, None)
        self._stale = self.requested is None

    def registered(self) -> None:
        """Another ``state_dict`` callback was registered: decide again (when auto)."""
        self._stale = self.requested is None

    def at_boundary(self, read_state: Callable[[], Any], has_state: bool, log: Any) -> None:
        """At ``start_quorum`` (training thread): decide if due and the state can be read."""
        if not self._stale or not has_state:
            return
        self._stale = False
        on, why = decide(self.requested, read_state)
        if on != self.on or not self.why:
            log.info("heals run on the %s thread: %s", "training" if on else "quorum", why)
        self.on, self.why = on, why


__all__ = ["HealThread", "decide", "heal_thread", "holds_dtensor"]
