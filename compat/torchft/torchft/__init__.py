"""``torchft``, answered by rallypoint (the ``rallypoint-torchft-compat`` distribution).

Install this in place of torchft and torchft (or TorchTitan) code runs on rallypoint
without changes: every module here re-exports rallypoint's classes under torchft's module
paths. Which names differ from torchft 0.2.0 / torchft-nightly, and why, is listed in
rallypoint's ``compat/parity.toml`` and checked by ``tools/torchft_parity.py``.

The submodules a trainer reaches as attributes (``torchft.process_group.ManagedProcessGroup``,
as TorchTitan does) are imported here, as torchft's own ``__init__`` does.
"""

from torchft import checkpointing, coordination, data, ddp, local_sgd, manager, optim, process_group
from torchft.data import DistributedSampler
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper as Optimizer
from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo, ProcessGroupNCCL

__all__ = (
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "ProcessGroupNCCL",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "checkpointing",
    "coordination",
    "data",
    "ddp",
    "local_sgd",
    "manager",
    "optim",
    "process_group",
)
