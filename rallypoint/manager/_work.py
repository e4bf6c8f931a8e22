"""The works ``Manager.allreduce`` returns: they finish the mean on ``wait`` and route a
failure to the manager (which records it and aborts the process group) instead of raising
it in the middle of a step. Each notes when its collective finished (``done_at``), which
the round's record uses for the step-time split."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp

from rallypoint.process_groups.work import CompletedWork


class _FailureSink(Protocol):
    timeout: timedelta

    def comm_failed(self, e: Exception) -> None: ...


class DoneWork(CompletedWork):
    """A completed no-op work whose future holds ``result`` (what allreduce returns once
    the step has failed: the tensor, untouched)."""


class ManagedWork(DoneWork):
    """Wraps a process-group work: on ``wait`` finishes the mean, and routes a failure
    to the manager instead of raising it."""

    def __init__(self, sink: _FailureSink, inner: Any, tensor: torch.Tensor, divisor: int | None) -> None:
        super().__init__(tensor)
        self._sink = sink
        self._inner = inner
        self._tensor = tensor
        self._divisor = divisor
        self._done = False
        self._lock = threading.Lock()
        self.done_at: float | None = None  # monotonic: when the first wait returned
        self.error: Exception | None = None  # why the collective failed (routed to the manager too)

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._lock:
            if self._done:
                return True
            try:
                ok = self._inner.wait(timeout if timeout is not None else self._sink.timeout)
                if ok is False:
                    raise TimeoutError("allreduce did not complete in time")
                self._finish()
            except Exception as e:  # noqa: BLE001 - recorded, the step will not commit
                self.error = e
                self._sink.comm_failed(e)
            self.done_at = time.monotonic()
            self._done = True
            return True

    def _finish(self) -> None:
        """After the collective: the mean is the sum divided here."""
        if self._divisor:
            if self._tensor.is_floating_point() or self._tensor.is_complex():
                self._tensor.div_(self._divisor)
            else:
                self._tensor.div_(self._divisor, rounding_mode="trunc")

    def is_completed(self) -> bool:
        return self._done

    def finished(self) -> bool:
        """Whether the collective itself has ended (waited for or not): nothing of it
        can still block on a peer."""
        return self._done or bool(self._inner.is_completed())

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return super().get_future()

    @classmethod
    def post(cls, sink: _FailureSink, pg: Any, tensor: torch.Tensor, quantize: bool, reduce_op: Any,
             divisor: int | None) -> "ManagedWork":
        """Post ``tensor``'s allreduce on ``pg`` (a mean is a sum finished by ``wait``)."""
        if quantize:
            from rallypoint.process_groups.quantization import allreduce_quantized

            work = allreduce_quantized(pg, [tensor], timeout=sink.timeout)
        else:
            work = pg.allreduce([tensor], ReduceOp.SUM if reduce_op == ReduceOp.AVG else reduce_op)
        return cls(sink, work, tensor, divisor)


def neutral_fill(reduce_op: Any, tensor: torch.Tensor) -> bool:
    """Fill ``tensor`` with the identity of ``reduce_op`` (what a replica that does not
    contribute — healing, a spare — puts in, so the others' result is unchanged): zeros for
    SUM/AVG/BOR/BXOR, the dtype's lowest value for MAX, its highest for MIN, ones for
    PRODUCT, all bits set for BAND. False (tensor untouched) for an op without one."""
    def limit(hi: bool) -> float | int | bool:
        if tensor.dtype == torch.bool:
            return hi
        if tensor.is_floating_point():
            return float("inf") if hi else float("-inf")
        info = torch.iinfo(tensor.dtype)
        return info.max if hi else info.min

    if reduce_op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.BOR, ReduceOp.BXOR):
        tensor.zero_()
    elif reduce_op == ReduceOp.MAX:
        tensor.fill_(limit(False))
    elif reduce_op == ReduceOp.MIN:
        tensor.fill_(limit(True))
    elif reduce_op == ReduceOp.PRODUCT:
        tensor.fill_(1)
    elif reduce_op == ReduceOp.BAND and not tensor.is_floating_point():
        tensor.fill_(True if tensor.dtype == torch.bool else -1)
    else:
        return False
    return True


def allreduce_args(should_quantize: Any, reduce_op: Any, zeros: bool, who: str) -> tuple[bool, Any]:
    """``Manager.allreduce``'s ``(should_quantize, reduce_op)``, checked. The order is
    torchft's; a ``ReduceOp`` passed second is taken as ``reduce_op`` (our old order).
    Other reductions than SUM/AVG (MAX for a loss, MIN, PRODUCT, bitwise) pass through as
    torchft's do; a replica that does not contribute puts in the op's identity
    (:func:`neutral_fill`), so ``zeros`` (some replicas healing or spares) refuses only an
    op without one (PREMUL_SUM). Quantization supports only SUM and AVG."""
    if not isinstance(should_quantize, bool):
        should_quantize, reduce_op = False, should_quantize
    if should_quantize and reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{who}: a quantized allreduce supports SUM and AVG, not {reduce_op}")
    if zeros and reduce_op not in _NEUTRAL_OPS:
        raise ValueError(f"{who}: allreduce with {reduce_op} while some replicas are healing or spares (they "
                         "contribute nothing); only ops with an identity (SUM, AVG, MAX, MIN, PRODUCT, bitwise) "
                         "are supported then")
    return should_quantize, reduce_op


_NEUTRAL_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BAND,
                ReduceOp.BOR, ReduceOp.BXOR)


__all__ = ["DoneWork", "ManagedWork", "allreduce_args", "neutral_fill"]
