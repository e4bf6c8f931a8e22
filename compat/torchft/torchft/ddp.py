"""``torchft.ddp``: rallypoint's DistributedDataParallel (gradients averaged across replica
groups) and torchft's experimental pure-Python one."""

from rallypoint.integrations.ddp import DistributedDataParallel, PureDistributedDataParallel

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]
