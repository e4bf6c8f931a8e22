"""Low-level tensor helpers for the wire format: dtype names, raw byte views, DTensor metadata.

Kept apart from :mod:`rallypoint.transports.wire` so the format logic reads as format
logic. Nothing here parses untrusted input beyond looking names up in fixed tables.

Why ctypes: numpy is not a dependency, and ``memoryview`` cannot be taken of a tensor
directly. A ``ctypes`` array placed at ``tensor.data_ptr()`` gives a writable, zero-copy
``memoryview`` of exactly the bytes a contiguous CPU tensor views (``data_ptr`` already
includes the storage offset, so a slice of a big storage yields only the slice). The view
does not keep the tensor alive: every caller keeps the tensor referenced for as long as it
uses the view.
"""

from __future__ import annotations

import ctypes
import math
import sys
from typing import Any

import torch

#: Every dtype the wire format carries, by its stable name. A fixed table (not
#: ``getattr(torch, name)``) so a header can name nothing but these.
_DTYPE_NAMES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` (format ``B``) of the bytes of a contiguous CPU tensor.

    ``PyMemoryView_FromMemory`` (CPython's C API, through ctypes) rather than a ctypes
    array type per tensor: building a ctypes type costs ~40 us, which for 4,000 tiny
    tensors was most of a receive. The caller must keep ``t`` alive while the view is used.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return _from_memory(t.data_ptr(), n, _PYBUF_WRITE)


_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover - libc without madvise
    _madvise = None
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back a fresh receive buffer with transparent huge pages.

    Writing into newly allocated memory is dominated by page faults: one per 4 KiB, which
    measured ~3x slower than the copy itself here (128 MB: 0.125 s vs 0.042 s with this
    advice). Only the 2 MiB-aligned interior is advised; a no-op where THP is off, for
    small tensors, and off Linux. Best effort: a failure changes nothing but speed.
    """
    _advise_interior(t, _HUGE, _MADV_HUGEPAGE)


def _advise_interior(t: torch.Tensor, unit: int, advice: int) -> None:
    """``madvise(advice)`` over the ``unit``-aligned interior of a CPU tensor's bytes
    (tensors under two units, non-CPU tensors, and platforms without madvise: nothing)."""
    n = t.numel() * t.element_size()
    if _madvise is None or n < 2 * unit or t.device.type != "cpu":
        return
    start = (t.data_ptr() + unit - 1) & ~(unit - 1)
    end = (t.data_ptr() + n) & ~(unit - 1)
    if end > start:
        _madvise(start, end - start, advice)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate_range(addr: int, nbytes: int) -> None:
    """Map the whole pages inside bytes ``[addr, addr + nbytes)`` of fresh receive memory
    now, in one system call, before bytes arrive (a piece of a tensor: the pages it
    shares with its neighbours fault in as they are written).

    Why: a page first touched inside ``recv_into`` (the kernel copying socket data into
    it) or a process group's receive faults in the kernel's copy, which measured several
    times slower here than mapping the same pages up front: a fresh 1 GB receive took
    1.6 s cold and 0.54 s with the pages mapped first; already-mapped memory costs
    ~0.05 s per GB to check. :mod:`._prefault` does it on a thread ahead of the bytes.
    Best effort: a no-op off Linux and on kernels without ``MADV_POPULATE_WRITE``.
    """
    if _madvise is None:
        return
    start = (addr + _PAGE - 1) & ~(_PAGE - 1)
    end = (addr + nbytes) & ~(_PAGE - 1)
    if end > start:
        _madvise(start, end - start, _MADV_POPULATE_WRITE)


_PAGE = 4096


def sendable(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same values as ``t``, without autograd.

    Copies only when needed: a non-contiguous view is made contiguous (so only the viewed
    elements travel), a conjugate/negative view is resolved, a device tensor is copied to
    host memory. A contiguous CPU slice of a larger storage is returned as is.
    """
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def numel_of(shape: list[int] | tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


# --------------------------------------------------------------------------- DTensor


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` when this torch build has it, else None."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor, without importing torch.distributed.tensor (slow, ~1 s)
    when nothing imported it yet: then no DTensor can exist."""
    if x is None or type(x) in (torch.Tensor, torch.nn.Parameter) or not isinstance(x, torch.Tensor):
        return False  # the common cases, without the module lookup below (~50 us)
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(x, cls)


def placements_to_json(placements: Any) -> list[list[Any]]:
    """Placements as plain lists: ``["shard", dim]``, ``["replicate"]``, ``["partial", op]``,
    ``["strided_shard", dim, split_factor]``. Anything else is refused by the caller."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[list[Any]] = []
    for p in placements:
        name = type(p).__name__
        if name == "_StridedShard":
            out.append(["strided_shard", int(p.dim), int(p.split_factor)])
        elif isinstance(p, Shard):
            out.append(["shard", int(p.dim)])
        elif isinstance(p, Replicate):
            out.append(["replicate"])
        elif isinstance(p, Partial):
            out.append(["partial", str(p.reduce_op)])
        else:
            raise TypeError(f"unsupported DTensor placement {p!r}")
    return out


def placements_from_json(items: Any) -> list[Any]:
    """Inverse of :func:`placements_to_json`; raises ValueError on anything unexpected."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not isinstance(items, list):
        raise ValueError("placements must be a list")
    out: list[Any] = []
    for it in items:
        if not isinstance(it, list) or not it or not isinstance(it[0], str):
            raise ValueError(f"bad placement {it!r}")
        kind, args = it[0], it[1:]
        if kind == "shard" and len(args) == 1 and type(args[0]) is int:
            out.append(Shard(args[0]))
        elif kind == "replicate" and not args:
            out.append(Replicate())
        elif kind == "partial" and len(args) == 1 and args[0] in ("sum", "avg", "max", "min", "product"):
            out.append(Partial(args[0]))
        elif kind == "strided_shard" and len(args) == 2 and all(type(a) is int for a in args):
            from torch.distributed.tensor.placement_types import _StridedShard

            out.append(_StridedShard(args[0], split_factor=args[1]))
        else:
            raise ValueError(f"bad placement {it!r}")
    return out


def dtensor_meta(d: Any) -> dict[str, Any]:
    """What the receiver needs, besides the local shard, to rebuild a DTensor."""
    mesh = d.device_mesh
    return {
        "placements": placements_to_json(d.placements),
        "mesh_shape": [int(s) for s in mesh.shape],
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "shape": [int(s) for s in d.shape],
        "stride": [int(s) for s in d.stride()],
    }
