"""``torchft``, answered by rallypoint: an alias package for running torchft 0.2.0's own
integration tests (``tests/test_torchft_integ.py``) against rallypoint.

Each module here only re-exports rallypoint's public classes under torchft's module
paths. The test files themselves are copied unchanged from the installed torchft 0.2.0
wheel next to these modules at test time; nothing of torchft's code runs.
"""

from rallypoint import (  # noqa: F401
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    OptimizerWrapper,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
)
from rallypoint.manager.manager import WorldSizeMode  # noqa: F401

Optimizer = OptimizerWrapper
