"""The network layer at the bottom of rallypoint: address spellings, gRPC server and
channel options and size limits, the job credential and its checks, RPC error
translation, and the version string.

It imports nothing else of rallypoint, so the lighthouse, the manager, the transports
and the process groups all build on one copy of each rule (two copies had diverged:
receive limits, port-0 handling, timeouts).
"""

from rallypoint._net.version import __version__

__all__ = ["__version__"]
