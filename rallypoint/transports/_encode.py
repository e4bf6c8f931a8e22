"""Encoding a state dict into the wire format (:func:`encode`) and streaming it
(:class:`Encoded`), split from :mod:`rallypoint.transports.wire`, which re-exports both.

Two ways to carry checksums: in the header (one pass over the whole state before
anything is served; the process-group transport sends whole tensors and needs them up
front) or inline (``sums="inline"``: each piece's checksum computed as the piece is
streamed, on the connection's thread, overlapping the transfer; what the HTTP transport
serves, so serving costs no pass over the state on the caller's thread). Inline sums are
CRC-32 unless the stream is asked for another kind (:mod:`._crc`).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import json
import os
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from rallypoint.transports import _tensors as T
from rallypoint.transports._header import (
    _PREFIX,
    _SCALARS,
    DEFAULT_BLOCK,
    FORMAT,
    MAGIC,
    MAX_DEPTH,
    SUM,
    SUM_BYTES,
    VERSION,
    WireError,
    key_str,
)
from rallypoint.transports._crc import CRC32, SumKind, crc32
from rallypoint.transports._range_writer import COALESCE_BELOW

#: From this many bytes on, encoding computes header checksums on several threads.
PARALLEL_CRC_BYTES = 64 << 20


class Overtaken(RuntimeError):
    """A piece of live memory was being sent when a freeze began: the stream is dropped
    (the receiver fetches the range again, from the copies), since the caller may have
    changed the memory between two parts of the piece."""


class Encoded:
    """An encoded state dict: the header bytes plus zero-copy views of every tensor's bytes.

    Keeps the (possibly copied) tensors alive, so the views stay valid while this object
    lives. A transport can stream it many times (several receivers, retried ranges).
    With inline checksums (``encode(sums="inline")``) each piece's sum, of the kind the
    receiver asked for (CRC-32 unless it asked for another, see :mod:`._crc`), is computed as
    the piece is streamed and follows it; :meth:`_take` and :meth:`_give_back` are the
    hooks a live server uses to guard the tensors it has not copied.
    """

    def __init__(self, header: bytes, tensors: list[torch.Tensor], views: list[memoryview], *,
                 block: int = DEFAULT_BLOCK, inline: bool = False, sources: list[torch.Tensor] | None = None,
                 copied: list[bool] | None = None, keys: list[str] | None = None,
                 sizes: list[int] | None = None) -> None:
        self.header = header  #: prefix + JSON header, ready to send
        self._tensors = tensors
        self.views = views
        self.block = block
        self.inline = inline
        #: the caller's tensors the encoding was taken from, and whether each was copied
        self.sources = sources if sources is not None else list(tensors)
        self.copied = copied if copied is not None else [True] * len(tensors)
        self.keys = keys if keys is not None else [f"tensor {i}" for i in range(len(tensors))]
        #: bytes of each tensor (a device tensor kept on its device has an empty view)
        self.sizes = sizes if sizes is not None else [v.nbytes for v in views]
        self.starts: list[int] = []
        pos = 0
        for n in self.sizes:
            self.starts.append(pos)
            pos += n
        self.data_bytes = pos
        #: tensors kept on their device (``encode(keep_device=...)``): no bytes to stream
        self.on_device = [v.nbytes != n for v, n in zip(views, self.sizes)]
        #: (data start, length, tensor index, start within the tensor), as in the header
        self.pieces = [(s + st, min(block, n - st), i, st)
                       for i, (s, n) in enumerate(zip(self.starts, self.sizes)) for st in range(0, n, block)]
        self._piece_starts = [p[0] for p in self.pieces]

    def tensor(self, i: int) -> torch.Tensor:
        """The i-th tensor as encoded (contiguous, on the host), kept alive by this object."""
        return self._tensors[i]

    @property
    def stream_bytes(self) -> int:
        return len(self.header) + self.wire_bytes(0, self.data_bytes)

    def wire_bytes(self, start: int, end: int) -> int:
        """Bytes on the wire for data bytes ``[start, end)`` (4 more per piece when inline)."""
        if not self.inline or start >= end:
            return end - start
        n = bisect.bisect_left(self._piece_starts, end) - bisect.bisect_left(self._piece_starts, start)
        return end - start + SUM_BYTES * n

    def aligned(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` starts and ends at piece boundaries (inline ranges must)."""
        if start == end:
            return 0 <= start <= self.data_bytes
        i = bisect.bisect_left(self._piece_starts, start)
        j = bisect.bisect_left(self._piece_starts, end)
        return (i < len(self.pieces) and self._piece_starts[i] == start and j > 0
                and self.pieces[j - 1][0] + self.pieces[j - 1][1] == end)

    def iter_data(self, start: int = 0, end: int | None = None, piece: int = DEFAULT_BLOCK,
                  sum_kind: SumKind = CRC32) -> Iterator[memoryview]:
        """Views covering data bytes ``[start, end)``, each at most ``piece`` bytes (inline:
        each checksum block, in parts of at most ``piece`` bytes, followed by its checksum
        of kind ``sum_kind``; a live piece that a freeze overtakes raises :class:`Overtaken`
        instead of its checksum)."""
        end = self.data_bytes if end is None else end
        if not 0 <= start <= end <= self.data_bytes:
            raise ValueError(f"range [{start}, {end}) outside the data region of {self.data_bytes} bytes")
        if any(self.on_device):
            raise ValueError("tensors kept on their device cannot be streamed as bytes")
        if self.inline:
            yield from self._iter_inline(start, end, sum_kind, piece)
            return
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        pos = start
        small = bytearray()  # consecutive small tensors travel as one piece (one copy)
        while pos < end and i < len(self.views):
            v, s = self.views[i], self.starts[i]
            lo, hi = pos - s, min(v.nbytes, end - s)
            if hi - lo < COALESCE_BELOW:
                small += v[lo:hi]
                if len(small) >= piece:
                    yield memoryview(bytes(small))
                    small.clear()
            else:
                if small:
                    yield memoryview(bytes(small))
                    small.clear()
                while lo < hi:
                    n = min(piece, hi - lo)
                    yield v[lo : lo + n]
                    lo += n
            pos = s + v.nbytes
            i += 1
        if small:
            yield memoryview(bytes(small))

    def _take(self, ti: int) -> tuple[memoryview, bool]:
        """The view to read tensor ``ti`` from, and whether it is the caller's live memory
        (then :meth:`_summed` follows once the piece is checksummed or copied, and
        :meth:`_give_back` once it left). Overridden by live servers."""
        return self.views[ti], False

    def _summed(self, ti: int, live: bool) -> None:
        """The piece of tensor ``ti`` just taken is checksummed (or copied)."""

    def _give_back(self, pi: int, ti: int, live: bool, sent: bool) -> None:
        """Piece ``pi`` (of tensor ``ti``) was read (``sent``: and sent completely; a small
        piece, copied into a batch, is given back unsent once copied, then again, as a copy
        (``live`` false), once its batch has left)."""

    def _unfrozen(self) -> bool:
        """Whether live memory may still be read as it is: no freeze has begun (see
        :class:`~rallypoint.transports._live.LiveEncoded`). Nothing here is live: always."""
        return True

    def _parts_sent(self, ti: int) -> None:
        """Every part of a piece of live tensor ``ti`` was sent, each summed just before:
        raise (:class:`Overtaken`, or the live server's own error) where the memory may
        have changed between two parts, so that the piece's sum, which would agree with
        a torn piece, is never sent. Nothing here is live: never called."""

    def _iter_inline(self, start: int, end: int, kind: SumKind, sub: int) -> Iterator[memoryview]:
        if not self.aligned(start, end):
            raise ValueError(f"range [{start}, {end}) is not aligned to checksum blocks")
        first = bisect.bisect_left(self._piece_starts, start)
        last = bisect.bisect_left(self._piece_starts, end)
        small = bytearray()  # small pieces (and their sums) travel together (one copy)
        batched: list[tuple[int, int]] = []  # (piece, tensor) copied into ``small``: sent when it has left
        for pi in range(first, last):
            _, ln, ti, st = self.pieces[pi]
            view, live = self._take(ti)
            sent = summed = False
            try:
                part = view[st : st + ln]
                if ln < COALESCE_BELOW:
                    at = len(small)
                    small += part
                    self._summed(ti, live)
                    summed = True  # copied: what is sent is what was summed
                    small += SUM.pack(kind.of(memoryview(small)[at:]))
                    batched.append((pi, ti))
                    if len(small) >= self.block:
                        yield memoryview(bytes(small))
                        small.clear()
                        self._batch_sent(batched)
                    continue
                if small:
                    yield memoryview(bytes(small))
                    small.clear()
                    self._batch_sent(batched)
                checked = live and not kind.verifies  # no sum to catch a change: the end check must
                if not checked and (ln <= sub or (live and not self._unfrozen())):
                    # One part, or a freeze under way (it waits for this): summed whole before
                    # it is sent, so a change after the freeze fails the receiver's check.
                    crc = kind.of(part)
                    self._summed(ti, live)
                    summed = True
                    yield part
                    yield memoryview(SUM.pack(crc))
                    sent = True
                    continue
                # Summed ``sub`` bytes at a time, each just before it is sent (the sum and
                # the kernel's copy read the part once each while it is cached; measured
                # faster end to end than summing the block whole, docs/benchmarks.md).
                if live:
                    # The freeze need not wait for this piece: the end check drops it if a
                    # freeze overtook it or its tensor changed in place (``_parts_sent``).
                    if checked:
                        self._parts_sent(ti)  # without sums, not even begun once a freeze has
                    self._summed(ti, live)
                    summed = True
                state = kind.begin()
                for lo in range(0, ln, sub):
                    chunk = part[lo : lo + sub]
                    state = kind.update(state, chunk)
                    yield chunk
                if live:
                    self._parts_sent(ti)  # raises if the memory may have changed between two parts
                yield memoryview(SUM.pack(kind.value(state)))
                sent = True
            finally:
                if not summed:
                    self._summed(ti, live)
                self._give_back(pi, ti, live, sent)
        if small:
            yield memoryview(bytes(small))
            self._batch_sent(batched)

    def _batch_sent(self, batched: list[tuple[int, int]]) -> None:
        """The batch of small pieces ``batched`` has left: each counts as sent (a copy:
        what left is what was summed), then the list is emptied for the next batch."""
        for pi, ti in batched:
            self._give_back(pi, ti, False, True)
        batched.clear()

    def iter_stream(self, piece: int = DEFAULT_BLOCK) -> Iterator[memoryview]:
        """The whole stream: header, then the data."""
        yield memoryview(self.header)
        yield from self.iter_data(piece=piece)

    def write_to(self, f: Any) -> None:
        for v in self.iter_stream():
            f.write(v)


def encode(state_dict: Any, *, block: int = DEFAULT_BLOCK, extra: dict[str, Any] | None = None,
           copy: bool = False, copy_below: int = 0, sums: str = "header",
           keep_device: torch.device | None = None) -> Encoded:
    """Encode ``state_dict`` (nested dict/list/tuple of tensors and plain values).

    Non-contiguous or device tensors are copied to contiguous host memory (only the
    elements they view); contiguous CPU tensors are not copied unless ``copy`` (then the
    encoding shares no memory with ``state_dict``, which may change while it is served),
    or they are smaller than ``copy_below`` bytes, or they are inference tensors (no
    version counter to guard them with). ``sums="inline"``: no checksums are computed
    here (no pass over the whole state before serving); each piece's sum (the kind the
    receiver asks for, CRC-32 by default) is computed as it is streamed and follows it. ``keep_device``: contiguous tensors on that (CUDA)
    device stay there, uncopied and unchecksummed (``"device": true`` in the header: a
    process group moves them device to device, see ``PGTransport``); their views are
    empty, so such an encoding cannot be streamed as bytes. Raises :class:`WireError`
    naming the key of a leaf that is not allowed.
    """
    if block <= 0:
        raise ValueError("block must be positive")
    if sums not in ("header", "inline"):
        raise ValueError(f"sums must be 'header' or 'inline', not {sums!r}")
    sources: list[torch.Tensor] = []
    copied: list[bool] = []
    keys: list[str] = []
    sizes: list[int] = []
    tensors: list[torch.Tensor] = []
    views: list[memoryview] = []
    specs: list[dict[str, Any]] = []
    offset = 0

    def tensor_node(x: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        nonlocal offset
        key = key_str(path)
        dmeta = None
        local = x
        if T.is_dtensor(x):
            try:
                dmeta = T.dtensor_meta(x)
            except TypeError as exc:
                raise WireError(f"{key}: {exc}", key=key) from None
            local = x.to_local()  # type: ignore[attr-defined]  # a DTensor (checked above)
        elif type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise WireError(f"{key}: tensor subclass {type(x).__name__} is not supported", key=key)
        if local.layout != torch.strided or local.is_quantized or local.device.type == "meta":
            raise WireError(f"{key}: only dense tensors are supported (got {local.layout}, {local.device})", key=key)
        name = T.DTYPE_NAMES.get(local.dtype)
        if name is None:
            raise WireError(f"{key}: dtype {local.dtype} is not supported by the wire format", key=key)
        on_device = keep_device is not None and keep_device.type != "cpu" and local.device == keep_device
        if on_device:
            t = local.detach().contiguous()
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            shared = False
            view = memoryview(b"")
            n = t.numel() * t.element_size()
        else:
            t = T.sendable(local)
            shared = t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            if shared and (copy or t.numel() * t.element_size() < copy_below or t.is_inference()):
                t = t.clone()
                shared = False
            view = T.byte_view(t)
            n = view.nbytes
        specs.append(
            {
                "key": key,
                "dtype": name,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": n,
                **({} if sums == "inline" else {"crc32": []}),  # filled in below, possibly in parallel
                **({"device": True} if on_device else {}),
                "param": bool(isinstance(x, torch.nn.Parameter) and x.requires_grad),
                "dtensor": dmeta,
            }
        )
        tensors.append(t)
        views.append(view)
        sources.append(local)
        copied.append(not shared)
        keys.append(key)
        sizes.append(n)
        offset += n
        return {"t": len(specs) - 1}

    def walk(x: Any, path: tuple[Any, ...], depth: int, tensors_ok: bool = True) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise WireError(f"{key_str(path)}: nested deeper than {MAX_DEPTH} levels (a cycle?)", key=key_str(path))
        if isinstance(x, torch.Tensor) and tensors_ok:
            return tensor_node(x, path)
        if type(x) in _SCALARS:
            return {"v": x}
        if isinstance(x, dict) and type(x) in (dict, OrderedDict):
            items = []
            for k, v in x.items():
                if type(k) not in _SCALARS:
                    raise WireError(
                        f"{key_str(path)}: dict key {k!r} of type {type(k).__name__} is not allowed "
                        "(str, int, float, bool or None)",
                        key=key_str(path),
                    )
                items.append([k, walk(v, path + (k,), depth + 1, tensors_ok)])
            node: dict[str, Any] = {"d": items}
            if type(x) is OrderedDict:
                node["o"] = True
            meta = getattr(x, "_metadata", None)
            if meta is not None:
                node["m"] = walk(meta, path + ("_metadata",), depth + 1, tensors_ok=False)
            return node
        if type(x) is list:
            return {"l": [walk(v, path + (i,), depth + 1, tensors_ok) for i, v in enumerate(x)]}
        if type(x) is torch.Size:
            return {"s": [int(s) for s in x]}
        if type(x) is tuple:
            return {"u": [walk(v, path + (i,), depth + 1, tensors_ok) for i, v in enumerate(x)]}
        raise WireError(
            f"{key_str(path)}: leaf of type {type(x).__name__} is not allowed (tensors, dict/list/tuple, "
            "int, float, str, bool, None)",
            key=key_str(path),
        )

    tree = walk(state_dict, (), 0)
    if sums == "header":
        _fill_checksums(specs, views, block)  # device tensors: empty views, no sums
    header = {
        "format": FORMAT,
        "version": VERSION,
        **({"sums": "inline"} if sums == "inline" else {}),
        "block": block,
        "data_bytes": offset,
        "extra": extra or {},
        "tree": tree,
        "tensors": specs,
    }
    try:
        raw = json.dumps(header, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise WireError(f"header cannot be encoded as JSON: {exc}") from None
    return Encoded(_PREFIX.pack(MAGIC, len(raw), zlib.crc32(raw)) + raw, tensors, views, block=block,
                   inline=sums == "inline", sources=sources, copied=copied, keys=keys, sizes=sizes)



def _fill_checksums(specs: list[dict[str, Any]], views: list[memoryview], block: int) -> None:
    """One CRC-32 per ``block`` of every tensor. From PARALLEL_CRC_BYTES on, the blocks are
    spread over a few threads (zlib releases the GIL): a 1 GB state takes ~0.3 s of CRC on
    one core, and this runs on the sender's step."""
    jobs = [(i, s) for i, v in enumerate(views) for s in range(0, v.nbytes, block)]
    total = sum(v.nbytes for v in views)

    def crc(job: tuple[int, int]) -> int:
        i, s = job
        return crc32(views[i][s : s + block])

    workers = min(4, os.cpu_count() or 1)
    if total >= PARALLEL_CRC_BYTES and workers > 1:
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="rp-wire-crc") as ex:
            results = list(ex.map(crc, jobs, chunksize=16))
    else:
        results = [crc(j) for j in jobs]
    for (i, _), c in zip(jobs, results):
        specs[i]["crc32"].append(c)


__all__ = ["Encoded", "Overtaken", "encode"]
