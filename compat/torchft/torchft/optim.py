"""``torchft.optim``: rallypoint's healing optimizer wrapper."""

from rallypoint.integrations.optim import OptimizerWrapper

__all__ = ["OptimizerWrapper"]
