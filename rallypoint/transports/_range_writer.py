"""Piece-wise writing of a wire stream's data region into a :class:`~rallypoint.transports.wire.Sink`.

Split out of ``wire.py`` (one responsibility each): the sink allocates and verifies
tensors, this writer fills byte ranges of them, which is what parallel HTTP ranges need.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from rallypoint.transports._header import ReadInto, WireError, read_exact

if TYPE_CHECKING:
    from rallypoint.transports.wire import Sink

#: Tensors (or remainders) smaller than this are batched: sent as one coalesced piece,
#: and read through a scratch buffer of SCRATCH_BYTES instead of one read each.
COALESCE_BELOW = 64 << 10
SCRATCH_BYTES = 256 << 10


class RangeWriter:
    """Writes data bytes ``[start, end)`` (piece-aligned) into a :class:`Sink`.

    Either pull (:meth:`pull`, ``readinto`` straight into the tensors: no copy) or push
    (:meth:`write`, for clients that hand out ``bytes`` chunks: one copy into the tensor).
    Each piece is verified as soon as it is complete. A failed range may be retried with a
    new writer for the same range.
    """

    def __init__(self, sink: Sink, start: int, end: int) -> None:
        h = sink.header
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
        self._pi = self._first
        self._fill = 0  # bytes already written into piece _pi

    def _piece(self, pi: int) -> memoryview:
        _, ln, ti, st, _ = self.sink.header.pieces[pi]
        if self.sink._direct[ti]:
            self.sink.target_touched = True
        return self.sink._views[ti][st : st + ln]

    def _key(self) -> str:
        """Key of the tensor being written (for messages only: building it costs)."""
        return self.sink.header.tensors[self.sink.header.pieces[self._pi][2]].key

    def pull(self, readinto: ReadInto) -> None:
        """Read the whole range from ``readinto`` directly into the destination tensors.

        Pieces of at least COALESCE_BELOW bytes are read in place (no copy); runs of
        smaller ones are read a scratch buffer at a time and copied, so 4,000 tiny
        tensors cost a few reads instead of 4,000 system calls.
        """
        scratch: memoryview | None = None
        pieces = self.sink.header.pieces
        while self._pi < self._last:
            view = self._piece(self._pi)
            if view.nbytes - self._fill < COALESCE_BELOW:
                if scratch is None:
                    scratch = memoryview(bytearray(SCRATCH_BYTES))
                want = min(SCRATCH_BYTES, self.end - (pieces[self._pi][0] + self._fill))
                n = readinto(scratch[:want])
                if not n:
                    key = self._key()
                    raise WireError(
                        f"stream truncated inside tensor {key}", key=key, target_modified=self.sink.target_touched
                    )
                self.write(scratch[:n])
                continue
            try:
                read_exact(readinto, view[self._fill :], "a tensor")
            except WireError as exc:
                key = self._key()
                msg = str(exc).replace("a tensor", f"tensor {key}")
                raise WireError(msg, key=key, target_modified=self.sink.target_touched) from None
            self._fill = 0
            self.sink._verify(self._pi)
            self._pi += 1

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (the next bytes of the range) into place."""
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < mv.nbytes:
            if self._pi >= self._last:
                raise WireError(f"{mv.nbytes - pos} bytes more than the range [{self.start}, {self.end}) holds")
            view = self._piece(self._pi)
            n = min(view.nbytes - self._fill, mv.nbytes - pos)
            view[self._fill : self._fill + n] = mv[pos : pos + n]
            self._fill += n
            pos += n
            if self._fill == view.nbytes:
                self._fill = 0
                self.sink._verify(self._pi)
                self._pi += 1

    def close(self) -> None:
        """Raise :class:`WireError` (naming the key) unless the whole range arrived."""
        if self._pi < self._last:
            key = self._key()
            raise WireError(
                f"{key}: stream truncated inside range [{self.start}, {self.end})",
                key=key,
                target_modified=self.sink.target_touched,
            )
