"""LocalSGD, DiLoCo and Streaming DiLoCo on a rallypoint ``Manager``.

Both are context managers that hook the *inner* optimizer's step
(``register_step_post_hook``), so the training loop stays a plain inner loop::

    with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=100):
        for batch in data:
            inner_opt.zero_grad(); loss(model, batch).backward(); inner_opt.step()

Constructors and keyword names follow ``torchft.local_sgd`` 0.2.0, so switching is a
change of import.

Replica groups of several ranks: the exchanges pair group rank ``g`` with group rank ``g``
of the other groups; the inner steps are the group's own training, so train them with
torch's DDP (or FSDP) over the group's process group, as ``examples/train_diloco.py``
does, and the ranks of a group hold the same parameters at every sync.

LocalSGD
    Every ``sync_every`` inner steps: a quorum, the parameters are averaged over the
    participating replicas, and on commit the average replaces the local value. A sync
    that does not commit changes nothing (the local value is kept; nothing committed is
    lost) and the next sync retries.

DiLoCo / Streaming DiLoCo
    The model is split into ``len(model_fragments)`` fragments; each keeps its *global*
    parameters ``G`` (a backup, CPU by default, pinned where CUDA exists) and an outer
    optimizer. With ``H = sync_every // len(model_fragments)`` one fragment is synced
    every ``H`` inner steps, in turn: the round at manager step ``k`` syncs fragment
    ``k % n`` (as torchft 0.2.0 does; the start round below is not a step), so replicas
    that healed agree on the turn. A round of fragment ``f``:

    1. after inner step ``H - fragment_sync_delay``: ``manager.start_quorum()`` (apart from the
       start round below, the only place a quorum runs) and the pseudo-gradient ``Δ = G_f - L_f`` (``L`` the local,
       inner-trained value) is averaged over the participating replicas
       (``manager.allreduce``, optionally bucketized and/or int8-quantized); the exchange
       overlaps the next ``fragment_sync_delay`` inner steps;
    2. after inner step ``H``: wait for it, put the fragment back on ``G_f``, and ask
       ``manager.should_commit()``. On commit: ``outer_optimizer.step()`` with ``mean(Δ)``
       as the gradient of ``G_f`` gives ``G'_f``; the backup becomes ``G'_f``; then the
       model gets ``(1 - alpha) * G'_f + alpha * L_f`` (torchft's
       ``lerp_(local, alpha)``; ``L_f`` is the local value at this point, i.e. including
       the inner steps taken during the delay; ``alpha = 0`` drops them, ``alpha = 1``
       keeps the local value and only moves the backup).

    A failed round (any allreduce error, a peer dying, too few replicas, a failed heal)
    does not commit: the fragment's parameters are restored from the backup, so its
    local progress since its last committed sync is discarded, while ``G``, the outer
    optimizer state and the manager's step stay those of the last commit. The manager
    step does not advance, so the next round retries the same fragment.

    The quorum is synchronous: DiLoCo requires ``Manager(use_async_quorum=False)`` so that
    a heal is applied before the pseudo-gradient is computed.

Healing
    Each fragment registers ``StreamingDiLoCoFragment_<i>`` with
    ``manager.register_state_dict_fn``: its global parameters and its outer optimizer
    state. A replica that is behind receives them at a round's quorum together with the
    user's registered state (the model and inner optimizer as the sender has them), and
    takes part in that round: its pseudo-gradient repeats the sender's, exactly as in
    torchft 0.2.0 (whose numbers ``tests/test_torchft_integ.py`` checks). The model's
    parameters must therefore be part of the registered user state, as torchft requires.

Step-0 start round
    When the first inner step begins at manager step 0 (the optimizer's step pre-hook,
    not ``__enter__``: a user's ``state_dict`` callback may use the object ``__enter__``
    returns, as torchft's trainer does), every replica runs one round without an outer
    step: a quorum (with ``init_sync`` every non-primary replica receives the primary's
    state, i.e. its initial parameters), a one-element allreduce (so the primary keeps
    serving its state until the healing peers have it) and a commit. All replicas
    therefore train from the primary's step-0 parameters (in torchft 0.2.0 the first
    quorum only happens at the first sync, after each replica trained a whole round from
    its own initialisation). That first inner step applies the gradient the replica
    computed before it, on its own initial parameters; with ``init_sync=False`` nothing
    is copied: give every replica the same seed. The round is a setup round, not a
    training step: the manager keeps it as a step on the wire (where peers compare
    steps) but ``current_step()`` and ``batches_committed()`` leave it out, so both
    count committed syncs as torchft does. A replica that starts at step 0 while the
    others are already past it (a restart, or a new replica) finds a quorum at step > 0:
    it heals and takes part in that running round when its first inner step begins, and
    that inner step is dropped (its gradient was taken on the parameters the heal
    replaced), so the replica's loop sees the joined round end as its peers' loops do.
    torchft's replica first trains ``H - fragment_sync_delay`` inner steps from its stale
    initialisation, which the heal then overwrites.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from rallypoint.integrations._fragment import Fragment, local_view
from rallypoint.integrations._protocols import DiLoCoManager, LocalSGDManager

log = logging.getLogger("rallypoint.integrations.local_sgd")

USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"  # torchft's switch, honoured for drop-in use
RALLYPOINT_USE_BUCKETIZATION_ENV = "RALLYPOINT_USE_BUCKETIZATION"
DEFAULT_BUCKET_CAP_BYTES = 1024 * 1024 * 1024  # torchft's default: 1 GiB
def _quorum_budget_s(manager: Any) -> float:
    """How long DiLoCo's start round keeps retrying: the manager's quorum timeout (as
    torchft keeps trying for a quorum), 60 s for a manager that has none."""
    qt: Any = getattr(manager, "_quorum_timeout", None)
    return float(qt.total_seconds()) if hasattr(qt, "total_seconds") else 60.0


class _InnerStepHook:
    """A context that runs ``_step_post_hook`` after every step of ``_local_optimizer``
    while it is entered (the inner loop stays a plain loop)."""

    _local_optimizer: optim.Optimizer
    _hooks: list[RemovableHandle]

    def _hook_inner_steps(self) -> None:
        self._hooks.append(self._local_optimizer.register_step_post_hook(self._step_post_hook))

    def _step_post_hook(self, _opt: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        raise NotImplementedError

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return False


class LocalSGD(_InnerStepHook):
    """Average the model's parameters over the replicas every ``sync_every`` inner
    optimizer steps (see the module docstring for the failure semantics)."""

    def __init__(self, manager: LocalSGDManager, model: nn.Module, optimizer: optim.Optimizer, sync_every: int) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self._manager = manager
        self._model = model
        self._local_optimizer = optimizer
        self._sync_every = sync_every
        self._local_step = 0
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> "LocalSGD":
        self._hook_inner_steps()
        return self

    def _step_post_hook(self, _opt: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> bool:
        """Quorum, average, and on commit adopt the average. True if it committed."""
        self._manager.start_quorum()
        params = [p for p in self._model.parameters()]
        with torch.no_grad():
            avgs = [local_view(p.detach()).clone() for p in params]
        works = [self._manager.allreduce(a) for a in avgs]
        for w in works:
            w.wait()
        # should_commit may apply a heal of the user's registered state first; the
        # average is copied after it, so a healed replica ends on the average too.
        committed = bool(self._manager.should_commit())
        if committed:
            with torch.no_grad():
                for p, a in zip(params, avgs):
                    local_view(p.data).copy_(a)
        else:
            log.warning("LocalSGD: sync at step %d did not commit; keeping the local parameters",
                        self._manager.current_step())
        self._local_step = 0
        return committed


class DiLoCo(_InnerStepHook):
    """DiLoCo and Streaming DiLoCo (see the module docstring for the exact rule).

    Args mirror ``torchft.local_sgd.DiLoCo`` 0.2.0: ``manager`` (with
    ``use_async_quorum=False``), ``model_fragments`` (modules; their parameters must be
    disjoint), ``inner_optimizer``, ``outer_optimizer`` (one for all fragments, or a list
    with one per fragment), ``sync_every`` (inner steps for all fragments to sync once),
    ``backup_device`` (where the global parameters live; CPU by default),
    ``pin_memory`` (pin a CPU backup where CUDA exists), ``use_bucketization`` /
    ``bucket_cap_mb`` (pack the pseudo-gradients into flat buffers of at most this many
    MiB; default 1 GiB), ``should_quantize`` (int8 row-wise quantized allreduce),
    ``fragment_sync_delay`` (inner steps the exchange overlaps), ``fragment_update_alpha``
    (weight of the local value when mixing after a sync).
    """

    def __init__(
        self,
        manager: DiLoCoManager,
        model_fragments: Sequence[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | Sequence[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        n = len(model_fragments)
        if n == 0:
            raise ValueError("DiLoCo needs at least one model fragment")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                "DiLoCo requires a synchronous quorum: create the Manager with use_async_quorum=False "
                "(a heal must be applied before the pseudo-gradient is computed)"
            )
        # Sequence, not list, in the hints: a user's [SGD(...), ...] is a list[SGD], which a
        # type checker rejects where list[Optimizer] is asked for (lists are invariant).
        outers: list[optim.Optimizer] = ([outer_optimizer] * n if isinstance(outer_optimizer, optim.Optimizer)
                                         else list(outer_optimizer))
        if len(outers) != n:
            raise ValueError(f"{len(outers)} outer optimizers for {n} model fragments; give one per fragment")
        if sync_every < n:
            raise ValueError(f"sync_every={sync_every} is smaller than the {n} fragments: each needs >= 1 inner step")
        if sync_every % n != 0:
            raise ValueError(f"sync_every={sync_every} must be a multiple of the number of fragments ({n})")
        self._every = sync_every // n
        if not 0 <= fragment_sync_delay < self._every:
            raise ValueError(
                f"fragment_sync_delay={fragment_sync_delay} must be in [0, {self._every}): a fragment's exchange "
                "must finish before the next fragment's starts"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha={fragment_update_alpha} must be in [0, 1]")
        seen: set[int] = set()
        for m in model_fragments:
            for p in m.parameters():
                if id(p) in seen:
                    raise ValueError("a parameter belongs to more than one model fragment")
                seen.add(id(p))
        if should_quantize and "should_quantize" not in inspect.signature(manager.allreduce).parameters:
            raise ValueError("should_quantize=True needs a Manager whose allreduce accepts should_quantize")
        env_buckets = os.environ.get(USE_BUCKETIZATION_ENV) == "True" or \
            os.environ.get(RALLYPOINT_USE_BUCKETIZATION_ENV, "").lower() in ("1", "true")
        cap = DEFAULT_BUCKET_CAP_BYTES if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)

        self._manager = manager
        self._local_optimizer = inner_optimizer
        self._delay = fragment_sync_delay
        self._local_step = 0
        self._pending: Fragment | None = None  # the fragment whose exchange is in flight
        self._started = False
        self._stashed_grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # see _drop_this_step
        self._hooks: list[RemovableHandle] = []
        self._fragments = [
            Fragment(
                manager, m, i, outers[i],
                backup_device, pin_memory, use_bucketization or env_buckets, cap, should_quantize,
                fragment_update_alpha,
            )
            for i, m in enumerate(model_fragments)
        ]
        for f in self._fragments:
            f.save_global()
            f.register()

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "DiLoCo":
        # The start round runs when the first inner step begins, not here: a user's
        # state_dict callback may use the object this returns (torchft's own trainer
        # asserts ``self.diloco`` is set), and the start round serves that state.
        self._hooks.append(self._local_optimizer.register_step_pre_hook(self._step_pre_hook))
        self._hook_inner_steps()
        return self

    def _wire_step(self) -> int:
        """The manager's step as peers see it (setup rounds included): 0 only in a job
        nobody has synced in yet."""
        return self._manager.current_step() + getattr(self._manager, "_setup_rounds", 0)

    def _step_pre_hook(self, _opt: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """The start round, when the first inner step begins (torch cannot remove a hook
        while it runs, so later steps return at once)."""
        if self._started:
            return
        self._started = True
        if self._wire_step() == 0 and self._start_round() == "joined":
            self._drop_this_step()

    def _drop_this_step(self) -> None:
        """Make the inner step about to run a no-op, ending the round just joined: its
        gradient was taken on the stale parameters the heal replaced (optimizers skip
        parameters without ``.grad``; the gradients are put back after the step). The
        user's loop then sees the joined round's step right after it, as its peers did
        after their sync, so everyone leaves a ``while current_step() < N`` loop alike."""
        self._stashed_grads = []
        for group in self._local_optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._stashed_grads.append((p, p.grad))
                    p.grad = None
        self._local_step = -1  # the post-hook of this step makes it 0: a fresh round

    # ------------------------------------------------------------------ schedule
    def _fragment(self) -> Fragment:
        """This round's fragment: a function of the manager's step, which all replicas
        of the quorum share (a healed one receives it)."""
        return self._fragments[self._manager.current_step() % len(self._fragments)]

    def _step_post_hook(self, _opt: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for p, g in self._stashed_grads:
            p.grad = g
        self._stashed_grads = []
        self._local_step += 1
        if self._local_step == self._every - self._delay:
            self._manager.start_quorum()
            frag = self._fragment()
            log.debug("DiLoCo: preparing fragment %d at manager step %d", frag.index, self._manager.current_step())
            frag.prepare()
            self._pending = frag
        if self._local_step == self._every:
            self._local_step = 0
            done, self._pending = self._pending, None
            assert done is not None
            committed = done.perform()
            log.debug("DiLoCo: fragment %d sync committed=%s, manager step %d", done.index, committed,
                      self._manager.current_step())

    def _start_round(self) -> str:
        """The step-0 start round (see the module docstring): everyone at step 0 agrees on
        the primary's initial state and commits a setup round, which the manager does not
        count as a step; a replica that finds the others past step 0 joins their running
        round instead."""
        from rallypoint.manager._retry import keep_retrying, retry_pause_s

        budget = _quorum_budget_s(self._manager)
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            for f in self._fragments:
                f.save_global()  # the parameters as of entering: what a peer would heal from
            self._manager.start_quorum()
            if self._wire_step() > 0:
                # Healed into a running job: take part in the round the others are in.
                frag = self._fragment()
                frag.prepare()
                committed = frag.perform()
                log.info("DiLoCo: joined a running job at step %d (fragment %d, committed=%s); this inner "
                         "step's gradient, taken on the replaced parameters, is dropped",
                         self._manager.current_step(), frag.index, committed)
                return "joined"
            # A collective before the commit: a replica that serves its state must not
            # withdraw it (should_commit does) before the healing peer fetched it; the
            # peer joins this allreduce only after its heal was applied.
            self._manager.allreduce(torch.zeros(1)).wait()
            if self._manager.should_commit():
                count = getattr(self._manager, "_count_setup_round", None)
                if count is not None:
                    count()
                for f in self._fragments:
                    f.restore_global()
                log.info("DiLoCo: start round committed; starting from the agreed global parameters")
                return "started"
            now = time.monotonic()
            if not keep_retrying(started, now, budget):
                raise RuntimeError(f"DiLoCo: the start round failed {attempt} times over {now - started:.1f} s, the "
                                   f"quorum timeout ({budget:.0f} s); see the manager's errors")
            pause = retry_pause_s(attempt, started, now, budget)
            log.warning("DiLoCo: start round failed (attempt %d, %.1f s of the %.0f s quorum timeout); retrying in "
                        "%.2f s", attempt, now - started, budget, pause)
            time.sleep(pause)  # a backoff between rounds, bounded by the budget


__all__ = ["DiLoCo", "LocalSGD"]
