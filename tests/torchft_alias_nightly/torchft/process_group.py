"""torchft-nightly's ``torchft.process_group``: 0.2.0's names plus the reconfigure API's
(``ReconfigureOptions``; torch's own class on torch >= 2.14)."""

from rallypoint.process_groups import (  # noqa: F401
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
)

try:  # the reconfigure API (issue 36: branch pgreconf)
    from rallypoint.process_groups import ReconfigureOptions  # noqa: F401
except ImportError:  # pragma: no cover - before it lands
    pass
