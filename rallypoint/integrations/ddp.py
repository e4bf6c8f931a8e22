"""``DistributedDataParallel`` that averages gradients over every rank of every
participating replica group, the cross-group part through the ``Manager``.

What it averages: the mean over all ranks of all replica groups taking part in the
step, as plain torch DDP over all those ranks would. It is two levels, because the
replicas taking part change at every quorum while the ranks of one group do not:

1. inside the replica group, over the group's own process group (torch's default group,
   or ``process_group=``; :mod:`._intra` says which, and when the wrapper initialises the
   default group itself): each bucket is divided by the group's size and summed, posted
   on the autograd thread as soon as the bucket is ready, as torch's own DDP does;
2. across replica groups, by ``manager.allreduce`` (a mean over the groups taking part,
   rank ``g`` with rank ``g`` of every group), posted once step 1 is done. The last
   bucket goes through ``manager.allreduce_last`` where the manager has one (rallypoint's:
   the corruption checks' rows ride in that collective), and its future completes with
   the tensor that work left the mean in.

The module is torch's DDP over the group's own process group (so construction checks
the parameter shapes and broadcasts parameters and buffers from group rank 0, and
buffers are broadcast before each forward, as with torch's DDP), with a communication
hook that does both levels. In a group of one rank the process group is a
:class:`ProcessGroupDummy` (it soaks up DDP's construction-time check and broadcast):
only step 2 runs. Group rank 0's parameters win at construction; across groups the
manager makes replicas agree by healing (``init_sync``) before the first commit.

The hook's contract with the reducer is what keeps training alive after a failure in
another group. The reducer waits for every bucket's future at the end of backward and
then copies each future's tensor back into the gradients; a future that fails makes
``backward()`` raise and leaves the reducer half-finished, so every later forward trips
its "reduction not finished" check. So a failed cross-group allreduce (a peer group
died) completes the bucket's future with the bucket's own buffer and is recorded with
``manager.report_error``: ``should_commit`` then refuses the step, and the next step
trains normally. A failure inside the group (a rank of this group died) is different:
the group cannot go on without that rank, so it fails the future and ``backward()``
raises, as with torch's DDP; the group restarts as a whole (``rallypoint run`` and
torchrun restart it) and heals from its peers.

Bucket rebuilding is disabled (``find_unused_parameters=True``, no ``static_graph``):
torch re-buckets parameters after the first step, and a replica that restarts would
use the first-step layout while its peers use the rebuilt one, so their allreduces
would disagree on sizes.

Threads: the group's collectives are posted only on the autograd thread (bucket order,
then the reducer's own used-parameter allreduce), so every rank of the group posts them
in the same order. One helper thread waits for each bucket's in-group allreduce and
posts its cross-group allreduce, in bucket order (the same on every group); a second
waits for those and completes the futures, so communication overlaps the rest of
backward at both levels.
"""

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rallypoint.integrations._intra import GroupPlan, resolve_group
from rallypoint.integrations._protocols import AVG, GradientManager, Waitable
from rallypoint.process_groups.wrappers import ProcessGroupDummy

log = logging.getLogger("rallypoint.integrations.ddp")

#: DDP arguments this wrapper decides itself (see the module docstring for why).
_OWNED_KWARGS = ("device_mesh",)


class _Stage:
    """One FIFO helper thread: items are handled in the order they were submitted.

    Started lazily and a daemon: every wait it does is bounded by a timeout (the
    manager's, the process group's), and an exiting process must not be held up by an
    idle helper. After :meth:`close`, :meth:`submit` refuses (the caller handles the
    item on its own thread)."""

    def __init__(self, name: str, handle: Callable[[Any], None]) -> None:
        self._name = name
        self._handle = handle
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._handle(item)

    def submit(self, item: Any) -> bool:
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put(item)
            return True

    def close(self, timeout: float) -> None:
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


class _BucketAverager:
    """The communication hook's state: the manager, the group's own process group
    (None in a group of one rank) and the two helper stages (see the module docstring)."""

    def __init__(self, manager: GradientManager, group: Any, group_size: int) -> None:
        self.manager = manager
        self.group = group
        self.group_size = group_size
        self._intra = _Stage("rallypoint-ddp-group", self._after_group)
        self._cross = _Stage("rallypoint-ddp-wait", self._after_cross)
        self.buckets = 0  # buckets handed to the hook so far (tests and logs read it)
        self.failures = 0  # buckets whose allreduce raised outside the manager's handling
        self.group_failures = 0  # buckets whose in-group allreduce failed
        self._posted: Callable[[], None] | None = getattr(manager, "gradients_posted", None)  # rallypoint's Manager
        # rallypoint's Manager: the last bucket's allreduce carries the corruption checks' rows
        self._last: Callable[[torch.Tensor], Waitable | None] | None = getattr(manager, "allreduce_last", None)

    def _record(self, e: BaseException) -> None:
        """Route ``e`` to the manager so the step does not commit; never raise."""
        self.failures += 1
        try:
            self.manager.report_error(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        except Exception as re:  # noqa: BLE001 - the hook must not raise into the reducer
            log.warning("could not report a gradient allreduce failure (%s): %s", e, re)

    # ---------------------------------------------------------------- level 1: the group
    def _group_failed(self, e: BaseException, fut: torch.futures.Future) -> None:
        """A rank of this group is gone: no commit, and ``backward()`` raises."""
        self.group_failures += 1
        log.error("the gradient allreduce inside this replica group failed (%s): a rank of the group is gone; "
                  "the group must restart as a whole (rallypoint run / torchrun restart it) and heal", e)
        self._record(e)
        if not fut.done():
            fut.set_exception(RuntimeError(
                f"the gradient allreduce inside this replica group failed: {e}. A rank of this group died or "
                "hung; the group cannot go on without it and must restart as a whole (rallypoint run and "
                "torchrun restart it), then it heals from the other groups"))

    def _after_group(self, item: tuple[Waitable, torch.Tensor, torch.futures.Future, bool]) -> None:
        work, buffer, fut, last = item
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - reported, and raised out of backward by the future
            self._group_failed(e, fut)
            return
        self._post_cross(buffer, fut, last)

    # ---------------------------------------------------------------- level 2: the groups
    def _post_cross(self, buffer: torch.Tensor, fut: torch.futures.Future, last: bool) -> None:
        try:
            work = self._last(buffer) if last and self._last is not None else None  # None: the rows do not ride
            if work is None:
                work = self.manager.allreduce(buffer, reduce_op=AVG)
        except Exception as e:  # noqa: BLE001 - never raise out of backward
            log.warning("posting a gradient allreduce failed: %s", e)
            self._record(e)
            fut.set_result(buffer)
            return
        if last and self._posted is not None:
            # Before the future can complete (backward returns once it has): the manager's
            # corruption checks post their exchange right behind this bucket, unless their
            # rows rode in its collective (allreduce_last).
            try:
                self._posted()
            except Exception as e:  # noqa: BLE001 - never raise out of backward
                log.warning("the corruption checks' exchange could not be posted: %s", e)
                self._record(e)
        if not self._cross.submit((work, buffer, fut)):
            self._after_cross((work, buffer, fut))  # shut down: wait on this thread instead

    def _after_cross(self, item: tuple[Waitable, torch.Tensor, torch.futures.Future]) -> None:
        """Wait for the cross-group work and complete the future with the buffer, whatever
        happened (every work, the riding one of ``Manager.allreduce_last`` too, leaves the
        mean in the buffer on success; on a failure the step does not commit)."""
        work, buffer, fut = item
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - ManagedWork records its own; anything else is ours
            log.warning("gradient allreduce failed: %s", e)
            self._record(e)
        finally:
            if not fut.done():
                fut.set_result(buffer)

    def average(self, buffer: torch.Tensor, last: bool = False) -> torch.futures.Future:
        """Post the mean of ``buffer`` over every rank of every participating group; a
        future that completes with ``buffer`` (averaged on success, not on a failure
        across groups) or fails (a failure inside the group). ``last``: the step's last
        bucket (the manager hears when it is posted: ``gradients_posted``)."""
        self.buckets += 1
        fut: torch.futures.Future = torch.futures.Future()
        if self.group is None:
            self._post_cross(buffer, fut, last)
            return fut
        try:
            buffer.div_(self.group_size)  # before the sum, as torch's allreduce hook (no overflow in low precision)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # stubs: RedOpType
            work = self.group.allreduce([buffer], opts)
        except Exception as e:  # noqa: BLE001 - reported, and raised out of backward by the future
            self._group_failed(e, fut)
            return fut
        if not self._intra.submit((work, buffer, fut, last)):
            self._after_group((work, buffer, fut, last))
        return fut

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the helpers after the works already queued (each bounded by ``timeout``)."""
        self._intra.close(timeout)
        self._cross.close(timeout)


def _manager_comm_hook(state: _BucketAverager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the group's ranks and the live replicas.

    Annotations are real types (no ``from __future__ import annotations`` in this
    module) because DDP compares them with ``dist.GradBucket`` and
    ``Future[Tensor]`` at registration.
    """
    return state.average(bucket.buffer(), bucket.is_last())


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch DDP whose gradients are averaged over every rank of every participating
    replica group: inside the group over its own process group, across groups by
    ``manager.allreduce``.

    ``DistributedDataParallel(manager, module, process_group=None, **ddp_kwargs)``:

    - ``process_group``: the ranks of this replica group to average inside. Default:
      none in a group of one rank; torch's default group when it is initialised (it must
      hold exactly the group's ranks: its size and rank must be the manager's
      ``group_world_size``/``group_rank``); otherwise, in a group of several ranks, the
      wrapper initialises the default group itself in the group's store at
      ``MASTER_ADDR``/``MASTER_PORT`` (see :mod:`rallypoint.integrations._intra`), and a
      clear ``ValueError`` says what to do when there is none.
    - ``ddp_kwargs`` go to torch's DDP, except ``device_mesh``,
      ``find_unused_parameters=False`` and ``static_graph=True`` (both let torch rebuild
      buckets, which breaks a restarted replica; see the module docstring).

    Every rank of the group must construct it at the same time (torch's DDP broadcasts
    group rank 0's parameters and buffers). A failed gradient allreduce across groups
    never raises out of ``backward()``: the step just does not commit, and the next one
    trains normally; one inside the group raises (the group must restart).
    """

    def __init__(self, manager: GradientManager, module: nn.Module, process_group: Any = None,
                 **ddp_kwargs: Any) -> None:
        for key in _OWNED_KWARGS:
            if key in ddp_kwargs:
                raise ValueError(
                    f"rallypoint DistributedDataParallel chooses {key!r} itself (gradients are averaged "
                    "through the manager); remove it from the arguments"
                )
        if ddp_kwargs.pop("find_unused_parameters", True) is False:
            raise ValueError(
                "find_unused_parameters=False lets torch rebuild DDP buckets after the first step; a "
                "restarted replica would then bucket differently from its peers. Leave it unset."
            )
        if ddp_kwargs.get("static_graph"):
            raise ValueError(
                "static_graph=True lets torch rebuild DDP buckets after the first step; a restarted "
                "replica would then bucket differently from its peers. Leave it unset."
            )
        group, plan = resolve_group(process_group, manager, module)
        super().__init__(module, process_group=group if group is not None else ProcessGroupDummy(0, 1),
                         find_unused_parameters=True, **ddp_kwargs)
        self._rallypoint_manager = manager
        self._group_plan = plan
        self._averager = _BucketAverager(manager, group, plan.world_size)
        self.register_comm_hook(self._averager, _manager_comm_hook)
        register = getattr(manager, "register_sdc_params", None)  # rallypoint's Manager: the parameter check
        if register is not None:
            register(list(module.parameters()))
        if group is not None:
            log.info("averaging gradients inside the replica group over %d ranks (%s process group), then "
                     "across replica groups through the manager", plan.world_size, plan.source)

    @property
    def manager(self) -> GradientManager:
        """The manager gradients are averaged through across replica groups."""
        return self._rallypoint_manager

    @property
    def group_plan(self) -> GroupPlan:
        """Which process group averages inside the replica group (``source``, ``world_size``, ``rank``)."""
        return self._group_plan

    @property
    def buckets_reduced(self) -> int:
        """Gradient buckets handed to the hook so far (all steps)."""
        return self._averager.buckets

    @property
    def bucket_failures(self) -> int:
        """Buckets whose allreduce raised outside the manager's own error handling."""
        return self._averager.failures

    def shutdown(self) -> None:
        """Stop the helper threads that wait for allreduces (optional: they are daemons).
        A default process group the wrapper initialised itself is destroyed too."""
        self._averager.shutdown()
        if self._group_plan.source == "init" and dist.is_initialized():
            dist.destroy_process_group()


class PureDistributedDataParallel(nn.Module):
    """torchft's experimental pure-Python DDP, for code written against it: one
    ``manager.allreduce`` per gradient (a mean over the participating replica groups),
    posted as each gradient is accumulated, and all of them waited for before
    ``backward()`` returns, so the optimizer sees averaged gradients. No buckets and no
    averaging inside a replica group: use it with one rank per group, and prefer
    :class:`DistributedDataParallel`, which is faster for any real model."""

    def __init__(self, manager: GradientManager, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._works: list[Waitable] = []
        self._queued = False

        def post_grad_hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            if not self._queued:  # the first gradient of this backward: wait for all at its end
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)  # type: ignore[attr-defined]
            self._works.append(manager.allreduce(p.grad))

        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(post_grad_hook)

    def _wait_all(self) -> None:
        works, self._works, self._queued = self._works, [], False
        for w in works:
            w.wait()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]
