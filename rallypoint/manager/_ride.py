"""The corruption checks' rows riding in the step's last gradient collective.

Without this, the checks exchange their rows (``[norm valid, norm, hash valid, hash hi,
hash lo]`` per replica, :mod:`._guard`) with a collective of their own, posted right behind
the last gradient bucket. On gloo that small collective costs about as much CPU as the
gradient norms themselves (``bench/sdc_step.py --thread-cpu``: gloo's threads +0.4 to
+0.7 ms per step, plus posting and waiting for it in Python): each collective is a few
thread hand-offs in gloo whatever its size. Riding, the last bucket is allreduced together
with the rows, in one collective:

- a staging tensor of ``bucket + world * RIDE_COLUMNS`` elements (kept between steps, so
  no allocation per step) takes a copy of the bucket and, after it, this replica's row in
  its own slot, zeros in the others' (the bucket's norm is taken from that copy);
- one SUM allreduce of the staging tensor: every slot then holds its replica's row,
  exactly (a sum of one value and zeros), and the bucket part the sum of the gradients;
- on ``wait``, the staging tensor's bucket part is divided into the bucket (one pass,
  where the plain path divides the bucket in place), and the bucket is the work's result
  (:meth:`RidingWork.averaged`): rallypoint's DDP completes the bucket's future with it,
  and torch's reducer, which copies a hook's result into the gradients, finds them
  already holding it (``gradient_as_bucket_view=True``: the gradients are views of the
  bucket, and ``copy_`` of a tensor onto the same memory returns at once). So what riding
  adds is one copy of the last bucket into the staging tensor, against a whole collective
  saved (``bench/sdc_step.py``: its ``ride`` mode against ``behind``). A caller that reads
  the bucket itself finds the mean there after ``wait``.

The rows are in the gradients' dtype, float32 or float64. A float32 holds a norm to
float32 precision (a 10x outlier test needs far less; NaN and Inf stay NaN and Inf; a
norm above ~3.4e38 reads as Inf, which fails the step as Inf instead of as an outlier),
but not a 32-bit half of the hash: the hash travels as four 16-bit pieces, each exact in
either dtype. Other dtypes (bf16, fp16 gradients), and CPU buckets over
``RIDE_MAX_CPU_BYTES`` (where the copy costs more than the collective it saves), do not
ride: the checks then use their own collective, posted right behind the last bucket.
Every replica group must decide alike, and does: the choice depends on the last bucket's
dtype, size and device and on the checks' settings, which every group shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from rallypoint.manager._sdc import SdcExchangeError, exchange_buffer
from rallypoint.manager._work import ManagedWork

#: Columns of a riding row: norm valid, norm, hash valid, the hash's four 16-bit pieces (high first).
RIDE_COLUMNS = 7
#: Gradient dtypes whose collective the rows can ride in.
RIDE_DTYPES = (torch.float32, torch.float64)
#: Largest CPU bucket the rows ride in. Copying a bucket into the staging tensor costs
#: ~0.1 ms per MiB on a 2-core host (a 4 MiB bucket: 0.43 ms; the mean goes back divided
#: on the way, in the pass the plain path spends dividing in place), the collective it
#: saves ~1 ms of CPU (gloo's threads, posting and waiting); above this the rows' own
#: collective is the cheaper one. On a GPU the copy is a device copy and always cheaper.
RIDE_MAX_CPU_BYTES = 6 << 20


def can_ride(tensor: torch.Tensor) -> bool:
    """Whether the rows can ride in ``tensor``'s allreduce: a dense, contiguous float32 or
    float64 tensor (a DDP bucket is), at most ``RIDE_MAX_CPU_BYTES`` on the CPU."""
    return tensor.dtype in RIDE_DTYPES and tensor.layout == torch.strided and tensor.is_contiguous() \
        and (tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() <= RIDE_MAX_CPU_BYTES)


def to_ride_row(values: Sequence[float]) -> list[float]:
    """A check row ``[norm valid, norm, hash valid, hash hi, hash lo]`` (the halves exact
    32-bit integers, as ``u64_to_halves`` gives them) as the riding row: the halves split
    into 16-bit pieces, high first."""
    if len(values) != 5:
        raise ValueError(f"a check row has 5 values, got {len(values)}")
    valid_norm, norm, valid_hash, hi, lo = values
    pieces: list[float] = []
    for half in (hi, lo):
        if not (math.isfinite(half) and half == int(half) and 0 <= half <= 0xFFFFFFFF):
            raise ValueError(f"not a 32-bit half of a hash: {half!r}")
        pieces += [float(int(half) >> 16), float(int(half) & 0xFFFF)]
    return [float(valid_norm), float(norm), float(valid_hash), *pieces]


def from_ride_row(row: Sequence[float]) -> list[float]:
    """The inverse of :func:`to_ride_row`: back to ``[norm valid, norm, hash valid, hash
    hi, hash lo]``. Refuses pieces that are not exact 16-bit integers (a row that did not
    come from :func:`to_ride_row`)."""
    if len(row) != RIDE_COLUMNS:
        raise ValueError(f"a riding row has {RIDE_COLUMNS} values, got {len(row)}")
    for p in row[3:]:
        if not (math.isfinite(p) and p == int(p) and 0 <= p <= 0xFFFF):
            raise ValueError(f"not a 16-bit piece of a hash: {p!r}")
    a, b, c, d = (int(p) for p in row[3:])
    return [float(row[0]), float(row[1]), float(row[2]), float((a << 16) | b), float((c << 16) | d)]


class Staging:
    """The staging tensor a replica's last bucket and its row are allreduced in, kept
    between steps (one per Manager; a new one only when the bucket's size, the quorum's
    size, the dtype or the device changes)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def load(self, bucket: torch.Tensor, world: int) -> torch.Tensor:
        """The staging tensor holding a copy of ``bucket``, then ``world`` slots (zeroed:
        a row that is never put is all zeros, which reads as "nothing to check");
        :meth:`put_row` fills this replica's."""
        n = bucket.numel()
        size = n + world * RIDE_COLUMNS
        buf = self._buf
        if buf is None or buf.numel() != size or buf.dtype != bucket.dtype or buf.device != bucket.device:
            buf = self._buf = torch.empty(size, dtype=bucket.dtype, device=bucket.device)
        buf[:n].copy_(bucket.view(-1))
        buf[n:].zero_()
        return buf

    def put_row(self, row: Sequence[float], replica_rank: int, world: int) -> None:
        """Write this replica's riding row (:func:`to_ride_row`) into its slot of the
        staging tensor :meth:`load` returned (the one-hot layout of ``_sdc.exchange_buffer``,
        written in place)."""
        if len(row) != RIDE_COLUMNS:
            raise ValueError(f"a riding row has {RIDE_COLUMNS} values, got {len(row)}")
        buf = self._buf
        if buf is None or buf.numel() < world * RIDE_COLUMNS:
            raise ValueError(f"put_row needs a staging tensor loaded for {world} slots first")
        slots = buf[buf.numel() - world * RIDE_COLUMNS:].view(world, RIDE_COLUMNS)
        exchange_buffer(replica_rank, world, row, out=slots)


class RidingWork(ManagedWork):
    """The last bucket's allreduce with the rows riding in it: after ``wait``,
    :meth:`averaged` is the mean (or the sum), :meth:`rows` every replica's check row. A
    failure is routed to the manager (the step will not commit) and kept in ``error``;
    the bucket is then left as it was. On success the mean is divided out of the staging
    tensor into the bucket, which is the result: the rows stay in the staging tensor
    (:meth:`rows`) until the next step's last bucket reuses it."""

    def __init__(self, sink: Any, inner: Any, staging: torch.Tensor, bucket: torch.Tensor, divisor: int | None,
                 world: int) -> None:
        super().__init__(sink, inner, bucket, divisor)
        self._staging = staging
        self._n = bucket.numel()
        self._world = world

    def _finish(self) -> None:
        # Divided on the way into the bucket: one pass over the sum, and the bucket (the
        # gradients' memory) holds the mean, so torch's reducer copies nothing back.
        part = self._staging[: self._n].view_as(self._tensor)
        if self._divisor:
            torch.div(part, self._divisor, out=self._tensor)
        else:
            self._tensor.copy_(part)
        self._result = self._tensor

    def averaged(self) -> torch.Tensor:
        """Wait, and return the bucket: holding the mean (or the sum) after a successful
        collective, untouched when it failed."""
        self.wait()
        return self._tensor

    def rows(self) -> list[list[float]]:
        """Every replica's row ``[norm valid, norm, hash valid, hash hi, hash lo]`` (after a
        successful :meth:`wait`)."""
        raw: list[list[float]] = self._staging[self._n:].view(self._world, RIDE_COLUMNS).cpu().tolist()
        return [from_ride_row(r) for r in raw]

    @classmethod
    def post_riding(cls, sink: Any, pg: Any, staging: torch.Tensor, bucket: torch.Tensor, divisor: int | None,
                    world: int) -> "RidingWork":
        """Post the staging tensor's SUM allreduce on ``pg`` (the raw cross-replica group)."""
        return cls(sink, pg.allreduce([staging], ReduceOp.SUM), staging, bucket, divisor, world)


class PendingRide:
    """The guard's handle on rows riding in the last bucket (what ``PendingExchange`` is
    for a collective of their own): :meth:`wait` returns every replica's row."""

    def __init__(self, work: RidingWork, replica_rank: int, world: int) -> None:
        self._work = work
        self._where = f"replica rank {replica_rank} of {world}"

    def finished(self) -> bool:
        """Whether the collective has ended."""
        return self._work.finished()

    def wait(self, timeout: timedelta | float) -> list[list[float]]:
        """Every replica's row once the collective completed (at most ``timeout``); raises
        :class:`SdcExchangeError` when it failed or timed out."""
        td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._work.wait(td)
        if self._work.error is not None:
            raise SdcExchangeError(f"SDC check rows riding in the last gradient bucket failed at {self._where} "
                                   f"(timeout {td.total_seconds():g} s): {self._work.error}; the step must fail")
        return self._work.rows()


__all__ = ["PendingRide", "RIDE_COLUMNS", "RIDE_DTYPES", "RidingWork", "Staging", "can_ride", "from_ride_row",
           "to_ride_row"]
