"""``torchft.checkpointing.http_transport``: rallypoint's HTTP checkpoint transport."""

from rallypoint.transports.http import HTTPTransport

__all__ = ["HTTPTransport"]
