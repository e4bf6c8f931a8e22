"""``torchft.coordination``: rallypoint's lighthouse and manager servers and clients
(wire-compatible with torchft's), under torchft's low-level coordination names."""

from torchft._torchft import (
    LighthouseClient,
    LighthouseServer,
    ManagerClient,
    ManagerServer,
    Quorum,
    QuorumMember,
)

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerServer", "ManagerClient", "Quorum", "QuorumMember"]
