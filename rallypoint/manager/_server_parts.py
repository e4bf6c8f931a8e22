"""Small parts of the ``ManagerServer`` (``server.py``), kept apart so that the server stays
a thin shell: the pending Quorum round of a step, reading a caller's metadata, and the
default action of a ``Kill``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from rallypoint._net.lease import Grant
from rallypoint._proto import torchft_pb2 as pb
from rallypoint.manager._votes import new_future

log = logging.getLogger("rallypoint.manager")


def raw(payload: Any) -> bytes:
    return payload if isinstance(payload, bytes) else payload.SerializeToString()


def discard(held: set[Any], item: Any, _task: object) -> None:
    held.discard(item)


def header(context: grpc.aio.ServicerContext, key: str) -> str | None:
    """The (last) value of the caller's invocation metadata ``key``, or None."""
    value = None
    for k, v in context.invocation_metadata() or ():
        if k == key:
            value = v if isinstance(v, str) else v.decode("utf-8", "replace")
    return value


@dataclass(eq=False)
class QuorumRound:
    """The group's pending Quorum requests for one step."""

    step: int
    first_at: float
    requests: dict[int, pb.ManagerQuorumRequest] = field(default_factory=dict)
    deadlines: dict[int, float | None] = field(default_factory=dict)
    stats: dict[int, dict[str, Any] | None] = field(default_factory=dict)  # checked step stats, per rank
    result: asyncio.Future = field(default_factory=new_future)
    fired: bool = False
    inject: bytes = b""  # checked fault injections the lighthouse handed the group with its answer
    grant: Grant | None = None  # the lease the lighthouse granted with its answer


def default_kill(msg: str) -> None:
    for h in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            h.flush()
    # Let the Kill answer get out before the process goes.
    threading.Timer(0.2, os._exit, args=(1,)).start()


__all__ = ["QuorumRound", "default_kill", "discard", "header", "raw"]
