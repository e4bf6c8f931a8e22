"""Configuration helpers of the ``Manager``: arguments that fall back to the environment
(torchft's variable names and ours), and the log adapter that puts the replica id and
group rank in every line; the world size modes."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from enum import Enum
from typing import Any


def td(value: Any, env: tuple[str, ...], default: timedelta) -> timedelta:
    """A timeout: the first set variable of ``env`` (seconds) wins, then ``value``
    (a timedelta or seconds), then ``default``."""
    for name in env:
        raw = os.environ.get(name)
        if raw:
            return timedelta(seconds=float(raw))
    if value is None:
        return default
    return value if isinstance(value, timedelta) else timedelta(seconds=float(value))


def env(value: Any, *names: str) -> Any:
    """``value`` if given, else the first set environment variable of ``names``."""
    if value is not None:
        return value
    for name in names:
        raw = os.environ.get(name)
        if raw:
            return raw
    return None


class ReplicaLog(logging.LoggerAdapter):
    """Prefixes every message with ``[replica_id/group_rank]``."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['replica_id']}/{self.extra['group_rank']}] {msg}", kwargs  # type: ignore[index]


class WorldSizeMode(Enum):
    """DYNAMIC: every up-to-date replica contributes. FIXED_WITH_SPARES: exactly
    ``min_replica_size`` contribute; the others stay in sync and contribute zeros."""

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


__all__ = ["ReplicaLog", "WorldSizeMode", "env", "td"]
