"""The transport interface the manager heals through, named as torchft's so users can switch.

A transport moves one state dict from an up-to-date replica to one or more healing
replicas for one step. The sender calls :meth:`send_checkpoint` (may return before the
transfer ends) and later :meth:`disallow_checkpoint` (after which the state dict may be
mutated, so nothing more may be read from it); the receiver calls :meth:`recv_checkpoint`
with the sender's :meth:`metadata` string, which it got through the quorum.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointTransport(Generic[T], ABC):
    """Sends and receives checkpoints (state dicts) between replicas."""

    @abstractmethod
    def metadata(self) -> str:
        """What a receiver needs to reach this transport (for HTTP: the base URL)."""

    @abstractmethod
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Offer ``state_dict`` as the checkpoint of ``step`` to ``dst_ranks``.

        May return before the receivers are done; :meth:`disallow_checkpoint` ends it.
        """

    def disallow_checkpoint(self) -> None:  # noqa: B027 - optional hook, as in torchft
        """Stop serving; once this returns the state dict may be mutated."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetch the checkpoint of ``step`` from the transport described by ``metadata``."""

    def shutdown(self, wait: bool = True) -> None:  # noqa: B027 - optional hook, as in torchft
        """Release threads, sockets and buffers; ``wait`` for them to stop."""
