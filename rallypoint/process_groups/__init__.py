"""Reconfigurable process groups for fault-tolerant data parallelism.

See DESIGN.md, "Process groups". Everything here is a ``torch.distributed.ProcessGroup``
whose membership is replaced by ``configure()`` at every quorum change, whose waits
are bounded by a timeout, and whose failures surface through ``errored()``.
"""

from .base import DEFAULT_TIMEOUT, GroupConfig, ProcessGroup
from .errors import NotConfiguredError, ProcessGroupAborted, ProcessGroupError, ProcessGroupTimeout
from .gloo import ProcessGroupGloo
from .baby import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from .nccl import ProcessGroupNCCL
from .protocols import AllgatherGroup, ReconfigurableProcessGroup
from .wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedCollectives,
    ManagedProcessGroup,
    ProcessGroupDummy,
    ProcessGroupWrapper,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "GroupConfig",
    "ProcessGroup",
    "ProcessGroupGloo",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupNCCL",
    "ProcessGroupDummy",
    "ProcessGroupWrapper",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedCollectives",
    "ManagedProcessGroup",
    "ProcessGroupError",
    "ProcessGroupTimeout",
    "ProcessGroupAborted",
    "NotConfiguredError",
    "AllgatherGroup",
    "ReconfigurableProcessGroup",
]
