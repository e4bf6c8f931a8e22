"""Helpers for tests of a heal that the live sender's step overtakes: a receive on its own
thread, the sender freezing and changing its state while a stream is held at a chosen
point, and what the receive then returned."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from rallypoint.transports.http import HTTPTransport


def step_during_heal(src: HTTPTransport, dst: HTTPTransport, sd: Any, held: threading.Event,
                     go: threading.Event, timeout: timedelta) -> Any:
    """``dst`` receives step 1 from ``src`` on a thread; once ``held`` is set (the source
    holds a stream at the point under test) the sender steps: ``disallow_checkpoint`` (the
    freeze), then every floating tensor of ``sd["model"]`` changes in place, then ``go``
    lets the stream on. Returns what the receive returned; raises what it raised."""
    result: queue.Queue[Any] = queue.Queue()

    def receive() -> None:
        try:
            result.put(dst.recv_checkpoint(0, src.metadata(), 1, timeout))
        except Exception as exc:  # handed to the test's thread
            result.put(exc)

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    assert held.wait(10), "the source never reached the point under test"
    src.disallow_checkpoint()
    with torch.no_grad():
        for t in sd["model"].values():
            if t.is_floating_point():
                t.add_(1)
    go.set()
    th.join(timeout.total_seconds())
    got = result.get(timeout=1)
    if isinstance(got, Exception):
        raise got
    return got


class HoldPart(HTTPTransport):
    """Holds the first stream part of ``part`` bytes until ``go`` is set: ``before`` it is
    sent (read out of the sender's generator, taken and, where a sum covers it whole,
    summed), or after (the receiver has it; the piece's other parts and sum have not
    left). ``held`` is set once it holds."""

    def __init__(self, *a: Any, part: int, before: bool = False, **kw: Any) -> None:
        self.part, self.before = part, before
        self.held, self.go = threading.Event(), threading.Event()
        super().__init__(*a, **kw)

    def _hold(self, piece: memoryview) -> None:
        if piece.nbytes == self.part and not self.held.is_set():
            self.held.set()
            assert self.go.wait(10), "the test never let the stream go on"

    def _pieces(self, *a: Any) -> Iterator[memoryview]:
        for piece in super()._pieces(*a):
            if self.before:
                self._hold(piece)
            yield piece
            if not self.before:
                self._hold(piece)
