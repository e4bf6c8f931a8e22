"""How an HTTP receive cuts the state into ranges, and the order fresh memory is mapped in.

From one source a receive asks for one range per connection (every range costs a request
and a reply head); striped over several sources the ranges stay short, so that the faster
source takes more of them. The prefault thread maps fresh pages in the order the
connections reach them: with one range per connection, interleaved across the ranges.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rallypoint.transports import _http_recv, _prefault, wire
from rallypoint.transports._prefault import Prefault, lane_order
from rallypoint.transports.http import HTTPTransport
from test_http_transport import (  # noqa: F401 - the fixture is used by name
    SMALL_BLOCKS,
    TEN,
    assert_same,
    make_state,
    transports,
)


@pytest.mark.parametrize(
    ("max_chunk", "sources", "expected"),
    [
        (None, 1, None),  # one source: one range per connection
        (None, 2, _http_recv.STRIPE_RANGE_BYTES),  # striped: short ranges, the faster source takes more
        (None, 8, _http_recv.STRIPE_RANGE_BYTES),
        (32 << 10, 1, 32 << 10),  # the caller's cap wins either way
        (1 << 30, 3, 1 << 30),
    ],
)
def test_range_cap(max_chunk: int | None, sources: int, expected: int | None) -> None:
    assert _http_recv.range_cap(max_chunk, sources) == expected


@pytest.mark.parametrize(
    ("bounds", "lanes", "expected"),
    [
        ([(0, 3), (3, 6)], 2, [0, 3, 1, 4, 2, 5]),  # one range per writer: interleaved
        ([(0, 3), (3, 5)], 2, [0, 3, 1, 4, 2]),  # a shorter range runs out first
        ([(0, 2), (2, 4), (4, 6), (6, 8)], 2, [0, 2, 1, 3, 4, 6, 5, 7]),  # groups of two, in turn
        ([(0, 4)], 3, [0, 1, 2, 3]),  # one range: the stream's order
        ([(0, 2), (2, 4)], 1, [0, 1, 2, 3]),  # one writer takes them one after the other
        ([(0, 2), (2, 3), (3, 5)], 3, [0, 2, 3, 1, 4]),
        ([], 2, []),
        ([(0, 2), (2, 4)], 0, [0, 1, 2, 3]),  # no writers reads as one
    ],
)
def test_lane_order(bounds: list[tuple[int, int]], lanes: int, expected: list[int]) -> None:
    order = lane_order(bounds, lanes)
    assert order == expected
    assert sorted(order) == list(range(sum(b - a for a, b in bounds)))  # every piece once


def test_the_prefault_thread_maps_in_the_order_given(monkeypatch: Any) -> None:
    seen: list[int] = []
    monkeypatch.setattr(_prefault, "populate_range", lambda addr, nbytes: seen.append(addr))
    piece = 4 << 20
    n = _prefault.BACKGROUND_MIN_BYTES // piece
    pieces: list[tuple[int, int] | None] = [(i * piece, piece) for i in range(n)]
    order = lane_order([(0, n // 2), (n // 2, n)], 2)
    pf = Prefault(pieces, order=order)
    assert pf.join(10.0)
    assert seen == [i * piece for i in order] and order[:2] == [0, n // 2]


def _header(sd: Any) -> wire.Header:
    return wire.read_header(io.BytesIO(wire.encode(sd, **SMALL_BLOCKS).header).readinto)


def test_data_ranges_cover_the_state_one_per_connection_or_short_when_striped(monkeypatch: Any) -> None:
    h = _header(make_state(5))
    for connections, sources in [(1, 1), (2, 1), (3, 1), (2, 2), (4, 3)]:
        ranges = _http_recv.data_ranges(h, connections, sources, None)
        assert ranges[0][0] == 0 and ranges[-1][1] == h.data_bytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in stream order
        if sources == 1:
            assert len(ranges) == connections
    monkeypatch.setattr(_http_recv, "STRIPE_RANGE_BYTES", 64 << 10)
    striped = _http_recv.data_ranges(h, 2, 2, None)
    # a range ends at the first piece boundary at or past the cap: over it by less than a piece
    assert len(striped) > 4 and all(b - a < (64 << 10) + SMALL_BLOCKS["block"] for a, b in striped)


class Recording(HTTPTransport):
    """A source that notes every data range it is asked for."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.asked: list[tuple[int, int]] = []
        super().__init__(*a, **kw)

    def _pieces(self, served: Any, start: int, end: int, with_header: bool, *kind: Any) -> Any:
        if not with_header:
            self.asked.append((start, end))
        return super()._pieces(served, start, end, with_header, *kind)


@pytest.mark.parametrize("into", [False, True], ids=["fresh", "into_held_state"])
def test_a_receive_from_one_source_asks_one_range_per_connection(transports: Callable[..., HTTPTransport],
                                                                 into: bool, monkeypatch: Any) -> None:
    src = transports(Recording, **SMALL_BLOCKS)
    assert isinstance(src, Recording)
    sd = make_state(6)
    src.send_checkpoint([1], 4, sd, TEN)
    dst = transports(num_chunks=3)
    held = make_state(106) if into else None  # the same shapes, other values: a replica's own state
    sinks: list[wire.Sink] = []
    real = wire.Sink

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            sinks.append(self)

    monkeypatch.setattr(wire, "Sink", Spy)
    assert_same(sd, dst.recv_checkpoint(0, src.metadata(), 4, TEN, into=held))
    h = _header(sd)
    ranges = _http_recv.data_ranges(h, 3, 1, None)
    assert sorted(src.asked) == ranges and len(ranges) == 3
    # fresh memory is mapped ahead of all three connections, not only the first one's
    (sink,) = sinks
    assert sink.prefault._order == lane_order(_http_recv.piece_bounds(h, ranges), 3)


def test_one_connection_asks_for_the_whole_state_in_one_range(transports: Callable[..., HTTPTransport]) -> None:
    """Larger than the 64 MiB ranges asked for before (and still asked of several sources)."""
    src = transports(Recording)
    assert isinstance(src, Recording)
    sd = {"w": torch.arange((_http_recv.STRIPE_RANGE_BYTES + (8 << 20)) // 4, dtype=torch.float32)}
    src.send_checkpoint([1], 1, sd, TEN)
    out = transports(num_chunks=1).recv_checkpoint(0, src.metadata(), 1, TEN)
    assert torch.equal(out["w"], sd["w"])
    assert src.asked == [(0, sd["w"].numel() * 4)]


def test_a_striped_receive_asks_only_short_ranges_of_its_sources(transports: Callable[..., HTTPTransport],
                                                                monkeypatch: Any) -> None:
    monkeypatch.setattr(_http_recv, "STRIPE_RANGE_BYTES", 64 << 10)
    sources = [transports(Recording, copy_below=0, **SMALL_BLOCKS) for _ in range(2)]
    sd = make_state(7)
    for s in sources:
        s.send_checkpoint([1], 2, sd, TEN)
    dst = transports(num_chunks=2)
    assert_same(sd, dst.recv_checkpoint(0, ",".join(s.metadata() for s in sources), 2, TEN))
    asked = [r for s in sources for r in s.asked]  # type: ignore[attr-defined]
    assert sorted(asked) == _http_recv.data_ranges(_header(sd), 2, 2, None)
    assert all(b - a < (64 << 10) + SMALL_BLOCKS["block"] for a, b in asked)


def test_a_range_cap_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="max_chunk_bytes=0"):
        HTTPTransport(TEN, bind="127.0.0.1:0", max_chunk_bytes=0)
