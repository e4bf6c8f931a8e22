"""The wire format's data checksums.

CRC-32 (zlib's polynomial and values) is the format's checksum: in the header's ``crc32``
lists and, by default, after each piece of an inline-checksum stream. It comes from
ISA-L where the ``isal`` package is installed (a dependency), else from zlib (same
values, so a sender with one and a receiver with the other agree).

An HTTP receive may ask its source for another kind of inline sum, per range
(:class:`SumKind`; ``xxh3``: the low 32 bits of XXH3-64, seed 0, from the ``xxhash``
package). The source says in its reply which kind it used; a source that does not know
the kind (an older release, or no ``xxhash``) sends CRC-32 and says nothing, which the
receiver reads as CRC-32. So mixed versions agree.

Why: each checksum block is summed by the sender as it is sent and by the receiver as it
arrives, so the checksum is on the transfer's critical path twice. Measured here: zlib
2-6 GB/s, ISA-L CRC-32 10.6 GB/s from memory and 12.4 GB/s on bytes in the cache, XXH3
10.5 GB/s from memory and ~40 GB/s in the cache. The receiver sums each read while its
bytes are in the cache, so XXH3 cuts the receiver's share to about 40 %
(bench/transport.py); the sender reads the state from memory, where both run at memory
speed. All of them release the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

crc32: Callable[..., int]  # (data, value=0): a running CRC continues from value
try:
    from isal.isal_zlib import crc32 as _isal_crc32

    crc32 = _isal_crc32
    IMPL = "isal"
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    from zlib import crc32 as _zlib_crc32

    crc32 = _zlib_crc32
    IMPL = "zlib"

_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class SumKind:
    """One kind of 32-bit piece checksum: a one-shot function and a running one.

    ``begin()`` starts a running sum, ``update(state, data)`` continues it (returning the
    new state) and ``value(state)`` is the sum of everything given so far, equal to
    ``of(all the bytes)``."""

    name: str
    of: Callable[[Any], int]
    begin: Callable[[], Any]
    update: Callable[[Any, Any], Any]
    value: Callable[[Any], int]
    #: False for :data:`NONE`, whose "sum" is a constant: it checks nothing
    verifies: bool = True


def _crc_value(state: int) -> int:
    return state


CRC32 = SumKind("crc32", crc32, int, lambda state, data: crc32(data, state), _crc_value)

#: The kinds this process can compute, by wire name (``crc32`` always).
SUM_KINDS: dict[str, SumKind] = {"crc32": CRC32}

XXH3: SumKind | None
try:
    import xxhash as _xxhash

    def _xxh3_update(state: Any, data: Any) -> Any:
        state.update(data)
        return state

    XXH3 = SumKind("xxh3", lambda data: _xxhash.xxh3_64_intdigest(data) & _MASK, _xxhash.xxh3_64,
                   _xxh3_update, lambda state: state.intdigest() & _MASK)
    SUM_KINDS["xxh3"] = XXH3
except ImportError:  # pragma: no cover - xxhash is a dependency; CRC-32 is the fallback
    XXH3 = None

#: No sums (``HTTPTransport(checksum="none")``, opt-in): each piece is followed by a
#: constant 0 in its sum's place. The bytes are trusted to the connection (TCP's own
#: checksum; over TLS, its authenticated records, which make sums redundant); the marker
#: still comes only after a live piece's end check (the piece was not overtaken by a
#: freeze), so a piece cut short by the sender's step is never taken as whole. What it
#: gives up: a bit flipped in either host's memory or NIC on the way is not caught.
NONE = SumKind("none", lambda data: 0, int, lambda state, data: state, _crc_value, verifies=False)
SUM_KINDS["none"] = NONE

#: Longest kind name a request or reply may carry (checked before the lookup).
MAX_KIND_CHARS = 16


def fastest() -> SumKind:
    """The kind a receiver asks for: XXH3 where ``xxhash`` is installed, else CRC-32."""
    return XXH3 if XXH3 is not None else CRC32


def kind_named(name: str | None) -> SumKind | None:
    """The kind called ``name`` (None or empty: CRC-32, what a source that names no kind
    sent), or None when this process does not know it."""
    if not name:
        return CRC32
    if len(name) > MAX_KIND_CHARS:
        return None
    return SUM_KINDS.get(name)


__all__ = ["CRC32", "IMPL", "MAX_KIND_CHARS", "NONE", "SUM_KINDS", "SumKind", "XXH3", "crc32", "fastest", "kind_named"]
