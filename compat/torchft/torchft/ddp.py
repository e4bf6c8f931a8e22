"""``torchft.ddp``: rallypoint's DistributedDataParallel (gradients averaged across replica groups)."""

from rallypoint.integrations.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
