"""Moving a heal's state between replicas: serving it to the healing peers and fetching it
from the assigned source. The :class:`Manager` decides *when* (on the quorum thread, or on
the training thread at a safe point); this module only does the transfer.

Why what is served must be guarded: training may change the state while the healing peer
reads it (the optimizer steps right after the vote; a synchronous quorum's sender steps
on through DiLoCo's sync delay; BatchNorm buffers change during forward). The peer must
receive the state as it was served, whatever the sender does next. Our transports guard
it themselves (``copies_state``): HTTP serves the live tensors and freezes them before
they change (``rallypoint.transports._live``; the Manager's ``should_commit`` and any
optimizer step do), the process group finishes before returning. Another transport is
given a copy (:func:`materialise`).

How this stays out of the training step (the ``Manager``'s side), and why the state being
served is never read while the training thread changes it. Which thread heals is the
Manager's ``heal_on_training_thread``: True, False, or None (the default, what TorchTitan
gets through torchft's arguments), decided once on the training thread at the first
``start_quorum`` (and again after another ``state_dict`` callback is registered): True
when the registered state holds a DTensor (FSDP2), else False; cached, so a step pays
nothing for it (:mod:`._heal_thread`).

On the training thread (FSDP2's state by default; ``rallypoint.integrations.fsdp`` sets
it too) the quorum thread only forms the quorum.
Both sides of a heal run on the training thread, between steps' mutations: in
:meth:`should_commit` (after backward, before the vote; :meth:`start_quorum` /
:meth:`wait_quorum` when the quorum is synchronous). There, and only there, the sender
calls the ``state_dict()`` callbacks and serves their tensors live; right after the vote,
before the optimizer may step, the served state is frozen (what the peer has not received
yet is copied: ``rallypoint.transports._live``), so every byte a peer reads is the state
of the step that was served, never a tensor the optimizer is changing and never FSDP2's
unsharded parameters that forward swaps in and frees (torchtitan#4754: a state read from
the quorum thread mid-forward crashed the serving process). The receiver fetches there
too, into its current state, and applies it before the vote.

The frozen state stays served until its receivers have it (each says so, or every piece
was sent to each; a state with no data bytes: once each said so), a newer
state replaces it (the sender serves again; a receiver still on the older step is told
409 and heals again), or the heal timeout passes; never withdrawn under a receiver that
has not asked yet, whatever the sender does meanwhile (its next rounds'
``disallow_checkpoint`` leave a frozen state alone). The healing peer fetches only once
its own training thread reaches ``should_commit``, which may be after the sender's vote,
freeze and next step. That was the livelock that kept training-thread heals opt-in: a
state with no data bytes counted as delivered the moment it was served, so the freeze
withdrew it before the peer asked: HTTP 410 every round
(``tests/test_heal_default.py``).

On the quorum thread (state with no DTensor by default) the heal overlaps forward: the
sender serves as soon as its quorum arrives, live (forward and backward change neither
parameters nor optimizer state), frozen in :meth:`should_commit`; the receiver fetches on
the quorum thread and applies the state in :meth:`should_commit`.

DTensors (FSDP2), whichever thread heals: a received DTensor the receiver has at the same
key is rebuilt on that DTensor's mesh; one it lacks (a fresh replica's optimizer state)
arrives as a ``SentDTensor`` and is placed on the training thread just before the state
is applied, on this replica's own meshes and placements, or on the sender's placements
over a mesh of the same shape (:mod:`rallypoint.transports._rebuild`, via
:mod:`._heal_step`).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch

from rallypoint.manager.client import ManagerClient
from rallypoint.manager._retry import heal_backoff_s, source_order
from rallypoint.manager.recovery import QuorumResult
from rallypoint.transports.base import CheckpointTransportLike


def unguarded_transport(transport: object, metadata: str, token: str | None) -> str | None:
    """What to warn about when the caller's own ``checkpoint_transport`` is not one of
    ours, serves over a server of its own (its ``metadata`` is a URL), and the job has a
    token; else None.

    Why: the job token guards every socket rallypoint opens, but a transport we did not
    write (torchft's ``HTTPTransport``, say) serves the replica's whole state without it,
    to anyone who reaches its port (and torchft's unpickles what it receives). The user
    chose it, so it is used; the warning says what that exposes. A transport over the
    process group (torchft's ``PGTransport``) opens no server: nothing to say."""
    cls = type(transport)
    if token is None or cls.__module__.split(".")[0] == "rallypoint":
        return None
    if not metadata.lower().startswith(("http://", "https://")):
        return None
    return (f"checkpoint_transport {cls.__module__}.{cls.__qualname__} is not rallypoint's: the job token does "
            f"not guard its server ({metadata[:200]}), so anyone who reaches it can fetch this replica's state "
            "(leave checkpoint_transport unset for rallypoint's HTTPTransport, which checks the token)")


def warn_if_unguarded(transport: Any, log: logging.LoggerAdapter[Any] | logging.Logger) -> None:
    """Log :func:`unguarded_transport`'s warning for the caller's ``transport``, if any
    (the token from ``RALLYPOINT_TOKEN``, as every server of the replica reads it)."""
    from rallypoint._net.auth import job_token

    try:
        served_at = str(transport.metadata())
    except Exception:  # noqa: BLE001 - only for the warning
        served_at = ""
    warning = unguarded_transport(transport, served_at, job_token())
    if warning:
        log.warning("%s", warning)


def materialise(tree: Any) -> Any:
    """A copy of every tensor in ``tree`` (dicts, lists, tuples; other leaves as they are),
    detached from autograd. DTensors stay DTensors (their local shard is copied), so the
    receiver can rebuild them on its own mesh."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: materialise(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [materialise(v) for v in tree]
    if isinstance(tree, tuple):
        items = [materialise(v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)  # namedtuple or tuple
    return tree


def _takes_into(transport: object, *more: str) -> bool:
    """Whether ``transport.recv_checkpoint`` accepts ``into=``/``mesh=`` and the keywords
    ``more`` (ours do; torchft's do not)."""
    import inspect

    try:
        params = inspect.signature(transport.recv_checkpoint).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False
    return all(k in params for k in ("into", "mesh", *more)) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


#: ``0`` turns striped healing off: a healing replica fetches from its assigned source only.
STRIPE_ENV = "RALLYPOINT_HEAL_STRIPE"


class Healer:
    """Serves and fetches heals through one checkpoint transport.

    Striped healing: with a transport that can (``stripes``: ours over HTTP), every
    up-to-date replica serves every healing one, and a healing replica fetches disjoint
    parts of the state from all of them at once (its assigned source first; a source
    that fails is dropped and the others serve its part). Off with
    ``RALLYPOINT_HEAL_STRIPE=0``.
    """

    def __init__(self, transport: CheckpointTransportLike[dict[str, Any]], group_rank: int, timeout: timedelta,
                 connect_timeout: timedelta, log: logging.LoggerAdapter) -> None:
        self._transport = transport
        self._group_rank = group_rank
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._log = log
        self.stripe = bool(getattr(transport, "stripes", False)) and os.environ.get(STRIPE_ENV, "1") != "0"
        self.failed_heals = 0  # consecutive heals that failed from every source (see backoff_s)
        self._lands_later: bool | None = None

    def lands_later(self) -> bool:
        """Whether a heal fetched off the training thread should receive ``into`` our state
        and leave the landing to the training thread (``fetch(defer=True)``): the transport
        keeps receive buffers between heals (``receive_pool``) and takes ``defer_landing``,
        and receives into host memory (a transport that receives on a device would hold a
        second copy of the state in device memory until the landing). Otherwise the heal
        goes as the transport does it by default, and applying copies it."""
        if self._lands_later is None:
            self._lands_later = getattr(self._transport, "receive_pool", None) is not None \
                and not getattr(self._transport, "receives_on_device", False) \
                and _takes_into(self._transport, "defer_landing", "in_place")
        return self._lands_later

    def serves(self, q: QuorumResult) -> list[int]:
        """The replica ranks that may fetch from us in quorum ``q`` (empty: serve nothing)."""
        dst = list(q.recover_dst_replica_ranks)
        if getattr(self._transport, "stripes", False):  # a healer may stripe even if we would not
            dst += [r for r in q.stripe_dst_replica_ranks if r not in dst]
        return dst

    def serve(self, q: QuorumResult, state: dict[str, Any]) -> None:
        """Offer ``state`` as step ``q.max_step`` to the replica ranks that heal from us.
        Training may change the state before the peer has it (a synchronous quorum's
        sender steps on through DiLoCo's sync delay; BatchNorm buffers change in forward),
        so a transport that does not guard it on its own (``copies_state``: ours do)
        serves a copy."""
        if not getattr(self._transport, "copies_state", False):
            state = materialise(state)
        dst = self.serves(q)
        self._log.info("serving step %d to replica ranks %s", q.max_step, dst)
        self._transport.send_checkpoint(dst_ranks=dst, step=q.max_step, state_dict=state, timeout=self._timeout)

    def after_vote(self, served_here: bool) -> None:
        """The optimizer may step once the vote is in: what we serve must not change under a
        reader. A state served on the training thread in this round stays up (the healing
        peer may not even have asked yet): a live transport freezes it, a copy needs
        nothing. Otherwise ``disallow_checkpoint``: a live state served from the quorum
        thread is frozen if a receiver is reading it (withdrawn if none asked); a state
        frozen earlier stays up until its receivers have it or it expires."""
        freeze = getattr(self._transport, "freeze_checkpoint", None)
        try:
            if not served_here:
                self._transport.disallow_checkpoint()
            elif freeze is not None:
                freeze()
        except Exception as e:  # noqa: BLE001
            self._log.warning("disallow_checkpoint failed: %s", e)

    def _metadata(self, address: str, timeout: timedelta) -> str:
        """Where the replica whose manager is at ``address`` serves our group rank's state."""
        with ManagerClient(address, connect_timeout=self._connect_timeout, fail_fast=True) as peer:
            return peer._checkpoint_metadata(self._group_rank, timeout=timeout)

    def backoff_s(self) -> float:
        """How long to wait before the next quorum: grows with the consecutive failed heals
        (fetched from no source, or not applicable: :func:`._retry.heal_backoff_s`), 0 once
        a healed state was applied."""
        return heal_backoff_s(self.failed_heals)

    def fetch(self, q: QuorumResult, into: Any = None, mesh: Any = None, defer: bool = False) -> Any:
        """The state of step ``q.max_step``: from our assigned source, else (a transport that
        ``stripes``: every up-to-date replica serves every healing one) from the quorum's
        other sources in turn, within the heal timeout. ``into``: our current state
        (received tensors are verified, then copied into its matching tensors, and DTensors
        are rebuilt on its meshes); ``mesh``: the mesh for DTensors ``into`` lacks (unset,
        with our transports: they arrive as ``SentDTensor`` and are placed on this
        replica's meshes when the state is applied, :func:`._heal_step.place_dtensors`).
        ``defer`` (with ``into``, off the training thread): a transport that can returns a
        :class:`~rallypoint.transports.wire.Landing` (verified, ``into`` not yet touched)
        for the training thread to land; one that cannot returns the state, received
        fresh. Every source failing raises, and counts toward :meth:`backoff_s`."""
        src = q.recover_src_replica_rank
        if src is None:
            raise RuntimeError(f"quorum {q.quorum_id} says heal but names no recovery source")
        addrs = dict(zip(q.recover_src_replica_ranks, q.recover_src_manager_addresses))
        addrs[src] = q.recover_src_manager_address
        others = list(addrs) if getattr(self._transport, "stripes", False) else []
        deadline = time.monotonic() + self._timeout.total_seconds()
        failed: set[int] = set()
        last: Exception | None = None
        while True:
            order = source_order(src, others, failed)
            left = deadline - time.monotonic()
            if failed and (not order or left <= 0):
                self.failed_heals += 1
                raise RuntimeError(f"heal to step {q.max_step} failed from every source tried (replica ranks "
                                   f"{sorted(failed)}); the next quorum retries: {last}") from last
            try:
                state = self._fetch_from(q, order[0], order[1:] if self.stripe else [], addrs, into, mesh,
                                         timedelta(seconds=max(left, 1.0)), defer)
            except Exception as e:  # noqa: BLE001 - another source, or the next quorum, retries
                last = e
                failed.add(order[0])
                self._log.warning("heal from replica rank %d failed: %s%s", order[0], e,
                                  "; trying another source" if source_order(src, others, failed) else "")
                continue
            return state  # failed_heals is reset once the state is applied (_heal_step)

    def _fetch_from(self, q: QuorumResult, src: int, extra_ranks: list[int], addrs: dict[int, str], into: Any,
                    mesh: Any, timeout: timedelta, defer: bool = False) -> Any:
        """One attempt: from ``src`` (striped with ``extra_ranks`` that say where they serve)."""
        meta = self._metadata(addrs[src], min(timeout, self._timeout))
        extra_srcs: list[int] = []
        for rank in extra_ranks:
            try:  # a source that cannot say where it serves is left out, not waited for
                meta += "," + self._metadata(addrs[rank], min(timeout, timedelta(seconds=5)))
                extra_srcs.append(rank)
            except Exception as e:  # noqa: BLE001
                self._log.warning("striped heal: replica rank %d (%s) left out: %s", rank, addrs[rank], e)
        self._log.info("healing to step %d from replica rank %d (%s)%s", q.max_step, src, addrs[src],
                       f", striped with ranks {extra_srcs}" if extra_srcs else "")
        extra: dict[str, Any] = {}
        if into is not None:
            extra["into"] = into
            if defer:
                extra.update(in_place=False, defer_landing=True)  # nothing of ours is written off this thread
        if mesh is None and type(self._transport).__module__.startswith("rallypoint."):
            from rallypoint.transports.wire import DEFER

            mesh = DEFER  # DTensors with no target arrive as SentDTensor, placed when applied (_heal_step)
        if mesh is not None:
            extra["mesh"] = mesh
        if extra and not _takes_into(self._transport, *(k for k in ("in_place", "defer_landing") if k in extra)):
            extra = {}  # a transport not of ours (torchft's) takes none of these: it builds the state itself
        state = self._transport.recv_checkpoint(src_rank=src, metadata=meta, step=q.max_step, timeout=timeout,
                                                **extra)
        self._log.info("received the state of step %d", q.max_step)
        return state


__all__ = ["Healer", "materialise"]
