"""``torchft.checkpointing``: rallypoint's checkpoint transports (how a healing replica
copies state from a live peer)."""

from torchft.checkpointing.http_transport import HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]
