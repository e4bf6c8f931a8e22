"""torchft-nightly's ``torchft.process_group``: 0.2.0's names plus the reconfigure API's.

- ``ReconfigureOptions`` (torch's own class on torch >= 2.14), ``reconfigure_with_store``
  and ``create_store_client``: rallypoint's;
- ``_rendezvous(opts, handle_id)`` is torchft's private parser of ordered handles; its
  ``reconfigure_test.py`` calls it, so it is answered by rallypoint's parser,
  ``rendezvous_of(uuid, handles, own_id)``, with torchft's argument order.
"""

from __future__ import annotations

from typing import Any

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
    ReconfigureOptions,
)
from rallypoint.process_groups.reconfigure import Rendezvous, rendezvous_of
from rallypoint.process_groups.store_exchange import create_store_client, reconfigure_with_store  # noqa: F401


def _rendezvous(opts: Any, handle_id: str) -> Rendezvous:
    return rendezvous_of(opts.uuid, opts.handles, handle_id)
