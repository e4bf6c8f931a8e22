"""The wire format's header: constants, :class:`WireError`, and strict validation.

Split from :mod:`rallypoint.transports.wire` (which re-exports every name here) so the
rules a received header must pass read in one place. Validation is strict on purpose:
the header decides how much the receiver allocates and where bytes go, so every number is
checked against the others (shape x dtype = nbytes, offsets back to back, checksum counts)
before any tensor is allocated.
"""

from __future__ import annotations

import bisect
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rallypoint.transports import _tensors as T

MAGIC = b"RPWIRE01"
_PREFIX = struct.Struct("<8sQI")
PREFIX_BYTES = _PREFIX.size
FORMAT = "rallypoint.wire"
VERSION = 1
#: Checksum granularity; also the unit in which parallel ranges are cut and retried.
DEFAULT_BLOCK = 1 << 20
#: Largest header accepted by default (4,000 tiny tensors need well under 1 MiB).
DEFAULT_MAX_HEADER_BYTES = 64 << 20
#: Smallest checksum block a network receiver accepts: every block costs a checksum and a
#: bookkeeping entry, so a tiny block would let a small header cost much memory.
MIN_NETWORK_BLOCK = 4096
#: An inline checksum: the CRC-32 of the piece before it, unsigned little-endian.
SUM = struct.Struct("<I")
SUM_BYTES = SUM.size
#: Deepest container nesting accepted, both ways (guards recursion and cyclic inputs).
MAX_DEPTH = 200
_SCALARS = (int, float, str, bool, type(None))

ReadInto = Callable[[memoryview], "int | None"]


class WireError(ValueError):
    """A state dict cannot be encoded, or a received stream is invalid.

    ``key`` names the offending entry when there is one; ``target_modified`` is True only
    when an in-place receive had already written into the caller's tensors.
    """

    def __init__(self, message: str, *, key: str | None = None, target_modified: bool = False) -> None:
        if target_modified:
            message += " (in-place receive: the target's tensors were partly overwritten; retry before using them)"
        super().__init__(message)
        self.key = key
        self.target_modified = target_modified


def key_str(path: tuple[Any, ...]) -> str:
    """``('state', 0, 'exp_avg')`` -> ``['state'][0]['exp_avg']``: unambiguous, for messages."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


# --------------------------------------------------------------------------- header


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the header describes it (validated)."""

    index: int
    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crcs: tuple[int, ...]
    param: bool
    dtensor: dict[str, Any] | None
    #: sent from device memory by a process group: no checksums, received on a device
    device: bool = False

    @property
    def key(self) -> str:
        """The entry's key path, for messages (built on demand: most headers never need it)."""
        return key_str(self.path)


@dataclass
class Header:
    """A validated header: the tree, the tensors, and the pieces checksums cover."""

    tree: dict[str, Any]
    tensors: list[TensorSpec]
    data_bytes: int
    block: int
    extra: dict[str, Any]
    #: (data start, length, tensor index, start within the tensor, crc), by data start;
    #: crc is -1 when the checksums travel inline
    pieces: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    #: ``"sums": "inline"``: no checksums here; each piece of the data is followed on the
    #: wire by its CRC-32 (4 bytes, little-endian), computed by the sender as it sends
    inline: bool = False

    def wire_bytes(self, start: int, end: int) -> int:
        """Bytes on the wire for data bytes ``[start, end)`` (piece-aligned): the data, plus
        4 per piece when the checksums travel inline."""
        if not self.inline or start >= end:
            return end - start
        return end - start + SUM_BYTES * self.pieces_in(start, end)

    def pieces_in(self, start: int, end: int) -> int:
        """How many pieces start in data bytes ``[start, end)``."""
        if self._starts is None:
            self._starts = [p[0] for p in self.pieces]
        return bisect.bisect_left(self._starts, end) - bisect.bisect_left(self._starts, start)

    _starts: list[int] | None = field(default=None, init=False, repr=False)

    def split(self, parts: int, max_bytes: int | None = None) -> list[tuple[int, int]]:
        """Cut the data region into about ``parts`` ranges (each at most ``max_bytes`` when
        a piece allows), at piece boundaries so each range is verifiable on its own."""
        if self.data_bytes == 0:
            return []
        target = -(-self.data_bytes // max(1, parts))
        if max_bytes:
            target = min(target, max_bytes)
        out: list[tuple[int, int]] = []
        start = self.pieces[0][0]
        for ds, ln, *_ in self.pieces:
            if ds + ln - start >= target:
                out.append((start, ds + ln))
                start = ds + ln
        if start < self.data_bytes:
            out.append((start, self.data_bytes))
        return out


def _bad(msg: str, key: str | None = None) -> WireError:
    return WireError(f"invalid header: {msg}", key=key)


def _int(x: Any, what: str, key: str | None = None) -> int:
    if type(x) is not int or x < 0:
        raise _bad(f"{what} must be a non-negative integer, got {x!r}", key)
    return x


def parse_header(raw: bytes | bytearray | memoryview, min_block: int = 1, max_data_bytes: int | None = None) -> Header:
    """Parse and validate the JSON header (without the 16-byte prefix). ``min_block`` and
    ``max_data_bytes`` are checked before anything is built from the tensor list, so a
    hostile header is refused before it costs memory."""
    try:
        doc = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:
        raise _bad(f"not valid UTF-8 JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad("not a rallypoint.wire header")
    if doc.get("version") != VERSION:
        raise _bad(f"version {doc.get('version')!r} is not supported (this build reads {VERSION})")
    block = _int(doc.get("block"), "block")
    data_bytes = _int(doc.get("data_bytes"), "data_bytes")
    extra = doc.get("extra")
    if block == 0 or not isinstance(extra, dict) or not isinstance(doc.get("tensors"), list):
        raise _bad("block, extra or tensors missing")
    if block < min_block:
        raise _bad(f"block of {block} bytes is below the minimum of {min_block}")
    if max_data_bytes is not None and data_bytes > max_data_bytes:
        raise WireError(f"the state is {data_bytes} bytes, over this receiver's limit of {max_data_bytes} bytes "
                        "(max_state_bytes / RALLYPOINT_MAX_STATE_BYTES)")
    sums = doc.get("sums", "header")
    if sums not in ("header", "inline"):
        raise _bad(f"sums must be 'header' or 'inline', got {sums!r}")
    inline = sums == "inline"
    specs = doc["tensors"]
    paths: dict[int, tuple[Any, ...]] = {}
    tree = doc.get("tree")
    _check_tree(tree, (), 0, paths, len(specs))
    assert isinstance(tree, dict)  # _check_tree refuses anything else
    if len(paths) != len(specs):
        raise _bad(f"the tree references {len(paths)} tensors but {len(specs)} are described")
    tensors: list[TensorSpec] = []
    pieces: list[tuple[int, int, int, int, int]] = []
    offset = 0
    dtypes = T.DTYPES
    for i, s in enumerate(specs):
        if not isinstance(s, dict):
            raise _bad(f"tensor {i} is not an object", key_str(paths[i]))
        name = s.get("dtype")
        dtype = dtypes.get(name) if isinstance(name, str) else None
        key = key_str(paths[i]) if dtype is None else None
        if dtype is None:
            raise WireError(f"{key}: unknown or unsupported dtype {name!r}", key=key)
        shape = s.get("shape")
        nbytes = s.get("nbytes")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape) or type(nbytes) is not int:
            key = key_str(paths[i])
            raise _bad("shape must be a list of non-negative integers and nbytes an integer", key)
        shape_t = tuple(shape)
        if T.numel_of(shape_t) * dtype.itemsize != nbytes:
            key = key_str(paths[i])
            raise WireError(f"{key}: nbytes {nbytes} disagrees with shape {list(shape_t)} of {s['dtype']}", key=key)
        if type(s.get("offset")) is not int or s["offset"] != offset:
            key = key_str(paths[i])
            raise WireError(f"{key}: offset {s.get('offset')} disagrees with the sizes before it ({offset})", key=key)
        on_device = s.get("device", False)
        if type(on_device) is not bool:
            raise _bad("device must be true or false", key_str(paths[i]))
        crcs: Any = s.get("crc32", [] if inline or on_device else None)
        if on_device and crcs != []:
            key = key_str(paths[i])
            raise WireError(f"{key}: checksums for a tensor sent from device memory", key=key)
        if inline and crcs != []:
            key = key_str(paths[i])
            raise WireError(f"{key}: checksums in the header of an inline-checksum stream", key=key)
        if not isinstance(crcs, list) or (not inline and not on_device and len(crcs) != -(-nbytes // block)):
            key = key_str(paths[i])
            raise WireError(f"{key}: expected {-(-nbytes // block)} checksums", key=key)
        for c in crcs:
            if type(c) is not int or not 0 <= c < 2**32:
                raise _bad(f"checksum {c!r} is not a CRC-32", key_str(paths[i]))
        dmeta = s.get("dtensor")
        if dmeta is not None and not isinstance(dmeta, dict):
            raise _bad("dtensor must be an object or null", key_str(paths[i]))
        for j in range(-(-nbytes // block)):
            st = j * block
            pieces.append((offset + st, min(block, nbytes - st), i, st, -1 if inline or on_device else crcs[j]))
        tensors.append(
            TensorSpec(i, paths[i], dtype, shape_t, offset, nbytes, tuple(crcs), s.get("param") is True, dmeta,
                       on_device)
        )
        offset += nbytes
    if offset != data_bytes:
        raise WireError(f"invalid header: data_bytes {data_bytes} but the tensors add up to {offset}")
    return Header(tree, tensors, data_bytes, block, extra, pieces, inline)


def _check_tree(node: Any, path: tuple[Any, ...], depth: int, paths: dict[int, tuple[Any, ...]], n: int) -> None:
    """Validate a tree node recursively and record the path of every tensor index. (The
    node's key is built only for a refusal: for every node of a state of thousands of
    tensors it was a third of parsing the header.)"""
    if depth > MAX_DEPTH:
        raise _bad(f"tree nested deeper than {MAX_DEPTH}", key_str(path))
    if not isinstance(node, dict) or not node:
        raise _bad(f"tree node {str(node)[:80]!r} is not an object", key_str(path))
    kind = "d" if "d" in node else next(iter(node))
    if kind == "d" and set(node) <= {"d", "o", "m"}:
        items = node["d"]
        if not isinstance(items, list) or node.get("o", True) is not True:
            raise _bad("bad dict node", key_str(path))
        for it in items:
            if not isinstance(it, list) or len(it) != 2 or type(it[0]) not in _SCALARS:
                raise _bad("bad dict item", key_str(path))
            _check_tree(it[1], path + (it[0],), depth + 1, paths, n)
        if "m" in node:
            before = len(paths)
            _check_tree(node["m"], path + ("_metadata",), depth + 1, paths, n)
            if len(paths) != before:
                raise _bad("_metadata may not hold tensors", key_str(path))
        return
    if len(node) != 1:
        raise _bad(f"tree node has unexpected fields {sorted(node)}", key_str(path))
    val = node[kind]
    if kind == "t":
        if type(val) is not int or not 0 <= val < n or val in paths:
            raise _bad(f"bad or repeated tensor index {val!r}", key_str(path))
        paths[val] = path
    elif kind == "v":
        if type(val) not in _SCALARS:
            key = key_str(path)
            raise WireError(f"{key}: value of type {type(val).__name__} is not an allowed leaf", key=key)
    elif kind in ("l", "u"):
        if not isinstance(val, list):
            raise _bad("bad list/tuple node", key_str(path))
        for i, v in enumerate(val):
            _check_tree(v, path + (i,), depth + 1, paths, n)
    elif kind == "s":
        if not isinstance(val, list) or any(type(v) is not int for v in val):
            raise _bad("bad torch.Size node", key_str(path))
    else:
        key = key_str(path)
        raise WireError(f"{key}: unknown node kind {kind!r} (leaf type not allowed)", key=key)


def read_exact(readinto: ReadInto, buf: memoryview, what: str, key: str | None = None) -> None:
    """Fill ``buf`` from ``readinto``; a short stream is a :class:`WireError`."""
    got, n = 0, buf.nbytes
    while got < n:
        k = readinto(buf[got:])
        if not k:
            raise WireError(f"stream truncated: got {got} of {n} bytes of {what}", key=key)
        got += k


def read_header(readinto: ReadInto, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, min_block: int = 1,
                max_data_bytes: int | None = None) -> Header:
    """Read the prefix and the header from a stream and validate them (see :func:`parse_header`)."""
    pre = bytearray(PREFIX_BYTES)
    read_exact(readinto, memoryview(pre), "the header length")
    magic, hlen, hcrc = _PREFIX.unpack(pre)
    if magic != MAGIC:
        raise WireError(f"not a rallypoint wire stream (magic {bytes(magic)!r})")
    if hlen > max_header_bytes:
        raise WireError(f"header of {hlen} bytes is over the limit of {max_header_bytes} bytes")
    raw = bytearray(hlen)
    read_exact(readinto, memoryview(raw), "the header")
    if zlib.crc32(raw) != hcrc:
        raise WireError("header checksum mismatch: the stream is corrupt")
    return parse_header(raw, min_block, max_data_bytes)
