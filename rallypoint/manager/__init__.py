"""The manager: per-rank quorum results (:mod:`.recovery`), the per-replica-group gRPC
``ManagerServer`` (:mod:`.server`) and its ``ManagerClient`` (:mod:`.client`).

Submodules are imported lazily so that importing ``rallypoint.manager.recovery`` pulls
in no gRPC server machinery.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Manager", "ManagerClient", "ManagerServer", "QuorumResult", "WorldSizeMode", "compute_quorum_result"]


def __getattr__(name: str) -> Any:
    if name in ("QuorumResult", "compute_quorum_result"):
        from rallypoint.manager import recovery

        return getattr(recovery, name)
    if name == "ManagerServer":
        from rallypoint.manager.server import ManagerServer

        return ManagerServer
    if name in ("Manager", "WorldSizeMode"):
        from rallypoint.manager import manager

        return getattr(manager, name)
    if name == "ManagerClient":
        from rallypoint.manager.client import ManagerClient

        return ManagerClient
    raise AttributeError(f"module 'rallypoint.manager' has no attribute {name!r}")
