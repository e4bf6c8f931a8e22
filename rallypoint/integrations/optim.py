"""``Optimizer``: an optimizer that steps only when the ``Manager`` commits the step
(torchft 0.2's ``OptimizerWrapper`` semantics), and LR schedulers that heal with it.

A training step with the wrapper::

    ddp = DistributedDataParallel(manager, model)   # averages over every rank of every group
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters()))
    ...
    batch = next(batches)           # before zero_grad(): see rallypoint.integrations.data
    optimizer.zero_grad()           # starts this step's quorum, then zeroes the gradients
    ddp(batch).mean().backward()    # gradients averaged inside the group and across groups
    optimizer.step()                # inner step only if manager.should_commit()

The wrapper averages nothing itself: the gradients must already be the mean over every
rank of every participating group, which :class:`~rallypoint.integrations.DistributedDataParallel`
and :func:`~rallypoint.integrations.fully_shard_replicated` give. (``manager.allreduce``
on each gradient by hand is enough only in groups of one rank: it pairs group rank ``g``
with group rank ``g`` of the other groups and never averages inside a group.) The commit
is the group's decision: every rank of the group votes and ``should_commit()`` answers all
of them alike, so the ranks of a group step together or not at all.

Why the wrapper owns ``zero_grad`` and ``step``: they bracket the step exactly where the
quorum must start (before the forward pass, so the async quorum overlaps it) and where
the commit barrier must be (after the gradients are averaged, before any state changes).
A step that does not commit changes nothing, so every replica stays bit-identical.

LR schedulers: a scheduler is state too. A replica that heals receives the model and
optimizer state of a peer; if the scheduler's own counters (``last_epoch``...) are left
behind, the healed replica computes its next learning rates from a stale schedule and
silently diverges from its peers (torchtitan#4598). :meth:`Optimizer.register_scheduler`
closes that hole: it adds the scheduler's state to what a healing replica receives and,
by default, steps the scheduler after every *committed* step only (a failed step must not
advance the schedule on one replica and not on another). Schedulers built on the wrapper
or on the inner optimizer both work: they share the same ``param_groups``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from rallypoint.integrations._protocols import OptimizerManager

log = logging.getLogger("rallypoint.integrations.optim")


class Optimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that it steps only when ``manager`` commits the step.

    It is a ``torch.optim.Optimizer`` (LR schedulers accept it) that owns nothing itself:
    ``param_groups``, ``state``, ``defaults``, ``state_dict()``, ``load_state_dict()`` and
    ``add_param_group()`` are the inner optimizer's. ``zero_grad()`` must be called at the
    start of every step (it starts the quorum) and ``step()`` once after the gradients
    were averaged (it is the commit barrier).
    """

    def __init__(self, manager: OptimizerManager, optimizer: torch.optim.Optimizer) -> None:
        # No super().__init__(): the inner optimizer owns the parameters, their groups and
        # state; a second copy here would drift from it.
        self.optim = optimizer
        self.manager = manager
        self._schedulers: list[tuple[Any, bool]] = []
        self._last_committed: bool | None = None

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum, then zero the gradients.

        The quorum starts first so that (with an async quorum) it is computed while the
        forward and backward passes run."""
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> bool:  # type: ignore[override]
        """Step the inner optimizer (then the schedulers registered with
        ``step_on_commit``) if and only if ``manager.should_commit()``; returns whether
        the step committed, so a caller may step its own schedulers on that.

        Closures are refused: an optimizer that re-evaluates the loss (LBFGS) would run
        forward/backward again after the commit barrier, with gradients that were never
        averaged across replicas."""
        if closure is not None:
            raise ValueError("rallypoint.integrations.Optimizer does not support closures: the "
                             "gradients a closure recomputes are not averaged across replicas")
        committed = bool(self.manager.should_commit())
        self._last_committed = committed
        if committed:
            self.optim.step()
            for sched, on_commit in self._schedulers:
                if on_commit:
                    sched.step()
        return committed

    @property
    def last_step_committed(self) -> bool | None:
        """What the last ``step()`` decided (None before the first)."""
        return self._last_committed

    # ------------------------------------------------------------------ schedulers
    def register_scheduler(self, scheduler: Any, key: str = "lr_scheduler", step_on_commit: bool = True) -> None:
        """Make ``scheduler`` part of the healed state (under ``key`` in the manager's
        state dict) and, with ``step_on_commit`` (the default), step it after every
        committed ``step()``; do not call ``scheduler.step()`` yourself then. Pass
        ``step_on_commit=False`` for a scheduler that needs arguments (``ReduceLROnPlateau``)
        and step it yourself only when ``step()`` returned True.

        On load, each param group's ``lr`` is set to the scheduler's last learning rate
        as well: the learning rate a healed replica uses next must not depend on whether
        the user's own state dict carried the optimizer's param groups."""
        owner = getattr(scheduler, "optimizer", None)
        if owner is not self and owner is not self.optim:
            raise ValueError("the scheduler must be built on this Optimizer or on its inner optimizer, "
                             "otherwise it changes learning rates this wrapper does not use")
        if step_on_commit and isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("ReduceLROnPlateau.step needs a metric: register it with step_on_commit=False "
                             "and call scheduler.step(metric) when optimizer.step() returned True")

        def save() -> dict[str, Any]:
            # A copy: the state is served to a healing peer from another thread, and it
            # must be the schedule of this step even if the scheduler moves on.
            return copy.deepcopy(scheduler.state_dict())

        def load(state: dict[str, Any]) -> None:
            scheduler.load_state_dict(state)
            last = getattr(scheduler, "_last_lr", None)
            if last is not None and len(last) == len(self.param_groups):
                for group, lr in zip(self.param_groups, last):
                    group["lr"] = lr
            log.info("scheduler %r restored from a peer: last_epoch %s, lr %s", key,
                     getattr(scheduler, "last_epoch", "?"), [g["lr"] for g in self.param_groups])

        self.manager.register_state_dict_fn(key, load, save)
        self._schedulers.append((scheduler, step_on_commit))

    # ------------------------------------------------------------------ pass-through
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (the wrapper keeps no state of its own)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` into the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # torch declares a plain attribute
        """The wrapped optimizer's parameter groups (LR schedulers change them here)."""
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # torch declares a plain attribute
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]  # torch declares a plain attribute
        """The wrapped optimizer's default hyperparameters."""
        return self.optim.defaults

    def __getattr__(self, name: str) -> Any:
        # Anything else of the Optimizer API (hooks, ...) is the inner optimizer's; only
        # reached for names not found on the wrapper. __dict__ lookup avoids recursing
        # before __init__ ran (copy, pickle).
        inner = self.__dict__.get("optim")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"rallypoint.integrations.Optimizer({self.optim!r})"


#: torchft's name for the same thing.
OptimizerWrapper = Optimizer

__all__ = ["Optimizer", "OptimizerWrapper"]
