"""A range that fails part-way is fetched again from its first piece not yet verified
(``rallypoint.transports._http_recv``, ``RangeWriter.verified_to``), and why it matters
for a live sender: the tensors it has sent in full may be retired at its next step."""

from __future__ import annotations

import copy as copy_mod
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rallypoint.transports.http import HTTPTransport
from test_http_transport import (  # noqa: F401 - the fixture is used by name
    TEN,
    assert_same,
    make_state,
    transports,
)
from live_heal import step_during_heal

KiB = 1 << 10


class _CutAfter(HTTPTransport):
    """Serves data requests as asked, but the first one is cut after its first ``sums``
    pieces went out whole (and the next piece was begun), optionally held at that point
    until ``go`` is set. Records each data request's range."""

    def __init__(self, *a: Any, sums: int, hold: bool = False, **kw: Any) -> None:
        self.sums, self.hold = sums, hold
        self.ranges: list[tuple[int, int]] = []
        self.cut, self.go = threading.Event(), threading.Event()
        super().__init__(*a, **kw)

    def _pieces(self, served: Any, start: int, end: int, with_header: bool, *kind: Any) -> Iterator[memoryview]:
        first = not self.ranges
        self.ranges.append((start, end))
        seen = 0
        for piece in super()._pieces(served, start, end, with_header, *kind):
            if first and seen == self.sums:
                # The last whole piece's give-back has run (this part was asked for after it).
                self.cut.set()
                if self.hold:
                    assert self.go.wait(10), "the test never let the stream go on"
                raise RuntimeError("injected: connection dropped mid-range")
            seen += piece.nbytes == 4  # a piece's inline sum (the parts are 64 KiB)
            yield piece


def _setup(monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint.transports import http as http_mod

    monkeypatch.setattr(http_mod, "SEND_PIECE", 64 * KiB)


def test_a_range_cut_part_way_is_fetched_again_from_its_first_piece_not_verified(
        transports: Callable[..., HTTPTransport], monkeypatch: pytest.MonkeyPatch) -> None:
    _setup(monkeypatch)
    src = transports(_CutAfter, sums=5, block=256 * KiB, copy_below=0)
    dst = transports(num_chunks=1)
    sd = make_state(12, n=4, numel=1 << 18)  # four 1 MiB tensors: four 256 KiB pieces each
    src.send_checkpoint([1], 1, sd, TEN)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 1, TEN))
    assert isinstance(src, _CutAfter)
    (s0, e0), (s1, e1) = src.ranges[:2]
    assert (s1, e1) == (s0 + 5 * 256 * KiB, e0)  # resumed after the five whole pieces


def test_a_heal_whose_range_fails_after_the_sender_retired_what_it_sent_still_completes(
        transports: Callable[..., HTTPTransport], monkeypatch: pytest.MonkeyPatch) -> None:
    """A live sender retires a tensor once every piece of it was sent: its next step
    (``disallow_checkpoint``) copies only what is still owed. A receiver whose range then
    fails fetches only the rest of it, from the copy, and gets the state as served (the
    whole range again asked for the retired tensor: HTTP 410, the heal failed)."""
    _setup(monkeypatch)
    src = transports(_CutAfter, sums=4, hold=True, block=256 * KiB, copy_below=0)
    dst = transports(num_chunks=1)
    sd = make_state(13, n=4, numel=1 << 18)
    want = copy_mod.deepcopy(sd)
    src.send_checkpoint([1], 1, sd, TEN)
    assert isinstance(src, _CutAfter)
    assert_same(want, step_during_heal(src, dst, sd, src.cut, src.go, TEN))
    (s0, e0), (s1, e1) = src.ranges[:2]
    assert s1 == s0 + 1024 * KiB and e1 == e0
