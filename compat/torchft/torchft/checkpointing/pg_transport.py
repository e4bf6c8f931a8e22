"""``torchft.checkpointing.pg_transport``: rallypoint's process-group checkpoint transport."""

from rallypoint.transports.pg import PGTransport

__all__ = ["PGTransport"]
