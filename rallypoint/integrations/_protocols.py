"""What each integration needs of the manager it is given, as ``typing.Protocol``s.

Why protocols, and why one per integration: the integrations take "a manager", not
necessarily :class:`rallypoint.manager.Manager`. torchft 0.2's ``Manager`` works with
the DDP wrapper, the optimizer wrapper and LocalSGD/DiLoCo, and tests drive them with
small fakes; none of these derive from a class of ours. Each protocol lists exactly
what its integration calls, so an object plugs in as soon as it has those members
(structurally: no base class, no registration), a smaller fake suffices for a smaller
integration, and mypy checks both the integrations' calls and, at the end of this
module, that our ``Manager`` provides everything (:class:`ManagerLike`).

Members read with ``getattr`` and a default are optional and not listed: DiLoCo's
``_use_async_quorum``, ``_setup_rounds`` and ``_count_setup_round``, FSDP's
``group_rank`` and ``group_world_size``.

:data:`AVG` is ``ReduceOp.AVG`` typed as the ``ReduceOp`` the managers' signatures take
(torch's stubs type the members as ``ReduceOp.RedOpType``, an unrelated class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar, cast, runtime_checkable

import torch
from torch.distributed import ReduceOp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")

#: ``ReduceOp.AVG`` as a ``ReduceOp`` (the same object; see the module docstring).
AVG = cast(ReduceOp, ReduceOp.AVG)


@runtime_checkable
class Waitable(Protocol):
    """What ``manager.allreduce`` returns, as the integrations use it: something to
    ``wait()`` on (a torch ``Work``, a rallypoint ``ManagedWork``, a fake's own)."""

    def wait(self) -> object: ...


@runtime_checkable
class StateRegistry(Protocol):
    """Registers state that a healing replica receives from a peer."""

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[T], None],
                               state_dict: Callable[[], T]) -> None: ...


@runtime_checkable
class OptimizerManager(StateRegistry, Protocol):
    """What :class:`~rallypoint.integrations.Optimizer` needs: the quorum started by
    ``zero_grad()``, the commit barrier in ``step()``, and (for schedulers) state
    registration."""

    def start_quorum(self) -> None: ...

    def should_commit(self) -> bool: ...


@runtime_checkable
class GradientManager(Protocol):
    """What :class:`~rallypoint.integrations.DistributedDataParallel` and FSDP's
    gradient hook need: a mean over the replicas that never raises for a peer's
    failure, and a place to report anything else so the step does not commit."""

    def allreduce(self, tensor: torch.Tensor, /, *, reduce_op: ReduceOp = ...) -> Waitable: ...

    def report_error(self, e: Exception) -> None: ...


@runtime_checkable
class FSDPManager(GradientManager, StateRegistry, Protocol):
    """What :func:`~rallypoint.integrations.fully_shard_replicated` and
    :func:`~rallypoint.integrations.register_state` need besides gradient averaging:
    heals served and applied on the training thread, with the mesh received DTensors
    are rebuilt on."""

    heal_on_training_thread: bool
    heal_mesh: DeviceMesh | None


@runtime_checkable
class LocalSGDManager(Protocol):
    """What :class:`~rallypoint.integrations.LocalSGD` needs: one quorum, a mean of
    the parameters and a commit barrier per sync; the step for its log lines."""

    def start_quorum(self) -> None: ...

    def allreduce(self, tensor: torch.Tensor, /) -> Waitable: ...

    def should_commit(self) -> bool: ...

    def current_step(self) -> int: ...


@runtime_checkable
class DiLoCoManager(LocalSGDManager, StateRegistry, Protocol):
    """What :class:`~rallypoint.integrations.DiLoCo` (and each of its fragments) needs
    besides LocalSGD's: the fragments' global state registered for heals, and the
    quantized allreduce (``should_quantize=True`` is only passed when asked for)."""

    def allreduce(self, tensor: torch.Tensor, /, *, should_quantize: bool = ...) -> Waitable: ...


@runtime_checkable
class ManagerLike(OptimizerManager, FSDPManager, DiLoCoManager, Protocol):
    """Everything the integrations need of a manager: :class:`rallypoint.manager.Manager`
    satisfies it (checked by mypy below); torchft's ``Manager`` satisfies every protocol
    here except :class:`FSDPManager` (it cannot heal on the training thread)."""

    def allreduce(self, tensor: torch.Tensor, /, *, should_quantize: bool = ...,
                  reduce_op: ReduceOp = ...) -> Waitable: ...


if TYPE_CHECKING:  # mypy proves our Manager satisfies the protocol; nothing here runs
    from rallypoint.manager.manager import Manager

    def _conforms(manager: Manager) -> ManagerLike:
        return manager


__all__ = [
    "AVG",
    "DiLoCoManager",
    "FSDPManager",
    "GradientManager",
    "LocalSGDManager",
    "ManagerLike",
    "OptimizerManager",
    "StateRegistry",
    "Waitable",
]
