"""Groups that wrap or stand in for a real one.

- :class:`ProcessGroupDummy`: every op completes at once (DDP needs a group at
  construction, before the first quorum exists).
- :class:`ProcessGroupWrapper`: delegates everything to an inner group.
- :class:`ErrorSwallowingProcessGroupWrapper`: the first failure is recorded and
  later ops become no-ops until the next configure, so a training step never raises
  mid-way; the manager reads ``errored()`` and refuses to commit.
- :class:`FakeProcessGroupWrapper`: injects a chosen failure into the next op.
- :class:`ManagedProcessGroup`: routes allreduce to any :class:`ManagedCollectives`
  (the manager satisfies it; this package never imports the manager).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.distributed_c10d import ReduceOp, Work

from .base import DEFAULT_TIMEOUT, GroupConfig, ProcessGroup
from .errors import ProcessGroupError
from .gloo import divide_, op_name, reduce_op_of
from .work import CompletedWork, FailedWork

logger = logging.getLogger("rallypoint.process_groups.wrappers")

_OPS = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_into_tensor_coalesced", "broadcast",
    "reduce_scatter", "reduce_scatter_tensor_coalesced", "alltoall_base", "send", "recv", "barrier",
)


class ProcessGroupDummy(ProcessGroup):
    """Completes every op at once, as if every peer held exactly our tensors.

    Reductions and broadcasts leave tensors as they are (the average of identical
    values); gathers fill every slot with our input (DDP's construction-time check
    allgathers parameter shapes and must find them equal); reduce-scatters and
    all-to-alls hand back our own chunk. ``rank``/``world_size`` are reported as
    given, so code that sizes buffers by ``size()`` sees a plausible group.
    """

    backend_name = "rallypoint-dummy"

    def __init__(self, rank: int = 0, world_size: int = 1, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._config = GroupConfig("", "", rank, world_size)
        self.ops = 0  # how many ops were issued (tests and demos read it)

    def _configure(self, cfg: GroupConfig) -> None:
        pass

    def _done(self, result: Any = None) -> Work:
        self.ops += 1
        return CompletedWork(result)

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        return self._done([tensors] if isinstance(tensors, torch.Tensor) else list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._done(list(tensors))

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self._done(list(tensor_list))

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            for o in outs:
                o.copy_(inp)
        return self._done(output_tensors)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        for o, i in zip(outputs, inputs, strict=True):
            o.view(-1, i.numel()).copy_(i.reshape(1, -1))
        return self._done(list(outputs))

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Work:  # type: ignore[override]
        for o, ins in zip(output_tensors, input_tensors, strict=True):
            o.copy_(ins[self.rank()])
        return self._done(list(output_tensors))

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        r = self.rank()
        for o, i in zip(outputs, inputs, strict=True):
            o.copy_(i.reshape(-1)[r * o.numel() : (r + 1) * o.numel()].view_as(o))
        return self._done(list(outputs))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Work:  # type: ignore[override]
        if output.numel() == input.numel():
            output.copy_(input.view_as(output))
        return self._done([output])

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        return self._done()

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Work:  # type: ignore[override]
        return self._done(list(tensors))

    def barrier(self, opts: Any = None) -> Work:  # type: ignore[override]
        return self._done()


class ProcessGroupWrapper(ProcessGroup):
    """Delegates configure, lifecycle and every collective to ``pg``.

    ``rank()``/``size()`` are the inner group's (configured) values.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg.timeout())
        self._pg = pg

    @property
    def parent(self) -> ProcessGroup:
        return self._pg

    def _apply_config(self, cfg: GroupConfig) -> None:
        # configure() and reconfigure() both end here: the inner group is rebuilt.
        self._pg._apply_config(cfg)

    # The reconfigure identity is the inner group's, so its handle and ours are one.
    def set_rank_info(self, replica_id: str, group_rank: int, group_world_size: int,
                      global_rank: int | None = None) -> None:
        super().set_rank_info(replica_id, group_rank, group_world_size, global_rank)
        self._pg.set_rank_info(replica_id, group_rank, group_world_size, global_rank)

    def _handle_id(self) -> str:
        return self._pg._handle_id()

    def get_reconfigure_handle(self) -> str:  # type: ignore[override]
        return self._pg.get_reconfigure_handle()

    def set_handle_host(self, host: str) -> None:
        self._pg.set_handle_host(host)

    def abort(self) -> None:
        self._pg.abort()

    def shutdown(self) -> None:
        self._pg.shutdown()

    def errored(self) -> Exception | None:
        return self._pg.errored()

    def set_timeout(self, timeout: timedelta) -> None:
        self._pg.set_timeout(timeout)

    def timeout(self) -> timedelta:
        return self._pg.timeout()

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()

    @property
    def config(self) -> GroupConfig | None:
        return self._pg.config

    def getBackendName(self) -> str:  # noqa: N802
        return self._pg.getBackendName()

    def _call(self, name: str, *args: Any) -> Work:
        return getattr(self._pg, name)(*args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._pg!r})"


for _name in _OPS:
    def _make_delegate(name: str) -> Callable[..., Work]:
        def op(self: ProcessGroupWrapper, *args: Any) -> Work:
            return self._call(name, *args)

        op.__name__ = name
        op.__doc__ = f"{name} on the wrapped group."
        return op

    setattr(ProcessGroupWrapper, _name, _make_delegate(_name))


class _SwallowingWork(Work):
    """Waits on the inner Work; a failure is recorded on the wrapper, not raised."""

    def __init__(self, inner: Work, wrapper: "ErrorSwallowingProcessGroupWrapper", result: Any) -> None:
        super().__init__()
        self._inner = inner
        self._wrapper = wrapper
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._inner.wait(timeout) if timeout is not None else self._inner.wait()
        except Exception as e:  # noqa: BLE001 - swallowing is the point
            self._wrapper.report_error(e)
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        result = self._result

        def done(f: torch.futures.Future) -> Any:
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001
                self._wrapper.report_error(e)
                return result

        return self._inner.get_future().then(done)


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Records the first error of any op instead of raising; later ops are no-ops.

    The error (from the call or from the Work) is kept until the next ``configure``;
    ``errored()`` returns it. Tensors of swallowed ops are left as they were.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._swallowed: Exception | None = None
        self._lock = threading.Lock()

    def report_error(self, e: Exception) -> None:
        with self._lock:
            if self._swallowed is None:
                self._swallowed = e
                logger.warning("swallowed process group error (ops are no-ops until reconfigure): %s", e)

    def error(self) -> Exception | None:
        return self._swallowed

    def errored(self) -> Exception | None:
        return self._swallowed or self._pg.errored()

    def _apply_config(self, cfg: GroupConfig) -> None:
        with self._lock:
            self._swallowed = None
        super()._apply_config(cfg)

    def _call(self, name: str, *args: Any) -> Work:
        first = args[0] if args else None
        result = first if isinstance(first, list) else None
        if self._swallowed is not None:
            return CompletedWork(result)
        try:
            inner = getattr(self._pg, name)(*args)
        except Exception as e:  # noqa: BLE001
            self.report_error(e)
            return CompletedWork(result)
        return _SwallowingWork(inner, self, result)


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Makes the next op fail with a chosen error (tests and demos of recovery).

    ``inject(exc, on="wait")`` -> the next op's Work raises ``exc`` from ``wait()``
    (and its future fails); ``on="call"`` -> the next op call itself raises. The
    injection fires once. The inner op is not issued, so peers see this rank
    missing, exactly as for a real failure. And as after a real failure, the group is
    broken until the next ``configure()``: every later op fails without being issued.
    Issuing them would pair this rank's next op with its peers' injected-away one
    (another size, in gloo an uncaught exception in its event loop, and SIGABRT),
    as soon as the ranks' failures land in different rounds.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._pending: tuple[Exception, str] | None = None
        self._broken: Exception | None = None  # the injected failure, until configure()
        self._lock = threading.Lock()
        self.injected = 0

    def _apply_config(self, cfg: GroupConfig) -> None:
        with self._lock:
            self._broken = None
        super()._apply_config(cfg)

    def inject(self, exc: Exception | None = None, on: str = "wait") -> None:
        if on not in ("wait", "call"):
            raise ValueError("on must be 'wait' or 'call'")
        with self._lock:
            self._pending = (exc or ProcessGroupError("injected failure", op="injected"), on)

    # torchft's name for the same thing
    def report_future_error(self, exc: Exception) -> None:
        self.inject(exc, on="wait")

    def _call(self, name: str, *args: Any) -> Work:
        with self._lock:
            pending, self._pending = self._pending, None
            broken = self._broken
            if pending is not None:
                self._broken = pending[0]
        if pending is None:
            if broken is not None:
                return FailedWork(ProcessGroupError(
                    f"{name} not issued: an earlier op of this configuration failed ({broken!r}); reconfigure the group",
                    op=name))
            return getattr(self._pg, name)(*args)
        exc, on = pending
        self.injected += 1
        logger.info("injecting %r into %s", exc, name)
        if on == "call":
            raise exc
        return FailedWork(exc)


@runtime_checkable
class ManagedCollectives(Protocol):
    """What :class:`ManagedProcessGroup` needs: the manager's averaging allreduce."""

    def allreduce(self, tensor: torch.Tensor) -> Work: ...

    def num_participants(self) -> int: ...


def managed_route(op: Any, comm_takes_op: bool) -> str:
    """How :class:`ManagedProcessGroup` runs an allreduce with ``op``: ``"avg"`` (the
    manager's mean as it is), ``"sum"`` (the mean times the participants), ``"pass"``
    (handed to the manager with the op: MAX, MIN, ...), or ``"refuse"`` (``comm`` cannot
    take an op)."""
    if op == ReduceOp.AVG:
        return "avg"
    if op == ReduceOp.SUM:
        return "sum"
    return "pass" if comm_takes_op else "refuse"


def _takes_reduce_op(comm: object) -> bool:
    """Whether ``comm.allreduce`` accepts a ``reduce_op`` keyword (the Manager's does)."""
    import inspect

    try:
        params = inspect.signature(comm.allreduce).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return False
    return "reduce_op" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class ManagedProcessGroup(ProcessGroup):
    """A group whose allreduce is ``comm.allreduce`` (which averages over live replicas).

    SUM multiplies the average back by ``num_participants()``; AVG is the average
    itself; other reductions (MAX, as TorchTitan's loss sync uses, MIN, PRODUCT, bitwise)
    pass through as torchft's do, to ``comm.allreduce(tensor, reduce_op=op)`` (the
    manager's; a replica that does not contribute puts in the op's identity). A ``comm``
    whose allreduce takes no ``reduce_op`` refuses them; other collectives are not
    defined across replicas that may drop out, so they raise. ``rank()`` is ``comm.participating_rank()``
    when ``comm`` has it (the manager does), else 0; ``size()`` is
    ``num_participants()``.
    """

    backend_name = "rallypoint-managed"

    def __init__(self, comm: ManagedCollectives, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not isinstance(comm, ManagedCollectives):
            raise TypeError(f"{type(comm).__name__} lacks allreduce(tensor) and num_participants()")
        super().__init__(timeout)
        self._comm = comm

    def configure(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        raise NotImplementedError("a ManagedProcessGroup is configured by its manager, not directly")

    @property
    def supports_reconfigure(self) -> bool:  # type: ignore[override]
        """False: its manager reconfigures the group underneath, never this one."""
        return False

    def reconfigure(self, opts: Any) -> Work:  # type: ignore[override]
        raise NotImplementedError("a ManagedProcessGroup is reconfigured by its manager, not directly")

    def size(self) -> int:
        return self._comm.num_participants()

    def rank(self) -> int:
        fn = getattr(self._comm, "participating_rank", None)
        r = fn() if callable(fn) else None
        return int(r) if r is not None else 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = reduce_op_of(opts)
        route = managed_route(op, _takes_reduce_op(self._comm))
        if route == "refuse":
            raise NotImplementedError(f"ManagedProcessGroup supports SUM and AVG, not {op_name(op)}, over "
                                      f"{type(self._comm).__name__} (its allreduce takes no reduce_op)")
        if len(tensors) != 1:
            works = [self.allreduce([t], opts) for t in tensors]
            from .gloo import _WorkChain

            return _WorkChain(works)
        tensor = tensors[0]
        if route == "pass":
            return self._comm.allreduce(tensor, reduce_op=op)  # type: ignore[call-arg]  # checked: _takes_reduce_op
        work = self._comm.allreduce(tensor)
        if route == "avg":
            return work
        n = self._comm.num_participants()
        return _ScaledWork(work, tensor, n)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        return self.allreduce(list(tensors), opts)


class _ScaledWork(Work):
    """The manager's average turned back into a SUM once it completed."""

    def __init__(self, inner: Work, tensor: torch.Tensor, n: int) -> None:
        super().__init__()
        self._inner = inner
        self._tensor = tensor
        self._n = n
        self._done = False
        self._lock = threading.Lock()

    def _scale(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                self._tensor.mul_(self._n)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._inner.wait(timeout) if timeout is not None else self._inner.wait()
        self._scale()
        return True

    def get_future(self) -> torch.futures.Future:
        def done(f: torch.futures.Future) -> Any:
            f.value()
            self._scale()
            return [self._tensor]

        return self._inner.get_future().then(done)


__all__ = [
    "ProcessGroupDummy",
    "ProcessGroupWrapper",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedCollectives",
    "ManagedProcessGroup",
    "divide_",
]
