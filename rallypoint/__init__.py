"""rallypoint: keep data-parallel PyTorch training running while machines fail.

The lighthouse side (``rallypoint.lighthouse``, ``rallypoint.cli``) imports no torch,
so the service starts fast and runs on hosts without torch. The torch-side API is
exposed lazily: attributes listed in ``_LAZY`` are imported on first access, and
``dir(rallypoint)`` lists them all (``__dir__``) so completion and ``help()`` see them.
"""

from __future__ import annotations

import importlib
from typing import Any

from rallypoint._net.version import __version__

# public name -> "module:attribute"; filled in as the torch-side components land.
_LAZY: dict[str, str] = {
    "LighthouseServer": "rallypoint.lighthouse.server:LighthouseServer",
    "LighthouseClient": "rallypoint.lighthouse.client:LighthouseClient",
    "LivenessStream": "rallypoint.lighthouse.client:LivenessStream",
    "Manager": "rallypoint.manager.manager:Manager",
    "WorldSizeMode": "rallypoint.manager.manager:WorldSizeMode",
    "DurableCheckpoint": "rallypoint.checkpoint.durable:DurableCheckpoint",
    "DistributedDataParallel": "rallypoint.integrations.ddp:DistributedDataParallel",
    "Optimizer": "rallypoint.integrations.optim:Optimizer",
    "OptimizerWrapper": "rallypoint.integrations.optim:OptimizerWrapper",
    "DistributedSampler": "rallypoint.integrations.data:DistributedSampler",
    "LocalSGD": "rallypoint.integrations.local_sgd:LocalSGD",
    "DiLoCo": "rallypoint.integrations.local_sgd:DiLoCo",
    "fully_shard_replicated": "rallypoint.integrations.fsdp:fully_shard_replicated",
    "ProcessGroupGloo": "rallypoint.process_groups:ProcessGroupGloo",
    "ProcessGroupBabyGloo": "rallypoint.process_groups:ProcessGroupBabyGloo",
    "ProcessGroupNCCL": "rallypoint.process_groups:ProcessGroupNCCL",
    "ProcessGroupBabyNCCL": "rallypoint.process_groups:ProcessGroupBabyNCCL",
    "HTTPTransport": "rallypoint.transports.http:HTTPTransport",
    "PGTransport": "rallypoint.transports.pg:PGTransport",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import a public name of ``_LAZY`` on first access (PEP 562) and keep it."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'rallypoint' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (``__all__``), loaded or not, as ``dir(rallypoint)`` shows them."""
    return sorted(__all__)
