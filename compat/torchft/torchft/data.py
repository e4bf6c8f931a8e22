"""``torchft.data``: rallypoint's DistributedSampler (shards by replica group and rank)."""

from rallypoint.integrations.data import DistributedSampler

__all__ = ["DistributedSampler"]
