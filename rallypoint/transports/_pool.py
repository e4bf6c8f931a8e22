"""Receive buffers kept from one heal to the next, and landing a verified state in the
caller's tensors by swapping memory instead of copying it.

Why: a replica that heals without restarting (it failed a step, or a long-lived standby)
receives into the state it already holds (``into=``). Receiving straight into those
tensors (``in_place=True``) leaves them torn when the transfer breaks; receiving into
fresh memory and copying it over afterwards (``in_place=False``) keeps them whole but costs
a page fault per 4 KiB of fresh memory and a second pass over the whole state. Here the
receive goes into buffers kept from the last heal (already mapped), every byte is verified,
and only then does each tensor take the buffer's memory: the storage under the caller's
tensor (shared by the parameter, its ``state_dict()`` alias and the optimizer's references
alike) trades its data pointer with the buffer (``UntypedStorage._swap_data_ptr_``), so the
tensor holds the new bytes and the buffer the old ones, to be received into next time.
Nothing is copied, and a failure before the end leaves every caller tensor as it was.

A tensor whose storage is not exactly its own (a view into a larger buffer, an offset, a
shared-memory or non-CPU storage) is copied into instead, and its buffer kept as well.
Swapping needs torch's ``UntypedStorage._swap_data_ptr_`` (torch >= 2.3); without it
every tensor is copied into.

Memory: the pool keeps at most one receive's worth of buffers (the bytes it handed out
for the last receive), which is one more copy of the received state between heals.
``RALLYPOINT_HEAL_BUFFERS=0`` turns the pool off (fresh memory and a copy per heal).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import defaultdict

import torch

logger = logging.getLogger("rallypoint.transports")

#: Environment switch: "0" receives into fresh memory every heal (no buffers kept).
ENV = "RALLYPOINT_HEAL_BUFFERS"


def pool_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether receives keep their buffers for the next one (``RALLYPOINT_HEAL_BUFFERS``)."""
    return (os.environ if environ is None else environ).get(ENV, "1") != "0"


#: torch's storage swap (torch >= 2.3); without it every tensor is copied into.
_CAN_SWAP_STORAGES = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def can_swap(target: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``target`` may take ``buf``'s memory by swapping storages: both CPU,
    contiguous, each the whole of its own storage (so nothing else lives in the memory
    that changes hands), the same size, neither in shared memory (a process group may have
    moved a buffer there), and a torch that can swap. (Per tensor of every heal: the
    cheapest refusals come first.)"""
    if not _CAN_SWAP_STORAGES or target.device.type != "cpu" or buf.device.type != "cpu":
        return False
    if target.storage_offset() or buf.storage_offset() or not (target.is_contiguous() and buf.is_contiguous()):
        return False
    if target.is_conj() or target.is_neg():
        return False
    ts, bs = target.untyped_storage(), buf.untyped_storage()
    n = target.numel() * target.element_size()
    return ts.nbytes() == n == bs.nbytes() and not ts.is_shared() and not bs.is_shared() \
        and ts.data_ptr() != bs.data_ptr()


def swap_into(target: torch.Tensor, buf: torch.Tensor, bump: bool = True) -> None:
    """``target`` now holds ``buf``'s bytes and ``buf`` ``target``'s old ones (see
    :func:`can_swap`); autograd sees ``target`` modified in place (``bump=False``: the
    caller tells autograd itself, for many tensors in one call)."""
    target.untyped_storage()._swap_data_ptr_(buf.untyped_storage())  # type: ignore[attr-defined]
    if bump:
        torch.autograd.graph.increment_version(target)


class ReceivePool:
    """CPU buffers kept between receives, by size in bytes (see the module docstring). One
    receive at a time takes from it; thread-safe all the same.

    A buffer is kept as the tensor that held it; taking it for the same dtype and shape
    (the common case: the state's layout did not change since the last heal) hands that
    tensor back as it is, with no view built, which matters per tensor for states of
    thousands of small ones; any other dtype and shape of the same byte size gets a view of
    its bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.reused_bytes = 0  # bytes handed out again (for tests and logs)

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A kept buffer of exactly the bytes of ``dtype`` x ``shape``, as such a tensor;
        None when there is none (the caller allocates)."""
        n = math.prod(shape) * dtype.itemsize
        with self._lock:
            free = self._free.get(n)
            if not free:
                return None
            buf = free.pop()
            self.reused_bytes += n
        if buf.dtype == dtype and buf.shape == shape:
            return buf
        raw = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        return raw.view(dtype).view(shape)

    def give(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` (a contiguous CPU tensor that is the whole of its storage) for a
        later receive; any other tensor is not kept."""
        if buf.device.type != "cpu" or buf.storage_offset() or not buf.is_contiguous():
            return
        n = buf.numel() * buf.element_size()
        if buf.untyped_storage().nbytes() != n:
            return
        with self._lock:
            self._free[n].append(buf)

    def trim(self, keep: int) -> None:
        """A receive ended whose buffers were ``keep`` bytes: keep no more than that."""
        with self._lock:
            total = 0
            for n in sorted(self._free):
                kept = []
                for raw in self._free[n]:
                    if total + n <= keep:
                        kept.append(raw)
                        total += n
                self._free[n] = kept

    def kept_bytes(self) -> int:
        """Bytes held for the next receive."""
        with self._lock:
            return sum(n * len(v) for n, v in self._free.items())

    def clear(self) -> None:
        """Free every kept buffer."""
        with self._lock:
            self._free.clear()


__all__ = ["ENV", "ReceivePool", "can_swap", "pool_enabled", "swap_into"]
