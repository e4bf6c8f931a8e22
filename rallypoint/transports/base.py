"""The transport interface the manager heals through, named as torchft's so users can switch.

A transport moves one state dict from an up-to-date replica to one or more healing
replicas for one step. The sender calls :meth:`send_checkpoint` (may return before the
transfer ends) and later :meth:`disallow_checkpoint` (after which the state dict may be
mutated, so nothing more may be read from it); the receiver calls :meth:`recv_checkpoint`
with the sender's :meth:`metadata` string, which it got through the quorum.

Two names for that contract: :class:`CheckpointTransportLike`, the ``Protocol`` the
manager types its ``checkpoint_transport`` with (any object with these methods plugs in,
whatever its class), and :class:`CheckpointTransport`, the base class (torchft's name)
our transports derive from and a user may too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class CheckpointTransportLike(Protocol[T]):
    """What the ``Manager`` calls on its ``checkpoint_transport`` (``T``: the state it
    moves; for the manager ``dict[str, Any]``).

    Why a protocol: torchft users pass their own transport objects, subclasses of
    ``torchft.checkpointing.CheckpointTransport`` (not of ours), or any object that has
    these methods; a structural type accepts them all and still lets mypy check the
    manager's calls. Our :class:`HTTPTransport` and :class:`PGTransport` satisfy it
    (checked by mypy at the end of this module).

    Optional, read with ``getattr``: ``copies_state`` (True when the transport guards
    the served state itself: it copies it, finishes before returning, or freezes it
    before it changes, so the manager need not copy it); ``serve_mode == "live"`` (the
    served state is frozen by ``disallow_checkpoint``), ``freeze_checkpoint()`` (keep
    serving, but make the served state independent of the caller's: the manager calls
    it instead of ``disallow_checkpoint`` after serving on the training thread).
    ``recv_checkpoint`` is passed ``into=`` / ``mesh=`` when the manager heals on the
    training thread (FSDP; a transport used there must accept them), and on the quorum
    thread only when the transport keeps receive buffers (``receive_pool`` not None),
    receives into host memory (``receives_on_device`` false or absent) and its
    ``recv_checkpoint`` takes ``in_place`` and ``defer_landing``: it then returns a
    :class:`~rallypoint.transports.wire.Landing` the training thread lands when it applies
    the heal. Any other transport (torchft's) is called with the four positional ones.
    """

    def metadata(self) -> str:
        """What a receiver needs to reach this transport (exchanged through the quorum)."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Offer ``state_dict`` as the checkpoint of ``step`` to ``dst_ranks``."""

    def disallow_checkpoint(self) -> None:
        """Stop serving; once this returns the state dict may be mutated."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetch the checkpoint of ``step`` from the transport described by ``metadata``."""

    def shutdown(self, wait: bool = True) -> None:
        """Release threads, sockets and buffers. torchft's manager calls it on any
        transport; ours only on the one it built (a transport passed in is the caller's)."""


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


if TYPE_CHECKING:  # mypy proves our transports satisfy the protocol; nothing here runs
    from rallypoint.transports.http import HTTPTransport
    from rallypoint.transports.pg import PGTransport

    def _conforms(base: CheckpointTransport[T], http: HTTPTransport, pg: PGTransport) -> None:
        generic: CheckpointTransportLike[T] = base
        ours: list[CheckpointTransportLike[dict[str, Any]]] = [http, pg]
        del generic, ours


__all__ = ["CheckpointTransport", "CheckpointTransportLike"]
