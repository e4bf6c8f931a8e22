"""Training-loop integrations built on the ``Manager``: wrappers that route a framework's
own communication through the manager, so its failures become uncommitted steps.

- :class:`DistributedDataParallel` — torch DDP whose gradient buckets are averaged over
  every rank of every participating replica group: inside the group over its own process
  group, across groups by ``manager.allreduce`` (a peer group's death mid-backward fails
  the step, never ``backward()``).
- :class:`Optimizer` (alias :data:`OptimizerWrapper`) — ``zero_grad()`` starts the
  quorum, ``step()`` steps only on commit; ``register_scheduler`` heals LR schedules.
- :class:`DistributedSampler` — disjoint shards per replica group and rank; its position
  is part of the healed state.
- :func:`fully_shard_replicated` (:mod:`.fsdp`) — FSDP2 over a replica group's ranks (its
  reduce-scatter averages inside the group), the gradient shards averaged across groups
  by the manager (HSDP), heals read and loaded on the training thread.

DDP and HSDP give the same numbers as torch's DDP over all ranks of the participating
groups: the mean over every rank of every group, so the ranks of a group never drift
apart without user code.
- :class:`LocalSGD`, :class:`DiLoCo` (:mod:`.local_sgd`) — periodic parameter averaging
  and (Streaming) DiLoCo: an outer optimizer on averaged pseudo-gradients, fragment by
  fragment, the exchange overlapping inner steps; a failed sync restores the global
  parameters from a backup.

What each one needs of its ``manager`` is a ``typing.Protocol`` (:class:`ManagerLike`
and the narrower :class:`OptimizerManager`, :class:`GradientManager`,
:class:`FSDPManager`, :class:`LocalSGDManager`, :class:`DiLoCoManager`): any object with
those members works, torchft's ``Manager`` and test fakes included.

``rallypoint.integrations`` may import ``manager``, ``process_groups`` and
``transports``; nothing below the public face imports it.
"""

from rallypoint.integrations._protocols import (
    DiLoCoManager,
    FSDPManager,
    GradientManager,
    LocalSGDManager,
    ManagerLike,
    OptimizerManager,
)
from rallypoint.integrations.data import DistributedSampler
from rallypoint.integrations.ddp import DistributedDataParallel
from rallypoint.integrations.fsdp import ReplicatedFSDP, fully_shard_replicated, register_state
from rallypoint.integrations.local_sgd import DiLoCo, LocalSGD
from rallypoint.integrations.optim import Optimizer, OptimizerWrapper

__all__ = [
    "DiLoCo",
    "DiLoCoManager",
    "DistributedDataParallel",
    "DistributedSampler",
    "FSDPManager",
    "GradientManager",
    "LocalSGD",
    "LocalSGDManager",
    "ManagerLike",
    "Optimizer",
    "OptimizerManager",
    "OptimizerWrapper",
    "ReplicatedFSDP",
    "fully_shard_replicated",
    "register_state",
]
