"""Training-loop integrations built on the ``Manager``: wrappers that route a framework's
own communication through the manager, so its failures become uncommitted steps.

- :class:`DistributedDataParallel` — torch DDP whose gradient buckets are averaged by
  ``manager.allreduce`` (a peer's death mid-backward fails the step, never ``backward()``).
- :class:`Optimizer` (alias :data:`OptimizerWrapper`) — ``zero_grad()`` starts the
  quorum, ``step()`` steps only on commit; ``register_scheduler`` heals LR schedules.
- :class:`DistributedSampler` — disjoint shards per replica group and rank; its position
  is part of the healed state.

``rallypoint.integrations`` may import ``manager``, ``process_groups`` and
``transports``; nothing below the public face imports it.
"""

from rallypoint.integrations.data import DistributedSampler
from rallypoint.integrations.ddp import DistributedDataParallel
from rallypoint.integrations.optim import Optimizer, OptimizerWrapper

__all__ = ["DistributedDataParallel", "DistributedSampler", "Optimizer", "OptimizerWrapper"]
