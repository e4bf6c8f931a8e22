"""``torchft.process_group``: rallypoint's reconfigurable process groups.

Both APIs: torchft 0.2.0's ``configure()`` and torchft-nightly's reconfigure API
(``ReconfigureOptions``, ``reconfigure_with_store``, ``create_store_client``).
``_rendezvous(opts, handle_id)`` is torchft-nightly's private parser of ordered handles;
its own ``reconfigure_test.py`` calls it, so it is answered by rallypoint's parser with
torchft's argument order.
"""

from typing import Any

from rallypoint.process_groups import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    ReconfigureOptions,
)
from rallypoint.process_groups.reconfigure import Rendezvous, rendezvous_of
from rallypoint.process_groups.store_exchange import create_store_client, reconfigure_with_store


def _rendezvous(opts: Any, handle_id: str) -> Rendezvous:
    """torchft-nightly's ``_rendezvous``: this rank's place among ``opts.handles``."""
    return rendezvous_of(opts.uuid, opts.handles, handle_id)


__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ReconfigureOptions",
    "create_store_client",
    "reconfigure_with_store",
]
