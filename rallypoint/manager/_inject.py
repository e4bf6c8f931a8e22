"""Fault injection, carried out by the manager at a step boundary (``rallypoint inject``).

Why in the manager: the faults the field sees -- a crashed replica, a hung training loop,
a slow node, a corrupted gradient or parameter, a collective that breaks -- must be
reproduced where they happen, at a point of the step that the other replicas cannot
tell from the real thing, so that detection and recovery are measured as they would
run. An operator asks the lighthouse (its authenticated API); the lighthouse hands the
injection to the replica group with the next quorum answer (trailing metadata
:data:`INJECT_KEY`, which torchft's clients ignore), and the group's ManagerServer passes
it to every rank. Each rank carries it out at its next step boundary at or after
``at_step``:

- ``kill``: SIGKILL in the middle of the step, as the round's first collective is posted
  (its peers are then in that collective, waiting for it: the crash the field fears most),
  or at the next step boundary when the round had no collective;
- ``hang``: the training thread stops for ``for_s`` seconds, or for good (a supervisor's
  hang watchdog is what ends it); heartbeats go on, as in a real hang;
- ``slow``: each step takes ``factor`` times longer (the time before the first collective
  is stretched), for ``for_s`` seconds or for good;
- ``nan-grad`` / ``bitflip-grad``: the round's first gradient sent to ``allreduce`` gets a
  NaN in element 0, or one flipped bit in its first non-zero element (``bit`` of its bit
  pattern; 30, the top exponent bit of a float32, turns 0.01 into about 3e36);
- ``bitflip-param``: one bit of element 0 of the first floating-point tensor of the
  registered state is flipped (silently: nothing fails until a check compares replicas);
- ``drop-collective``: the round's first collective fails, as a broken link would.

``lighthouse-restart`` is carried out by the lighthouse itself.

Everything that arrives is checked (``rallypoint._net.inject.parse_injections``) before
use; an injection is logged as a warning when it is carried out and noted in the round's
record.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import torch

from rallypoint._net.inject import ALLOW_INJECT_ENV, MANAGER_KINDS, Injection, inject_allowed

log = logging.getLogger("rallypoint.manager")


def flip_bit(t: torch.Tensor, bit: int, index: int = 0) -> None:
    """Flip ``bit`` of element ``index``'s bit pattern, in place (any dtype; on its device)."""
    flat = t.detach().reshape(-1)
    width = flat.element_size() * 8
    ints = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    view = flat[index:index + 1].view(ints)
    b = bit % width
    mask = torch.tensor(1 << b if b < width - 1 else -(1 << b), dtype=ints, device=t.device)
    view.bitwise_xor_(mask)


def first_nonzero(t: torch.Tensor) -> int:
    """The index of ``t``'s first non-zero element (flattened), 0 when all are zero. Where
    ``bitflip-grad`` strikes: one flipped bit of a zero is at most 2.0 (a ReLU's dead unit
    has exactly zero gradient), too small for any check to tell from training."""
    flat = t.detach().reshape(-1)
    return int(torch.argmax(flat.ne(0).to(torch.uint8)).item()) if flat.numel() else 0


def first_float_tensor(tree: Any) -> torch.Tensor | None:
    """The first floating-point tensor (with at least one element) in a state tree."""
    if isinstance(tree, torch.Tensor):
        return tree if tree.is_floating_point() and tree.numel() else None
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    for v in items:
        found = first_float_tensor(v)
        if found is not None:
            return found
    return None


class Injector:
    """One rank's pending injections, and what each does at its point of the step.

    ``state`` returns the rank's registered state (for ``bitflip-param``); ``closing`` is
    set at shutdown (it ends a timed hang early); ``clock`` times a slowdown's ``for_s``.
    ``allowed``: carry injections out at all (default: ``RALLYPOINT_ALLOW_INJECT=1``, read
    once here); off, every injection that arrives is dropped with a warning, so that a
    lighthouse (or whoever answers the group's quorum) cannot kill or corrupt a replica
    whose operator did not turn injection on."""

    def __init__(self, replica: str, state: Callable[[], Any], closing: threading.Event,
                 clock: Callable[[], float] = time.monotonic, allowed: bool | None = None) -> None:
        self.replica = replica  # the Manager sets the full replica id once it is known
        self.allowed = inject_allowed(allowed)
        self._refused = 0  # injections dropped while off (the first is logged, then every 100th)
        self._state = state
        self._closing = closing
        self._pending: list[Injection] = []
        self._seen: set[str] = set()
        self._armed: Injection | None = None  # a gradient/collective fault for this round
        self._slow: tuple[float, float | None, float] | None = None  # (factor, until, base compute s)
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, injections: list[Injection]) -> None:
        """Injections that arrived with a quorum (every rank of the group gets the same
        ones; an id seen before is ignored)."""
        if not self.allowed:
            for inj in injections:
                self._refused += 1
                if self._refused % 100 == 1:
                    log.warning("[%s] injection %s (%s) refused: fault injection is off in this process (set %s=1 "
                                "to allow drills); %d refused so far", self.replica, inj.id, inj.kind,
                                ALLOW_INJECT_ENV, self._refused)
            return
        with self._lock:
            for inj in injections:
                if inj.kind in MANAGER_KINDS and (not inj.id or inj.id not in self._seen):
                    self._seen.add(inj.id)
                    self._pending.append(inj)
                    log.warning("[%s] injection %s received: %s", self.replica, inj.id, inj.to_json())

    def at_step_start(self, step: int, base_compute_s: float | None) -> dict[str, Any]:
        """Carry out what is due at this step boundary; returns what was done (for the
        round's record). Blocks for ``hang`` and ``slow``; arms ``kill`` for the round's first
        collective (and never returns when an armed kill's round had none)."""
        done: dict[str, Any] = {}
        with self._lock:
            due = [i for i in self._pending if i.at_step is None or step >= i.at_step]
            self._pending = [i for i in self._pending if i not in due]
            if self._armed is not None and self._armed.kind == "kill":  # its round had no collective
                self._die()
            self._armed = None
        for inj in due:
            log.warning("[%s] carrying out injection %s (%s) at step %d", self.replica, inj.id, inj.kind, step)
            done.setdefault("injected", []).append(inj.kind)
            if inj.kind == "hang":
                self._closing.wait(inj.for_s if inj.for_s is not None else None)
            elif inj.kind == "slow":
                until = self._clock() + inj.for_s if inj.for_s is not None else None
                self._slow = (inj.factor, until, base_compute_s or 0.0)
            elif inj.kind == "bitflip-param":
                t = first_float_tensor(self._state())
                if t is None:
                    log.warning("[%s] bitflip-param: the registered state has no floating-point tensor", self.replica)
                else:
                    with torch.no_grad():
                        flip_bit(t, inj.bit)
            else:
                self._armed = inj
        if self._slow is not None:
            factor, until, base = self._slow
            if until is not None and self._clock() >= until:
                self._slow = None
                log.warning("[%s] injected slowness over", self.replica)
            else:
                extra = (factor - 1.0) * base
                done["injected_sleep_s"] = extra
                self._closing.wait(extra)
        return done

    def _die(self) -> None:
        log.warning("[%s] injected kill: SIGKILL now", self.replica)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def on_collective(self, tensor: torch.Tensor, contributes: bool = True) -> str | None:
        """Called with the round's collectives' inputs: applies an armed gradient fault to
        the first one; returns ``"drop"`` when that collective must fail instead."""
        with self._lock:
            inj, self._armed = self._armed, None
        if inj is None:
            return None
        if inj.kind == "kill":
            self._die()
        if inj.kind == "drop-collective":
            return "drop"
        if not contributes:  # zeros in (healing, spare): a corrupt gradient here is nobody's gradient
            log.warning("[%s] %s not carried out: this replica sends no gradient this round", self.replica, inj.kind)
            return None
        with torch.no_grad():
            if inj.kind == "nan-grad" and tensor.numel():
                tensor.reshape(-1)[0] = float("nan")
            elif inj.kind == "bitflip-grad" and tensor.numel():
                flip_bit(tensor, inj.bit, first_nonzero(tensor))
        return None


__all__ = ["Injector", "first_float_tensor", "first_nonzero", "flip_bit"]
