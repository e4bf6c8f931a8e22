"""Piece-wise writing of a wire stream's data region into a :class:`~rallypoint.transports.wire.Sink`.

Split out of ``wire.py`` (one responsibility each): the sink allocates and verifies
tensors, this writer fills byte ranges of them, which is what parallel HTTP ranges need.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from rallypoint.transports._crc import CRC32, SumKind
from rallypoint.transports._header import SUM, SUM_BYTES, ReadInto, WireError, read_exact

if TYPE_CHECKING:
    from rallypoint.transports.wire import Sink

#: Tensors (or remainders) smaller than this are batched: sent as one coalesced piece,
#: and read through a scratch buffer of SCRATCH_BYTES instead of one read each.
COALESCE_BELOW = 64 << 10
SCRATCH_BYTES = 256 << 10
#: A big piece is read at most this many bytes per call and each read is checksummed at
#: once, while its bytes are still in the CPU's cache (half of this host's 2 MiB L2):
#: summing a whole 4 MiB piece after it arrived read it back from memory, the receiver's
#: largest cost after the kernel's copy (perf, 1 GB over loopback on one core). Smaller
#: reads cost more calls: 256 KiB took 0.33-0.35 s of receiver CPU per GB in place,
#: 1 MiB 0.28-0.32 s (5 heals of 1 GB into one process, 2 connections, 2 cores). Without
#: sums (``checksum="none"``) nothing is read back, and a piece is read whole, as much per
#: call as the socket holds: 0.95 and 0.96 of the wall time of 1 MiB calls (1 GB, 16 heals
#: each, alternating, two runs); with XXH3 sums, whole-piece reads took 1.06 of it.
SUM_AS_READ = 1 << 20


class RangeWriter:
    """Writes data bytes ``[start, end)`` (piece-aligned) into a :class:`Sink`.

    Either pull (:meth:`pull`, ``readinto`` straight into the tensors: no copy) or push
    (:meth:`write`, for clients that hand out ``bytes`` chunks: one copy into the tensor).
    Each piece is verified as soon as it is complete: against the header's checksum, or,
    in an inline-checksum stream, against the 4 bytes that follow the piece on the wire,
    of kind ``sum_kind`` (what the source said it sent; the header's checksums are always
    CRC-32). A failed range may be retried with a new writer for the same range, or for
    its rest from :attr:`verified_to`.
    """

    def __init__(self, sink: Sink, start: int, end: int, sum_kind: SumKind = CRC32) -> None:
        h = sink.header
        if sum_kind is not CRC32 and not h.inline:
            raise ValueError(f"{sum_kind.name} sums are inline only; this stream's checksums are in its header")
        starts = sink._piece_starts
        self._first = bisect.bisect_left(starts, start)
        self._last = bisect.bisect_left(starts, end)
        if not (0 <= start <= end <= h.data_bytes) or (
            start < end
            and (
                self._first >= len(starts)
                or starts[self._first] != start
                or h.pieces[self._last - 1][0] + h.pieces[self._last - 1][1] != end
            )
        ):
            raise ValueError(f"range [{start}, {end}) is not aligned to checksum blocks")
        self.sink, self.start, self.end = sink, start, end
        self._inline = h.inline
        self._pi = self._first
        self._fill = 0  # bytes already written into piece _pi
        self._sum = bytearray(SUM_BYTES)  # the inline checksum of piece _pi, once its data is in
        self._sum_fill = -1  # bytes of it read so far; -1: still reading the piece's data
        self._kind = sum_kind
        self._crc: Any = None  # running sum of piece _pi's bytes [0, _fill), when summed as read
        #: bytes still expected on the wire for this range (data, plus inline checksums)
        self.wire_left = h.wire_bytes(start, end)

    @property
    def verified_to(self) -> int:
        """Where the range's first piece not yet verified starts (its end once all are):
        the pieces before it are in place and checked, so a retry resumes there. After
        :meth:`pull` or :meth:`write` raised it is before the range's end: they raise only
        while a piece is still incomplete."""
        return self.sink.header.pieces[self._pi][0] if self._pi < self._last else self.end

    def _piece(self, pi: int) -> memoryview:
        _, ln, ti, st, _ = self.sink.header.pieces[pi]
        if self.sink._direct[ti]:
            self.sink.target_touched = True
        else:
            self.sink.prefault.claim(pi)
        return self.sink._views[ti][st : st + ln]

    def _key(self) -> str:
        """Key of the tensor being written (for messages only: building it costs)."""
        return self.sink.header.tensors[self.sink.header.pieces[self._pi][2]].key

    def _truncated(self) -> WireError:
        key = self._key()
        return WireError(f"stream truncated inside tensor {key}", key=key, target_modified=self.sink.target_touched)

    def _piece_done(self) -> None:
        """Piece ``_pi``'s data is in: verify it now, or wait for its inline checksum."""
        if self._inline:
            self._sum_fill = 0
            return
        self._fill = 0
        self.sink._verify(self._pi, got=self._crc)  # header sums are CRC-32, whose running state is its value
        self._crc = None
        self._pi += 1

    def _sum_done(self) -> None:
        kind = self._kind
        if self._crc is not None:
            got = kind.value(self._crc)
        else:  # filled by write() from the start: sum the piece now
            _, ln, ti, st, _ = self.sink.header.pieces[self._pi]
            got = kind.of(self.sink._views[ti][st : st + ln])
        self.sink._verify(self._pi, SUM.unpack(self._sum)[0], got=got)
        self._fill, self._sum_fill, self._crc = 0, -1, None
        self._pi += 1

    def _read_summed(self, readinto: ReadInto, view: memoryview) -> None:
        """Fill the rest of piece view ``view`` from ``readinto``, summing each read at once."""
        kind = self._kind
        if self._crc is None:  # a new piece, or one begun by write(): sum what is there
            self._crc = kind.begin()
            if self._fill:
                self._crc = kind.update(self._crc, view[: self._fill])
        crc = self._crc
        fill, end = self._fill, view.nbytes
        step = SUM_AS_READ if kind.verifies else end
        try:
            while fill < end:
                k = readinto(view[fill : min(end, fill + step)])
                if not k:
                    key = self._key()
                    raise WireError(f"stream truncated: got {fill} of {end} bytes of tensor {key}", key=key,
                                    target_modified=self.sink.target_touched)
                crc = kind.update(crc, view[fill : fill + k])
                fill += k
        finally:
            self.wire_left -= fill - self._fill
            self._fill, self._crc = fill, crc

    def pull(self, readinto: ReadInto) -> None:
        """Read the whole range from ``readinto`` directly into the destination tensors.

        Pieces of at least COALESCE_BELOW bytes are read in place (no copy); runs of
        smaller ones (and inline checksums) are read a scratch buffer at a time and
        copied, so 4,000 tiny tensors cost a few reads instead of 4,000 system calls.
        """
        scratch: memoryview | None = None
        sum_view = memoryview(self._sum)
        while self._pi < self._last:
            if self._sum_fill >= 0:  # the checksum after a big piece: 4 bytes, read exactly
                try:
                    read_exact(readinto, sum_view[self._sum_fill :], "a checksum")
                except WireError:
                    raise self._truncated() from None
                self.wire_left -= SUM_BYTES - self._sum_fill
                self._sum_done()
                continue
            view = self._piece(self._pi)
            if view.nbytes - self._fill < COALESCE_BELOW:
                if scratch is None:
                    scratch = memoryview(bytearray(SCRATCH_BYTES))
                n = readinto(scratch[: min(SCRATCH_BYTES, self.wire_left)])
                if not n:
                    raise self._truncated()
                self.write(scratch[:n])
                continue
            self._read_summed(readinto, view)
            self._piece_done()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (the next bytes of the range on the wire) into place."""
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < mv.nbytes:
            if self._pi >= self._last:
                raise WireError(f"{mv.nbytes - pos} bytes more than the range [{self.start}, {self.end}) holds")
            if self._sum_fill >= 0:
                n = min(SUM_BYTES - self._sum_fill, mv.nbytes - pos)
                self._sum[self._sum_fill : self._sum_fill + n] = mv[pos : pos + n]
                self._sum_fill += n
                pos += n
                if self._sum_fill == SUM_BYTES:
                    self._sum_done()
                continue
            view = self._piece(self._pi)
            n = min(view.nbytes - self._fill, mv.nbytes - pos)
            view[self._fill : self._fill + n] = mv[pos : pos + n]
            if self._crc is not None:  # a piece begun by pull(): keep its running sum
                self._crc = self._kind.update(self._crc, view[self._fill : self._fill + n])
            self._fill += n
            pos += n
            if self._fill == view.nbytes:
                self._piece_done()
        self.wire_left -= mv.nbytes

    def close(self) -> None:
        """Raise :class:`WireError` (naming the key) unless the whole range arrived."""
        if self._pi < self._last:
            key = self._key()
            raise WireError(
                f"{key}: stream truncated inside range [{self.start}, {self.end})",
                key=key,
                target_modified=self.sink.target_touched,
            )
