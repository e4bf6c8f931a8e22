"""Mapping a fresh receive's pages ahead of its bytes (rallypoint.transports._prefault).

Residency is read back with ``mincore``: a page counts as mapped once the kernel backs it,
which is what ``MADV_POPULATE_WRITE`` does and what a fresh ``torch.empty`` of several MiB
(its own ``mmap``) has not done yet.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import mmap
import sys
from typing import Any

import pytest
import torch

from rallypoint.transports import _prefault, wire
from rallypoint.transports._prefault import Prefault

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/madvise: Linux only")

PAGE = 4096
MiB = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident_pages(addr: int, nbytes: int) -> int:
    """How many of the whole pages inside ``[addr, addr + nbytes)`` are backed."""
    start = (addr + PAGE - 1) & ~(PAGE - 1)
    end = (addr + nbytes) & ~(PAGE - 1)
    n = (end - start) // PAGE
    vec = ctypes.create_string_buffer(n)
    assert _libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def whole_pages(addr: int, nbytes: int) -> int:
    return (((addr + nbytes) & ~(PAGE - 1)) - ((addr + PAGE - 1) & ~(PAGE - 1))) // PAGE


def _populate_works() -> bool:
    """Whether this kernel knows ``MADV_POPULATE_WRITE`` (Linux 5.14+)."""
    if not sys.platform.startswith("linux"):
        return False
    m = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    try:
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _libc.madvise(ctypes.addressof(buf), len(m), 23) == 0
    finally:
        del buf
        m.close()


needs_populate = pytest.mark.skipif(not _populate_works(), reason="the kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")


class Fresh:
    """A fresh anonymous mapping (page-aligned, no page backed yet), unmapped on close."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._buf = (ctypes.c_char * nbytes).from_buffer(self.map)
        self.addr = ctypes.addressof(self._buf)
        assert resident_pages(self.addr, nbytes) == 0

    def close(self) -> None:
        del self._buf
        self.map.close()


@pytest.fixture
def fresh() -> Any:
    made: list[Fresh] = []

    def make(nbytes: int) -> Fresh:
        made.append(Fresh(nbytes))
        return made[-1]

    yield make
    for f in made:
        f.close()


@needs_populate
def test_a_claimed_piece_is_mapped_once_and_a_piece_with_nothing_to_map_is_left_alone(fresh: Any) -> None:
    base = fresh(16 * MiB).addr
    pieces: list[tuple[int, int] | None] = [(base, 4 * MiB), None, (base + 8 * MiB, 4 * MiB)]
    pf = Prefault(pieces, background=False)
    pf.claim(0)
    assert resident_pages(base, 4 * MiB) == whole_pages(base, 4 * MiB)
    assert resident_pages(base + 8 * MiB, 4 * MiB) == 0  # not claimed yet: untouched
    pf.claim(0)  # a second claim maps nothing more
    pf.claim(1)  # nothing to map (a caller's own tensor): no effect, no error
    assert pf.mapped_bytes == {"ahead": 0, "writer": 4 * MiB}
    pf.claim(2)
    assert resident_pages(base + 8 * MiB, 4 * MiB) == whole_pages(base + 8 * MiB, 4 * MiB)
    assert resident_pages(base + 4 * MiB, 4 * MiB) == 0  # the gap between pieces was never asked for
    assert pf.mapped_bytes == {"ahead": 0, "writer": 8 * MiB}


@needs_populate
def test_the_thread_maps_every_piece_ahead_and_a_writer_never_maps_one_twice(fresh: Any) -> None:
    n = _prefault.BACKGROUND_MIN_BYTES
    base = fresh(n).addr
    piece = 4 * MiB
    pieces: list[tuple[int, int] | None] = [(base + i, piece) for i in range(0, n, piece)]
    pf = Prefault(pieces, background=True)
    pf.claim(len(pieces) - 1)  # a writer that starts at the end, while the thread starts at the front
    assert pf.join(30.0)
    assert resident_pages(base, n) == whole_pages(base, n)
    # Every piece was mapped by exactly one of them.
    assert pf.mapped_bytes["ahead"] + pf.mapped_bytes["writer"] == n
    assert pf.mapped_bytes["writer"] >= piece


@needs_populate
def test_no_thread_below_the_threshold_and_a_stopped_thread_ends(fresh: Any) -> None:
    small = Prefault([(fresh(MiB).addr, MiB)], background=True)
    assert small._thread is None
    n = _prefault.BACKGROUND_MIN_BYTES
    base = fresh(n).addr
    pf = Prefault([(base + i, MiB) for i in range(0, n, MiB)], background=True)
    pf.stop()
    assert pf.join(30.0)
    # What the thread claimed before it saw the stop is mapped whole; nothing else is.
    assert resident_pages(base, n) == pf.mapped_bytes["ahead"] // PAGE


def _stream(sd: dict[str, Any]) -> bytes:
    return wire.to_bytes(sd)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_receive_maps_only_fresh_destinations_and_gets_the_state(in_place: bool) -> None:
    """The Sink maps what it allocates (ahead or as each piece is reached) and never
    touches a caller's own tensors through madvise; the state arrives whole either way."""
    g = torch.Generator().manual_seed(1)
    sd = {f"w{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(24)}  # 72 MiB: the thread runs
    raw = _stream(sd)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    header = wire.read_header(io.BytesIO(raw).readinto)
    sink = wire.Sink(header, into=target if in_place else None, in_place=in_place)
    view = memoryview(raw)
    pos = len(raw) - header.wire_bytes(0, header.data_bytes)
    w = sink.writer(0, header.data_bytes)
    w.write(view[pos:])
    w.close()
    out = sink.finish()
    assert sink.prefault.join(30.0)
    mapped = sink.prefault.mapped_bytes["ahead"] + sink.prefault.mapped_bytes["writer"]
    assert mapped == (0 if in_place else header.data_bytes)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    if in_place:
        assert all(out[k] is target[k] for k in sd)


def test_an_http_fetch_of_fresh_tensors_maps_them_and_arrives_whole() -> None:
    from rallypoint.transports.http import HTTPTransport

    g = torch.Generator().manual_seed(2)
    sd = {f"w{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(24)}
    timeout = datetime.timedelta(seconds=30)
    sender = HTTPTransport(timeout, 4, bind="127.0.0.1:0", advertise_host="127.0.0.1")
    receiver = HTTPTransport(timeout, 4, bind="127.0.0.1:0")
    seen: list[wire.Sink] = []
    real = wire.Sink

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            seen.append(self)

    try:
        sender.send_checkpoint([1], 7, sd, timeout)
        wire.Sink = Spy  # type: ignore[misc]
        try:
            out = receiver.recv_checkpoint(0, sender.metadata(), 7, timeout)
        finally:
            wire.Sink = real  # type: ignore[misc]
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        (sink,) = seen
        assert sink.prefault.join(30.0)
        assert sink.prefault.mapped_bytes["ahead"] + sink.prefault.mapped_bytes["writer"] == sink.header.data_bytes
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_piece_without_a_whole_page_is_never_claimed() -> None:
    """Tiny tensors' pieces share pages with their neighbours: nothing to map, no claim."""
    # (Addresses nobody maps: madvise on them fails, which populate ignores.)
    pf = Prefault([(PAGE + 8, 100), (2 * PAGE + 8, PAGE), (4 * PAGE, PAGE)], background=False)
    pf.claim(0)
    pf.claim(1)
    assert pf.mapped_bytes == {"ahead": 0, "writer": 0}
    pf.claim(2)
    assert pf.mapped_bytes == {"ahead": 0, "writer": PAGE}
