"""``DistributedDataParallel`` whose gradient averaging goes through the ``Manager``.

torch's DDP reducer talks to one fixed ``ProcessGroup``, but the replicas we average
over change at every quorum, and our process groups report a world size of 1 to
torch's C++ side. So the module is wrapped with a :class:`ProcessGroupDummy` (it
soaks up DDP's construction-time parameter check and broadcast) and a communication
hook sends every gradient bucket through ``manager.allreduce`` (a mean over the
replicas taking part in this step).

The hook's contract with the reducer is what keeps training alive after a failure.
The reducer waits for every bucket's future at the end of backward and then copies
each future's tensor back into the gradients; a future that fails (or holds a tensor
of another shape) makes ``backward()`` raise and leaves the reducer half-finished,
so every later forward trips its internal "reduction not finished" check and the
replica can never train again without being rebuilt. Here a bucket's future always
completes, with the bucket's own buffer: averaged when the allreduce succeeded,
left as the local gradients when it did not. Failures are recorded with
``manager.report_error`` (``should_commit`` then refuses the step, so the
un-averaged gradients are never applied) and the next step starts from a clean
reducer.

Bucket rebuilding is disabled (``find_unused_parameters=True``, no ``static_graph``):
torch re-buckets parameters after the first step, and a replica that restarts would
use the first-step layout while its peers use the rebuilt one, so their allreduces
would disagree on sizes.

Each bucket's allreduce is posted on the autograd thread, in bucket order (the same
on every replica), and waited for on one helper thread, so communication overlaps
the rest of backward as it does with torch's own hook.
"""

import logging
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rallypoint.integrations._protocols import AVG, GradientManager, Waitable
from rallypoint.process_groups.wrappers import ProcessGroupDummy

log = logging.getLogger("rallypoint.integrations.ddp")

#: DDP arguments this wrapper decides itself (see the module docstring for why).
_OWNED_KWARGS = ("process_group", "device_mesh")


class _BucketAverager:
    """The communication hook's state: the manager and the thread that waits for posted
    allreduces.

    The waiter is one thread, so works are waited for in the order they were posted.
    It is started lazily and is a daemon: every wait is bounded by the manager's
    timeout, and an exiting process must not be held up by an idle helper.
    """

    def __init__(self, manager: GradientManager) -> None:
        self.manager = manager
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Waitable, torch.Tensor, torch.futures.Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.buckets = 0  # buckets handed to the hook so far (tests and logs read it)
        self.failures = 0  # buckets whose allreduce raised outside the manager's handling

    def _record(self, e: BaseException) -> None:
        """Route ``e`` to the manager so the step does not commit; never raise."""
        self.failures += 1
        try:
            self.manager.report_error(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        except Exception as re:  # noqa: BLE001 - the hook must not raise into the reducer
            log.warning("could not report a gradient allreduce failure (%s): %s", e, re)

    def _finish(self, work: Waitable, buffer: torch.Tensor, fut: torch.futures.Future) -> None:
        """Wait for ``work`` and complete ``fut`` with ``buffer``, whatever happened."""
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - ManagedWork records its own; anything else is ours
            log.warning("gradient allreduce failed: %s", e)
            self._record(e)
        finally:
            if not fut.done():
                fut.set_result(buffer)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._finish(*item)

    def _submit(self, item: tuple[Waitable, torch.Tensor, torch.futures.Future]) -> bool:
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rallypoint-ddp-wait", daemon=True)
                self._thread.start()
            self._queue.put(item)
            return True

    def average(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Post the mean of ``buffer`` over the replicas; a future that always completes
        with ``buffer`` (averaged on success, untouched on failure)."""
        self.buckets += 1
        fut: torch.futures.Future = torch.futures.Future()
        try:
            work = self.manager.allreduce(buffer, reduce_op=AVG)
        except Exception as e:  # noqa: BLE001 - never raise out of backward
            log.warning("posting a gradient allreduce failed: %s", e)
            self._record(e)
            fut.set_result(buffer)
            return fut
        if not self._submit((work, buffer, fut)):
            self._finish(work, buffer, fut)  # shut down: wait on this thread instead
        return fut

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the waiter after the works already queued (bounded by ``timeout``)."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


def _manager_comm_hook(state: _BucketAverager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the live replicas.

    Annotations are real types (no ``from __future__ import annotations`` in this
    module) because DDP compares them with ``dist.GradBucket`` and
    ``Future[Tensor]`` at registration.
    """
    return state.average(bucket.buffer())


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch DDP whose gradients are averaged by ``manager.allreduce``.

    ``DistributedDataParallel(manager, module, **ddp_kwargs)``: ``ddp_kwargs`` go to
    torch's DDP, except ``process_group``/``device_mesh`` (the wrapper supplies a dummy
    group), ``find_unused_parameters=False`` and ``static_graph=True`` (both let torch
    rebuild buckets, which breaks a restarted replica; see the module docstring).

    Parameters are not broadcast at construction (the dummy group has no peers): the
    manager makes replicas agree by healing (``init_sync``) before the first commit.
    A failed or partial gradient allreduce never raises out of ``backward()``: the
    step just does not commit, and the next one trains normally.
    """

    def __init__(self, manager: GradientManager, module: nn.Module, **ddp_kwargs: Any) -> None:
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
        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **ddp_kwargs)
        self._rallypoint_manager = manager
        self._averager = _BucketAverager(manager)
        self.register_comm_hook(self._averager, _manager_comm_hook)
        register = getattr(manager, "register_sdc_params", None)  # rallypoint's Manager: the parameter check
        if register is not None:
            register(list(module.parameters()))

    @property
    def manager(self) -> GradientManager:
        """The manager gradients are averaged through."""
        return self._rallypoint_manager

    @property
    def buckets_reduced(self) -> int:
        """Gradient buckets handed to the manager so far (all steps)."""
        return self._averager.buckets

    @property
    def bucket_failures(self) -> int:
        """Buckets whose allreduce raised outside the manager's own error handling."""
        return self._averager.failures

    def shutdown(self) -> None:
        """Stop the helper thread that waits for allreduces (optional: it is a daemon)."""
        self._averager.shutdown()


__all__ = ["DistributedDataParallel"]
