"""Mapping a fresh receive's pages ahead of its bytes, on a thread of its own.

Why: writing into newly allocated memory faults every 4 KiB page in, and the kernel zeroes
each one. On this 2-core VM that costs about 0.45-0.7 s per GB, more than the network copy
itself (a 4 GB fresh receive: ~1,050,000 minor faults). ``MADV_POPULATE_WRITE`` maps a
range of pages in one system call, ~30 % cheaper than faulting them one by one, but done
for the whole state before the first byte is asked for (what the receiver did until now),
the transfer waits for all of it. Here a background thread maps pieces in stream order
while the connections already receive into the ones mapped before; a connection that
reaches a piece the thread has not claimed yet maps that piece itself first. Each piece is
mapped once, by whoever claims it first; a piece claimed but still being mapped is simply
written, which faults the rest of its pages as before: correct, only slower.

Only fresh CPU destinations are mapped (never a caller's own tensors, which are mapped
already); best effort everywhere: off Linux or on kernels without the advice nothing
happens, and nothing here can make a receive fail.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from rallypoint.transports._tensors import populate_range

logger = logging.getLogger("rallypoint.transports.prefault")

#: Below this many fresh bytes the thread is not worth starting: claiming pieces as the
#: connections reach them maps small states fast enough.
BACKGROUND_MIN_BYTES = 64 << 20
PAGE = 4096


def lane_order(bounds: Sequence[tuple[int, int]], lanes: int) -> list[int]:
    """Piece indices in the order ``lanes`` writers reach them when they take the piece
    ranges ``bounds`` (``[first, last)`` piece indices, in the order they are handed out)
    in turn: each group of ``lanes`` consecutive ranges is written at once, one writer on
    each, so the pieces of a group are interleaved (the first of each range, then the
    second of each, ...). With one range per writer, the thread keeps ahead of every writer
    instead of only the first one's; with many short ranges the order stays close to the
    stream's."""
    lanes = max(1, lanes)
    order: list[int] = []
    for g in range(0, len(bounds), lanes):
        group = [range(a, b) for a, b in bounds[g : g + lanes]]
        for k in range(max((len(r) for r in group), default=0)):
            order.extend(r[k] for r in group if k < len(r))
    return order


def _has_a_page(addr: int, nbytes: int) -> bool:
    return (addr + nbytes) & ~(PAGE - 1) > (addr + PAGE - 1) & ~(PAGE - 1)


class Prefault:
    """Maps pieces ``(address, nbytes)`` (``None``: nothing to map, the piece's
    destination is not fresh memory) once each, claimed either by the background thread
    (in stream order, or in ``order``: piece indices, see :func:`lane_order`) or by a
    writer that reaches a piece first (:meth:`claim`)."""

    def __init__(self, pieces: Sequence[tuple[int, int] | None], *, background: bool = True,
                 order: Iterable[int] | None = None) -> None:
        # A piece without a whole page of its own (a tiny tensor) has nothing to map.
        self._pieces = [p if p is not None and _has_a_page(*p) else None for p in pieces]
        # 1: claimed by someone (or nothing to map). A bytearray so that claim() costs an
        # index when the piece is done, as it is for every read after a piece's first.
        self._claimed = bytearray(1 if p is None else 0 for p in self._pieces)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.mapped_bytes = {"ahead": 0, "writer": 0}
        self._order = list(range(len(self._pieces)) if order is None else order)
        self._thread: threading.Thread | None = None
        fresh = sum(p[1] for p in self._pieces if p is not None)
        if background and fresh >= BACKGROUND_MIN_BYTES:
            self._thread = threading.Thread(target=self._run, name="rp-prefault", daemon=True)
            self._thread.start()

    def _take(self, pi: int, who: str) -> tuple[int, int] | None:
        """Claim piece ``pi`` for ``who``: its ``(address, nbytes)``, or None if taken."""
        if self._claimed[pi]:
            return None
        with self._lock:
            if self._claimed[pi]:
                return None
            self._claimed[pi] = 1
            piece = self._pieces[pi]
            assert piece is not None  # pieces with nothing to map start claimed
            self.mapped_bytes[who] += piece[1]
            return piece

    def claim(self, pi: int) -> None:
        """Before writing piece ``pi``: map its pages now unless someone claimed it."""
        if self._claimed[pi]:
            return
        piece = self._take(pi, "writer")
        if piece is not None:
            populate_range(*piece)

    def _run(self) -> None:
        try:
            for pi in self._order:
                if self._stop.is_set():
                    return
                piece = self._take(pi, "ahead")
                if piece is not None:
                    populate_range(*piece)
        except Exception:  # noqa: BLE001 - best effort: a failure costs speed only
            logger.debug("prefault thread stopped", exc_info=True)

    def stop(self) -> None:
        """Stop mapping (the receive finished or failed); the thread ends after the piece
        in hand. Nothing waits for it: ``MADV_POPULATE_WRITE`` maps pages without writing
        them, so a late call on memory freed meanwhile changes no byte (on memory returned
        to the kernel it fails, ignored)."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread; True when it ended (tests)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


__all__ = ["BACKGROUND_MIN_BYTES", "Prefault"]
