"""The safe state-dict wire format: a JSON header, then the raw bytes of every tensor.

Why: healing copies a live peer's whole state over the network. torchft unpickles those
bytes (``torch.load``), so a peer, or anything that can reach its port, can run code on the
receiver, and it sends every view's whole storage. Here nothing received is ever executed
(no pickle, no ``torch.load``): the header is JSON validated against fixed rules, and tensor
bytes are copied into tensors whose dtype and shape the receiver allocated itself.

Stream layout::

    8 bytes  magic b"RPWIRE01"
    8 bytes  header length H, unsigned little-endian
    4 bytes  CRC-32 of the header, unsigned little-endian
    H bytes  header, UTF-8 JSON (see below)
    D bytes  data: the bytes of tensor 0, tensor 1, ... back to back, no padding

Header (``version`` 1)::

    {"format": "rallypoint.wire", "version": 1, "block": B, "data_bytes": D,
     "extra": {...plain JSON...},
     "tree": NODE,
     "tensors": [{"key": "['model']['w']", "dtype": "float32", "shape": [3, 4],
                  "offset": 0, "nbytes": 48, "crc32": [...], "param": false,
                  "dtensor": null | {"placements": ..., "mesh_shape": ..., ...}}, ...]}

    NODE = {"t": i}                 tensor i of "tensors"
         | {"v": scalar}            int, float, str, bool or null
         | {"d": [[key, NODE], ...], "o": true?, "m": NODE?}
                                    dict (key: JSON scalar, so int keys of optimizer
                                    state survive); "o": was an OrderedDict; "m": its
                                    ``_metadata`` (module state-dict versions)
         | {"l": [NODE, ...]}  list | {"u": [NODE, ...]} tuple | {"s": [int, ...]} torch.Size

``crc32`` holds one CRC-32 (zlib's) per ``block`` bytes of the tensor (the last one
shorter), so a transport that fetches byte ranges in parallel (cut at those boundaries,
see :meth:`Header.split`) verifies and retries each range on its own, and an error names
the tensor's key and byte range.

Inline checksums (``"sums": "inline"`` in the header, no ``crc32`` lists): every checksum
block (a "piece") in the data region is followed by its checksum, 4 bytes little-endian:
CRC-32, or another kind a receiver asked for and the source confirmed outside the stream
(the HTTP transport's ``sum`` parameter and ``x-rallypoint-sum`` reply header; ``xxh3``:
the low 32 bits of XXH3-64, seed 0; see :mod:`rallypoint.transports._crc`)::

    D' bytes  piece 0, sum 0, piece 1, sum 1, ...   (D + 4 x pieces)

The sender sums each piece as it sends it, so serving needs no pass over the whole state
first (what the HTTP transport does: :mod:`rallypoint.transports._live`); a byte range
``[S, E)`` of the data (piece-aligned) travels as its pieces with their sums.

Receiving (see :class:`Sink`): tensor bytes are read straight into tensors, so receiving
N bytes of state needs ~N bytes, never a second staging copy of the whole stream:

* ``into=None`` (default): fresh tensors become the result. Nothing the caller holds is
  written, so a failure leaves their state untouched. Peak: the caller's old state plus
  the new one while both are alive.
* ``into=target, in_place=False``: fresh tensors are received and verified, and only then
  copied into the matching tensors of ``target`` (each fresh tensor is dropped right after
  its copy). The target is untouched on any error; peak extra memory is the size of the
  state being received.
* ``into=target, in_place=False, pool=ReceivePool()`` (what the transports pass when
  receiving ``into=`` a state): as above, but received into the buffers the pool kept from
  the last receive (mapped already), and at the end each target tensor that owns its
  storage takes its buffer's memory by swapping data pointers instead of being copied into
  (the old bytes go back to the pool): no page faults, no second pass, and still nothing
  written before the whole state verified (:mod:`rallypoint.transports._pool`).
* ``defer=True`` (with ``into=`` and a pool, on another thread than the one that uses the
  target: the Manager's quorum thread): the same, but :meth:`Sink.finish` only verifies and
  returns a :class:`Landing`; nothing of the target is touched until its ``land()`` runs
  (the training thread, between steps), where the swaps take microseconds.
* ``into=target, in_place=True``: bytes are read directly into the target's tensors
  (matching dtype/shape, CPU, contiguous): no extra memory. Everything checkable before the
  first byte (header, dtypes, shapes, sizes, DTensor meshes) is checked first, but a
  truncated or corrupt *data* region is only detected after some target bytes were
  overwritten: the :class:`WireError` then has ``target_modified=True`` and says so. Use
  it where the old state is disposable anyway (a healing replica's stale state) and retry
  from another peer on error.

Received tensors are CPU tensors (or the target's own tensors, on any device, with
``into=``). DTensor leaves (FSDP2) travel as their local shard plus placements, mesh shape,
global shape and stride; the receiver rebuilds them with ``DTensor.from_local`` on *its*
mesh (the DTensor's at the same key in ``into=``, else ``mesh=``). Each rank sends and
receives its own shard, so the meshes must have the same shape: resharding is refused.
``mesh=DEFER``: a DTensor with no mesh at hand arrives as a :class:`SentDTensor` (its
local shard and the sender's layout), for the caller to rebuild later on a mesh it picks
(the Manager does, on the training thread: :mod:`rallypoint.transports._rebuild`).

Not preserved: storage sharing between entries (tied weights arrive as two tensors unless
``into=`` holds the tied target), autograd history, and subclasses other than
``nn.Parameter`` and ``DTensor`` (refused when encoding).
"""

from __future__ import annotations

import bisect
import io
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from rallypoint.transports import _tensors as T
from rallypoint.transports._crc import CRC32, SumKind, crc32
from rallypoint.transports._pool import ReceivePool, can_swap, swap_into
from rallypoint.transports._prefault import Prefault
from rallypoint.transports._header import (  # noqa: F401 - re-exported: wire is the public face
    _PREFIX,
    _SCALARS,
    DEFAULT_BLOCK,
    DEFAULT_MAX_HEADER_BYTES,
    MIN_NETWORK_BLOCK,
    FORMAT,
    MAGIC,
    MAX_DEPTH,
    PREFIX_BYTES,
    SUM,
    SUM_BYTES,
    VERSION,
    Header,
    ReadInto,
    TensorSpec,
    WireError,
    key_str,
    parse_header,
    read_exact,
    read_header,
)

logger = logging.getLogger("rallypoint.transports.wire")

#: Tensors (or remainders) smaller than this are batched: sent as one coalesced piece,
#: and read through a scratch buffer of SCRATCH_BYTES instead of one read each.
from rallypoint.transports._range_writer import COALESCE_BELOW, SCRATCH_BYTES  # noqa: E402





# --------------------------------------------------------------------------- encoding

from rallypoint.transports._encode import Encoded, encode  # noqa: E402  (public via wire)


# --------------------------------------------------------------------------- receiving


class _Defer:
    def __repr__(self) -> str:
        return "DEFER"


#: ``mesh=DEFER``: DTensors without a mesh in ``into=`` arrive as :class:`SentDTensor`.
DEFER: Any = _Defer()


class SentDTensor:
    """A received DTensor not yet placed on a mesh: the sender's local shard (``local``, a
    CPU tensor), its layout (``meta``: placements, mesh shape, global shape and stride as
    :func:`rallypoint.transports._tensors.dtensor_meta` wrote them), its ``key`` (for
    errors) and whether it was a parameter. Why: the receiver may not be able to look at
    its own state when the bytes arrive (the quorum thread while forward runs), so where
    it goes is decided later, where it is safe to."""

    __slots__ = ("key", "local", "meta", "param")

    def __init__(self, key: str, local: torch.Tensor, meta: dict[str, Any], param: bool) -> None:
        self.key, self.local, self.meta, self.param = key, local, meta, param

    def __repr__(self) -> str:
        return f"SentDTensor({self.key}, local {tuple(self.local.shape)}, mesh {self.meta.get('mesh_shape')})"


def _lookup(tree: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path`` in a caller's state dict, or None."""
    for k in path:
        if isinstance(tree, dict):
            if k not in tree:
                return None
            tree = tree[k]
        elif isinstance(tree, (list, tuple)) and type(k) is int and 0 <= k < len(tree):
            tree = tree[k]
        else:
            return None
    return tree


class Sink:
    """Destination buffers for one received state dict; ranges are written and verified
    independently (from several threads), and :meth:`finish` builds the result.

    Validation that needs no data bytes (target matching, DTensor meshes) happens in the
    constructor, before anything is written. See the module docstring for memory/safety.
    ``prefault_order``: the order in which the writers will reach the pieces (piece
    indices, :func:`~rallypoint.transports._prefault.lane_order`), which fresh memory is
    mapped ahead in; default, the stream's.
    """

    def __init__(self, header: Header, *, into: Any = None, in_place: bool = False, mesh: Any = None,
                 device: torch.device | None = None, pool: ReceivePool | None = None, defer: bool = False,
                 prefault_order: Sequence[int] | None = None) -> None:
        self.header = header
        self._pool = pool if into is not None and not in_place else None
        self._defer = defer and not in_place
        self._landed = False
        self._lock = threading.Lock()
        self._verified = bytearray(len(header.pieces))
        self._nverified = 0
        self.target_touched = False
        self._dest: list[torch.Tensor | None] = []
        self._views: list[memoryview] = []
        self._target: list[torch.Tensor | None] = []  # local tensor to copy into at finish
        self._target_leaf: list[Any] = []  # what the result holds when a target is used
        self._direct: list[bool] = []
        self._meshes: list[Any] = []
        self._piece_starts = [p[0] for p in header.pieces]
        if device is not None and device.type == "cpu":
            device = None
        fresh: set[int] = set()  # tensors received into new CPU memory: mapped ahead (_prefault)
        cpu = torch.device("cpu")
        for spec in header.tensors:
            if spec.device and device is None:
                raise WireError(f"{spec.key}: sent from device memory; only a receiver on a device "
                                "(PGTransport with device=cuda) takes it", key=spec.key)
            tgt: Any = _lookup(into, spec.path) if into is not None else None
            leaf = tgt
            if spec.dtensor is not None:
                self._meshes.append(self._mesh_for(spec, tgt, mesh))
                tgt = tgt.to_local() if T.is_dtensor(tgt) else None
            else:
                self._meshes.append(None)
                if T.is_dtensor(tgt):
                    tgt = None
            ok = (
                tgt is not None
                and isinstance(tgt, torch.Tensor)
                and tgt.dtype == spec.dtype
                and tgt.shape == spec.shape
            )
            where = device if spec.device else cpu
            direct = ok and in_place and tgt.device == where and tgt.is_contiguous() and not tgt.is_conj()
            if into is not None and not ok:
                logger.debug("%s: no matching tensor in the target; receiving into a new one", spec.key)
            kept = self._pool.take(spec.dtype, spec.shape) if self._pool is not None and ok and not spec.device \
                else None
            if direct:
                dest = tgt.detach()
            elif spec.device:
                dest = torch.empty(spec.shape, dtype=spec.dtype, device=where)
            elif kept is not None:
                dest = kept  # a buffer of the last receive: mapped already
            else:
                dest = torch.empty(spec.shape, dtype=spec.dtype)
                T.advise_huge_pages(dest)
                fresh.add(spec.index)
            self._dest.append(dest)
            self._views.append(memoryview(b"") if spec.device else T.byte_view(dest))
            self._target.append(tgt.detach() if ok else None)
            self._target_leaf.append(leaf if ok else None)
            self._direct.append(direct)
        ptrs = {ti: self._dest[ti].data_ptr() for ti in fresh}  # type: ignore[union-attr]
        self.prefault = Prefault([(ptrs[ti] + st, ln) if ti in ptrs else None for _, ln, ti, st, _ in header.pieces],
                                 order=prefault_order)

    @staticmethod
    def _mesh_for(spec: TensorSpec, tgt: Any, mesh: Any) -> Any:
        meta = spec.dtensor or {}
        m = tgt.device_mesh if T.is_dtensor(tgt) else mesh
        if m is DEFER:
            try:
                T.placements_from_json(meta.get("placements"))
            except ValueError as exc:
                raise WireError(f"{spec.key}: {exc}", key=spec.key) from None
            return DEFER
        if m is None:
            raise WireError(
                f"{spec.key}: is a DTensor; pass into= (a state dict holding a DTensor there) or mesh=",
                key=spec.key,
            )
        try:
            T.placements_from_json(meta.get("placements"))
        except ValueError as exc:
            raise WireError(f"{spec.key}: {exc}", key=spec.key) from None
        if list(m.shape) != meta.get("mesh_shape"):
            raise WireError(
                f"{spec.key}: sent from a mesh of shape {meta.get('mesh_shape')}, the receiver's is "
                f"{list(m.shape)}; resharding is not supported",
                key=spec.key,
            )
        return m

    def writer(self, start: int, end: int, sum_kind: SumKind = CRC32) -> RangeWriter:
        """A writer for data bytes ``[start, end)``; ``sum_kind``: the kind of the inline
        sums that follow its pieces (what the source said it sent)."""
        return RangeWriter(self, start, end, sum_kind)

    def close(self) -> None:
        """Stop mapping pages ahead (:mod:`._prefault`): the receive ended or failed."""
        self.prefault.stop()

    # Whole-tensor receive (PGTransport): the destination of tensor ``ti``, whether it
    # is the caller's own target, and verification after its bytes were written.
    def destination(self, ti: int) -> torch.Tensor:
        """Tensor ``ti``'s destination, its fresh pages mapped (by now or by the thread)."""
        dest = self._dest[ti]
        assert dest is not None, f"tensor {ti} has no destination"
        spec = self.header.tensors[ti]
        if spec.nbytes:
            pi = bisect.bisect_left(self._piece_starts, spec.offset)
            while pi < len(self._piece_starts) and self.header.pieces[pi][2] == ti:
                self.prefault.claim(pi)
                pi += 1
        return dest

    def writes_into_target(self, ti: int) -> bool:
        return self._direct[ti]

    def verify_tensor(self, ti: int, pieces: list[int]) -> None:
        """Check ``pieces`` of tensor ``ti`` after it was filled. Views are taken afresh:
        a process group may have moved the storage meanwhile (BabyGloo shares in place).
        A tensor sent from device memory has no checksums (the process group moved it
        device to device): its pieces count as verified once it arrived."""
        if self.header.tensors[ti].device:
            with self._lock:
                for pi in pieces:
                    if not self._verified[pi]:
                        self._verified[pi] = 1
                        self._nverified += 1
            return
        dest = self._dest[ti]
        assert dest is not None, f"tensor {ti} has no destination"
        self._views[ti] = T.byte_view(dest)  # (not destination(): its pages are in, nothing to claim)
        for pi in pieces:
            self._verify(pi)

    def _verify(self, pi: int, crc: int | None = None, got: int | None = None) -> None:
        """Check piece ``pi`` against ``crc`` (inline) or the header's checksum; ``got``:
        the piece's CRC-32 already computed as its bytes arrived (else computed here)."""
        ds, ln, ti, st, hcrc = self.header.pieces[pi]
        if self.header.tensors[ti].device:
            raise WireError(f"{self.header.tensors[ti].key}: sent from device memory, not as a byte stream",
                            key=self.header.tensors[ti].key)
        crc = hcrc if crc is None else crc
        if got is None:
            got = crc32(self._views[ti][st : st + ln])
        if got != crc:
            spec = self.header.tensors[ti]
            raise WireError(
                f"{spec.key}: checksum mismatch in bytes [{st}, {st + ln}) of {spec.nbytes}: the stream is corrupt",
                key=spec.key,
                target_modified=self.target_touched,
            )
        with self._lock:
            if not self._verified[pi]:
                self._verified[pi] = 1
                self._nverified += 1

    @property
    def complete(self) -> bool:
        return self._nverified == len(self.header.pieces)

    def finish(self) -> Any:
        """Check every piece arrived and verified, then land in the targets (swap or copy)
        and build the tree; with ``defer=True`` a :class:`Landing` that does the rest later."""
        self.prefault.stop()
        if not self.complete:
            first = self.header.tensors[self.header.pieces[self._verified.index(0)][2]]
            raise WireError(
                f"{first.key}: stream incomplete, {len(self.header.pieces) - self._nverified} checksum blocks missing",
                key=first.key,
                target_modified=self.target_touched,
            )
        if self._defer:
            return Landing(self)
        return self.land()

    @property
    def landed(self) -> bool:
        """Whether :meth:`land` ran (a deferred state lands once)."""
        return self._landed

    def land(self) -> Any:
        """The verified state into the targets (swapped or copied) and the result tree; once."""
        if self._landed:
            raise WireError("this received state was landed already")
        self._landed = True
        leaves: list[Any] = []
        changed: list[torch.Tensor] = []  # targets written or swapped: autograd hears of them in one call
        with torch.no_grad():
            try:
                pooled = self._land_each(leaves, changed)
            finally:
                if changed:
                    torch.autograd.graph.increment_version(changed)
        if self._pool is not None:
            self._pool.trim(pooled)
        return _build(self.header.tree, leaves)

    def _land_each(self, leaves: list[Any], changed: list[torch.Tensor]) -> int:
        """:meth:`land`'s walk over the tensors: each leaf of the result into ``leaves``,
        each target whose bytes changed into ``changed``; the bytes given to the pool."""
        pool, pooled = self._pool, 0
        for spec in self.header.tensors:
            i = spec.index
            dest, tgt = self._dest[i], self._target[i]
            assert dest is not None  # dropped only after this point
            if tgt is not None:
                if self._direct[i]:
                    changed.append(tgt)
                elif pool is not None and can_swap(tgt, dest):
                    swap_into(tgt, dest, bump=False)  # no copy: dest now holds the old bytes (_pool.py)
                    changed.append(tgt)
                else:
                    tgt.copy_(dest)
                if pool is not None and not self._direct[i] and dest.device.type == "cpu":
                    pool.give(dest)  # the next receive's buffer
                    pooled += spec.nbytes
                self._dest[i] = None  # drop the staging tensor right away
                leaves.append(self._target_leaf[i])
                continue
            leaf: Any
            if spec.dtensor is not None and self._meshes[i] is DEFER:
                leaves.append(SentDTensor(spec.key, dest, dict(spec.dtensor), bool(spec.param)))
                continue
            if spec.dtensor is not None:
                from torch.distributed.tensor import DTensor

                meta = spec.dtensor
                leaf = DTensor.from_local(
                    dest,
                    self._meshes[i],
                    T.placements_from_json(meta["placements"]),
                    run_check=False,
                    shape=torch.Size(meta["shape"]),
                    stride=tuple(meta["stride"]),
                )
            else:
                leaf = dest
            if spec.param:
                leaf = torch.nn.Parameter(leaf, requires_grad=True)
            leaves.append(leaf)
        return pooled


class Landing:
    """A received, verified state not yet in its targets (``Sink(defer=True)``): receiving
    and verifying run on one thread (the Manager's quorum thread, while the training thread
    computes), :meth:`land` on the thread that owns the targets. Dropped without landing,
    it leaves the targets as they were and its buffers to the garbage collector."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.nbytes = sink.header.data_bytes

    def land(self) -> Any:
        """Swap (or copy) every received tensor into its target and return the state, as
        an undeferred receive would have; the old bytes go to the receive pool."""
        return self._sink.land()

    def __repr__(self) -> str:
        return f"Landing({len(self._sink.header.tensors)} tensors, {self.nbytes} bytes, landed={self._sink.landed})"


def _build(node: dict[str, Any], leaves: list[Any]) -> Any:
    if "t" in node:
        return leaves[node["t"]]
    if "v" in node:
        return node["v"]
    if "d" in node:
        d: dict[Any, Any] = OrderedDict() if node.get("o") else {}
        for k, v in node["d"]:
            d[k] = _build(v, leaves)
        if "m" in node:
            d._metadata = _build(node["m"], leaves)  # type: ignore[attr-defined]
        return d
    if "l" in node:
        return [_build(v, leaves) for v in node["l"]]
    if "u" in node:
        return tuple(_build(v, leaves) for v in node["u"])
    return torch.Size(node["s"])


from rallypoint.transports._range_writer import RangeWriter  # noqa: E402  (public via wire)


def _readinto_of(src: Any) -> ReadInto:
    if callable(getattr(src, "readinto", None)):
        return src.readinto
    if callable(src):
        return src
    raise TypeError("decode_from needs a readinto(memoryview) -> int callable or a file-like with readinto")


def decode_from(
    src: Any,
    *,
    into: Any = None,
    in_place: bool = False,
    mesh: Any = None,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    expect_eof: bool = True,
) -> Any:
    """Decode one stream from ``src`` (a file-like with ``readinto`` or a ``readinto``
    callable). With ``expect_eof`` the stream must end right after the data."""
    readinto = _readinto_of(src)
    header = read_header(readinto, max_header_bytes)
    sink = Sink(header, into=into, in_place=in_place, mesh=mesh)
    try:
        w = sink.writer(0, header.data_bytes)
        w.pull(readinto)
        w.close()
        if expect_eof and readinto(memoryview(bytearray(1))):
            raise WireError("trailing bytes after the data region", target_modified=sink.target_touched)
        return sink.finish()
    finally:
        sink.close()


def decode(buf: bytes | bytearray | memoryview, **kw: Any) -> Any:
    """Decode a complete stream held in memory (see :func:`decode_from`)."""
    return decode_from(io.BytesIO(buf), **kw)


def to_bytes(state_dict: Any, **kw: Any) -> bytes:
    """The whole stream as one ``bytes`` (tests and small payloads; copies)."""
    enc = encode(state_dict, **kw)
    return b"".join(bytes(v) for v in enc.iter_stream())
