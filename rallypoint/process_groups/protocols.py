"""What the rest of rallypoint needs of a process group, as ``typing.Protocol``s.

Why protocols, not the :class:`~rallypoint.process_groups.ProcessGroup` base class: the
``Manager`` is handed its cross-replica group by the user, and that group need not be
one of ours. torchft 0.2's groups (``torchft.process_group.ProcessGroupGloo`` & co.), a
wrapper a user wrote, or a test double all work as long as they have the methods below;
nothing checks their class. The protocols name exactly what is called, so mypy checks
both sides: our groups against the protocol (see the end of this module) and the
manager's calls against what the protocol promises.

``opts`` is typed ``Any`` on purpose: the manager passes a ``ReduceOp`` (torch's stubs
type its members as ``ReduceOp.RedOpType``), torch's groups take ``AllreduceOptions`` /
``AllgatherOptions``, and torchft's annotate it as a union of those or ``object``. Any
narrower type would reject one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch.distributed.distributed_c10d import Work


@runtime_checkable
class AllgatherGroup(Protocol):
    """What :func:`~rallypoint.process_groups.quantization.allreduce_quantized` needs:
    the group's size and a coalesced allgather into flat tensors. Every rallypoint group,
    torchft's groups and torch's own gloo/NCCL groups have both. (A group's ``timeout()``
    is used as the default bound when it has one; it is optional.)"""

    def size(self) -> int: ...

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any, /
    ) -> Work: ...


@runtime_checkable
class ReconfigurableProcessGroup(AllgatherGroup, Protocol):
    """The process group a ``Manager`` is given (its ``pg`` argument), as the manager
    uses it: reconfigured for every new quorum, one allreduce per ``Manager.allreduce``
    (the quantized path goes through :class:`AllgatherGroup`'s members), its first error
    read back at the commit barrier, and aborted so that collectives blocked on a dead
    peer fail at once.

    A structural type so that any group plugs in (see the module docstring):
    rallypoint's groups, torchft 0.2's, a user's own. The Manager also takes groups that
    have torchft 0.3's ``reconfigure()`` instead of ``configure()`` (torchft-nightly's,
    torch's own created with ``enable_reconfigure=True``): see ``manager/_reconfig.py``. ``shutdown()`` is not part of it:
    the group belongs to the caller, and the manager never shuts it down.
    """

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        /,
        *,
        quorum_id: int | None,
        group_rank: int | None,
        group_world_size: int | None,
    ) -> None:
        """Replace the communicator with one for ``world_size`` ranks of ``quorum_id``
        (``store_addr``: ``host:port/prefix`` of the store to rendezvous through)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any, /) -> Work:
        """Reduce ``tensors`` in place; ``opts`` is a ``ReduceOp`` or ``AllreduceOptions``."""

    def errored(self) -> Exception | None:
        """The first error since the last ``configure`` (None while healthy)."""

    def abort(self) -> None:
        """Make pending and later collectives fail now (until the next ``configure``)."""


if TYPE_CHECKING:  # mypy proves our groups satisfy the protocols; nothing here runs
    from .baby import ProcessGroupBabyGloo, ProcessGroupBabyNCCL
    from .gloo import ProcessGroupGloo
    from .nccl import ProcessGroupNCCL
    from .wrappers import (
        ErrorSwallowingProcessGroupWrapper,
        FakeProcessGroupWrapper,
        ProcessGroupDummy,
        ProcessGroupWrapper,
    )

    def _conforms(
        gloo: ProcessGroupGloo,
        nccl: ProcessGroupNCCL,
        baby_gloo: ProcessGroupBabyGloo,
        baby_nccl: ProcessGroupBabyNCCL,
        dummy: ProcessGroupDummy,
        wrapper: ProcessGroupWrapper,
        swallowing: ErrorSwallowingProcessGroupWrapper,
        fake: FakeProcessGroupWrapper,
        torch_group: torch.distributed.ProcessGroup,
    ) -> None:
        groups: list[ReconfigurableProcessGroup] = [
            gloo, nccl, baby_gloo, baby_nccl, dummy, wrapper, swallowing, fake,
        ]
        gathering: list[AllgatherGroup] = [torch_group, *groups]
        del groups, gathering


__all__ = ["AllgatherGroup", "ReconfigurableProcessGroup"]
