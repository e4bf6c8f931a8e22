"""``torchft.local_sgd``: rallypoint's LocalSGD and DiLoCo."""

from rallypoint.integrations.local_sgd import DiLoCo, LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]
