"""Reconfigurable process groups for fault-tolerant data parallelism.

See docs/design.md, "Process groups". Everything here is a ``torch.distributed.ProcessGroup``
whose membership is replaced by ``configure()`` (torchft 0.2) or ``reconfigure()`` (torchft
0.3 / torch >= 2.14, with :class:`ReconfigureOptions`) at every quorum change, whose waits
are bounded by a timeout, and whose failures surface through ``errored()``.

The names below are imported from their submodules on first access (PEP 562), so that
``rallypoint.process_groups.protocols`` (all a ``Manager`` needs of its group) and a
``ProcessGroupGloo`` do not pull in the subprocess-isolated ("baby") groups, NCCL and
the wrappers: a cold ``Manager(...)`` imports only what it uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import DEFAULT_TIMEOUT, GroupConfig, ProcessGroup
    from .errors import NotConfiguredError, ProcessGroupAborted, ProcessGroupError, ProcessGroupTimeout
    from .gloo import ProcessGroupGloo
    from .baby import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
    from .nccl import ProcessGroupNCCL
    from .protocols import AllgatherGroup, ReconfigurableProcessGroup
    from .reconfigure import ReconfigureOptions
    from .store_exchange import reconfigure_with_store
    from .wrappers import (
        ErrorSwallowingProcessGroupWrapper,
        FakeProcessGroupWrapper,
        ManagedCollectives,
        ManagedProcessGroup,
        ProcessGroupDummy,
        ProcessGroupWrapper,
    )

#: public name -> the submodule that defines it
_LAZY: dict[str, str] = {
    "DEFAULT_TIMEOUT": "base",
    "GroupConfig": "base",
    "ProcessGroup": "base",
    "NotConfiguredError": "errors",
    "ProcessGroupAborted": "errors",
    "ProcessGroupError": "errors",
    "ProcessGroupTimeout": "errors",
    "ProcessGroupGloo": "gloo",
    "ProcessGroupBaby": "baby",
    "ProcessGroupBabyGloo": "baby",
    "ProcessGroupBabyNCCL": "baby",
    "ProcessGroupNCCL": "nccl",
    "AllgatherGroup": "protocols",
    "ReconfigurableProcessGroup": "protocols",
    "ReconfigureOptions": "reconfigure",
    "reconfigure_with_store": "store_exchange",
    "ErrorSwallowingProcessGroupWrapper": "wrappers",
    "FakeProcessGroupWrapper": "wrappers",
    "ManagedCollectives": "wrappers",
    "ManagedProcessGroup": "wrappers",
    "ProcessGroupDummy": "wrappers",
    "ProcessGroupWrapper": "wrappers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "ReconfigureOptions",
    "reconfigure_with_store",
]
