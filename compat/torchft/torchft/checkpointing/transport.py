"""``torchft.checkpointing.transport``: the transport interface."""

from rallypoint.transports.base import CheckpointTransport

__all__ = ["CheckpointTransport"]
