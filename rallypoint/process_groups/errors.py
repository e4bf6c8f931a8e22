"""Errors raised by rallypoint process groups.

Why a dedicated hierarchy: the manager must tell "this quorum's group is broken,
reconfigure" apart from programming errors, and a person reading a log must see
which collective failed, among how many peers and in which quorum.
"""

from __future__ import annotations


class ProcessGroupError(RuntimeError):
    """A collective (or configure) failed; the group must be reconfigured.

    Attributes name the failing op, the number of peers and the quorum so that a
    caller can log or act on them without parsing the message.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        world_size: int | None = None,
        quorum_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.world_size = world_size
        self.quorum_id = quorum_id


class ProcessGroupTimeout(ProcessGroupError, TimeoutError):
    """A wait ran past the group's timeout (a peer is slow, hung or dead)."""


class ProcessGroupAborted(ProcessGroupError):
    """The group was aborted (by ``abort()``, a timeout or a dead child)."""


class NotConfiguredError(ProcessGroupError):
    """An op was issued before ``configure()`` (or after ``shutdown()``)."""


def describe(op: str, world_size: int | None, quorum_id: int | None, replica_id: str | None = None) -> str:
    """The common prefix of every error message: op, peers, quorum (and replica)."""
    who = f" (replica {replica_id})" if replica_id else ""
    return f"{op} among {world_size if world_size is not None else '?'} peers in quorum {quorum_id}{who}"
