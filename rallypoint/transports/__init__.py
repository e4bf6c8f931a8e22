"""Checkpoint transports: how a healing replica copies state from a live peer.

* :mod:`.wire` - the safe wire format (JSON header + raw tensor bytes; never unpickles).
* :class:`CheckpointTransport` - the interface (torchft's names); :class:`CheckpointTransportLike`
  the Protocol a user's or torchft's transport satisfies structurally.
* :class:`HTTPTransport` - a small threaded HTTP/1.1 server and client (the standard
  library's ``http.client``), parallel ranges striped over every live peer.
* :class:`PGTransport` - send/recv over a (reconfigurable) process group.

``HTTPTransport`` is imported lazily so ``import rallypoint.transports.wire`` does not pull
in the HTTP server and client.
"""

from __future__ import annotations

from typing import Any

from rallypoint.transports.base import CheckpointTransport, CheckpointTransportLike
from rallypoint.transports.wire import WireError

__all__ = ["CheckpointTransport", "CheckpointTransportLike", "HTTPTransport", "PGTransport", "WireError"]


def __getattr__(name: str) -> Any:
    if name == "HTTPTransport":
        from rallypoint.transports.http import HTTPTransport

        return HTTPTransport
    if name == "PGTransport":
        from rallypoint.transports.pg import PGTransport

        return PGTransport
    raise AttributeError(name)
