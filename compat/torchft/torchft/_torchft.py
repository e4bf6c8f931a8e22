"""``torchft._torchft``: torchft's native module, answered by rallypoint's Python
lighthouse and manager servers and clients."""

from rallypoint.lighthouse.client import LighthouseClient
from rallypoint.lighthouse.quorum import Member as QuorumMember
from rallypoint.lighthouse.quorum import Quorum
from rallypoint.lighthouse.server import LighthouseServer
from rallypoint.manager.client import ManagerClient
from rallypoint.manager.server import ManagerServer

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer", "Quorum", "QuorumMember"]
