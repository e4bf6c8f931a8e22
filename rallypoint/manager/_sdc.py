"""Silent-data-corruption checks, the tensor side: gradient norms, parameter hashes, and the
one small collective that tells every replica group every group's numbers.

The decisions live in :mod:`rallypoint.manager.guards` (pure functions); this module only
computes and moves numbers, on CPU and CUDA alike, with torch alone.

- :func:`grad_norm`: the L2 norm of a group's local gradients (one float per group per step).
- :func:`param_hash`: a 64-bit hash of the exact bytes of the parameters.
- :func:`exchange` / :func:`start_exchange`: every replica learns every replica's values with
  ONE allreduce of a ``world x len(values)`` tensor (own row filled, the others zero, SUM):
  each cell is one rank's value plus zeros, so the result is exact (NaN/Inf stay in their row)
  and needs no allgather, which not every reconfigurable process group offers.

Costs (``bench/sdc_cost.py``: the 1.3 M-parameter MLP, one CPU thread, two replica groups
on gloo loopback, where a data-parallel step takes ~11 ms): the norm ~0.12 ms per step, the
hash ~0.8 ms per check; a separate exchange collective ~0.4 ms alone and ~1 ms next to the
gradients' allreduce on a 2-core box, nothing extra when its rows ride in that allreduce
(:func:`exchange_buffer`).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
from torch.distributed import ReduceOp

__all__ = [
    "BLOCK_WORDS",
    "PendingExchange",
    "SdcExchangeError",
    "exchange",
    "exchange_buffer",
    "exchange_ints",
    "grad_norm",
    "grad_norm_tensor",
    "halves_to_u64",
    "i64_to_u64",
    "param_hash",
    "param_hash_tensor",
    "start_exchange",
    "start_exchange_ints",
    "u64_to_halves",
    "u64_to_i64",
]

_M64 = (1 << 64) - 1


def u64_to_i64(h: int) -> int:
    """An unsigned 64-bit value as the signed int64 with the same bits (for int64 tensors)."""
    if not 0 <= h <= _M64:
        raise ValueError(f"not an unsigned 64-bit value: {h!r}")
    return h - (1 << 64) if h >= 1 << 63 else h


def i64_to_u64(v: int) -> int:
    """The unsigned 64-bit value with the bits of the signed int64 ``v``."""
    return int(v) & _M64


def u64_to_halves(h: int) -> tuple[float, float]:
    """A 64-bit hash as two floats, its high and low 32 bits: each is exact in a float64
    (53-bit mantissa), the whole hash is not, so this is how a hash rides in a float64
    exchange next to the gradient norm."""
    if not 0 <= h <= _M64:
        raise ValueError(f"not an unsigned 64-bit value: {h!r}")
    return float(h >> 32), float(h & 0xFFFFFFFF)


def halves_to_u64(hi: float, lo: float) -> int:
    """The inverse of :func:`u64_to_halves`; refuses halves that are not exact 32-bit
    integers (a row that did not come from :func:`u64_to_halves`)."""
    out = 0
    for half in (hi, lo):
        if not (math.isfinite(half) and half == int(half) and 0 <= half <= 0xFFFFFFFF):
            raise ValueError(f"not a 32-bit half of a hash: {half!r}")
        out = (out << 32) | int(half)
    return out


# ---------------------------------------------------------------------------- gradient norm
def _dense(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout != torch.strided:
        raise ValueError(f"grad_norm: unsupported tensor layout {t.layout}")
    return t


def grad_norm_tensor(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """The L2 norm of ``tensors`` (``None`` entries skipped, as ``p.grad`` may be) as a 0-d
    float64 tensor on the first tensor's device, without a host sync.

    One fused ``torch._foreach_norm`` per (device, dtype) (a multi-tensor kernel on CUDA),
    then the per-tensor norms combined in float64. Half-precision gradients are normed in
    float32 (a float16 sum of squares overflows at a norm of 256). NaN and Inf propagate. A
    float32 sum of squares overflows at a norm of ~1.8e19: such a norm comes back as Inf;
    :func:`grad_norm` tells that apart from a real Inf."""
    ts = [_dense(t) for t in tensors if t is not None]
    if not ts:
        return torch.zeros((), dtype=torch.float64)
    if len(ts) == 1 and ts[0].device.type == "cpu" and ts[0].dtype in (torch.float32, torch.float64) \
            and ts[0].is_contiguous():
        flat = ts[0].view(-1)  # one flat CPU buffer (a gradient bucket): a BLAS dot, ~20% faster
        return torch.dot(flat, flat).sqrt().to(torch.float64)
    out_device = ts[0].device
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in ts:
        groups.setdefault((t.device, t.dtype), []).append(t)
    parts: list[torch.Tensor] = []
    for (_, dtype), group in groups.items():
        if dtype.is_floating_point and dtype.itemsize < 4:
            norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        else:
            norms = torch._foreach_norm(group, 2)
        parts.append(torch.stack(list(norms)).to(device=out_device, dtype=torch.float64))
    return torch.linalg.vector_norm(torch.cat(parts))


def grad_norm(tensors: Iterable[torch.Tensor | None]) -> float:
    """The L2 norm of a group's local gradients, as a Python float (one 8-byte host copy).

    NaN when any element is NaN, Inf when any is Inf (and none is NaN), else finite: when the
    fast float32 path overflows (a flipped exponent bit can make one element ~1e38), the
    tensors are normed again in float64, so a huge finite norm is reported as such rather
    than as Inf (the guard's reason then says "outlier", not "inf"). The slow path runs only
    on such an anomaly."""
    ts = [_dense(t) for t in tensors if t is not None]
    value = float(grad_norm_tensor(ts).item())
    if math.isfinite(value):
        return value
    total = 0.0
    for t in ts:
        n = float(torch.linalg.vector_norm(t, dtype=torch.complex128 if t.is_complex() else torch.float64).item())
        if math.isnan(n):
            return math.nan
        total += n * n
    return math.sqrt(total)


# ------------------------------------------------------------------------------ param hash
BLOCK_WORDS = 1 << 16
"""Words (8 bytes) per block of the parameter hash; part of the hash's definition."""

_SEED = 0x5250_5344_4331_0001  # "RPSDC1" + version 1: changing the algorithm changes this
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_P = 0xD6E8FEB86659FD93  # odd: multiplying by it is a bijection mod 2**64
_MAX_BLOCKS = {"cpu": 64, "cuda": 256}  # blocks per kernel: a 32 / 128 MiB temporary
_tables_lock = threading.Lock()


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic; no uint64 shift on CPU)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


@functools.lru_cache(maxsize=8)
def _tables_cached(device: torch.device, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    # weights W[j] = splitmix64(SEED + (j + 1) * GOLDEN) | 1: pseudo-random and odd,
    # computed with int64 tensor ops (wrapping), identical on every machine and torch version
    j = torch.arange(1, BLOCK_WORDS + 1, dtype=torch.int64)
    z = j * u64_to_i64(_GOLDEN) + u64_to_i64(_SEED)
    z = (z ^ _shr(z, 30)) * u64_to_i64(_MIX1)
    z = (z ^ _shr(z, 27)) * u64_to_i64(_MIX2)
    z = z ^ _shr(z, 31)
    weights = z | 1
    # POW[i] = P**i mod 2**64, as int64
    powers = torch.tensor([u64_to_i64(pow(_P, i, 1 << 64)) for i in range(max_blocks)], dtype=torch.int64)
    return weights.to(device), powers.to(device)


def _block_sums(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j fold(word[j]) * W[j]`` over the last dimension (int64, wrapping), where
    ``fold(x) = x ^ (x >>> 32)``: the high half folded onto the low half, so that a change in
    any bit reaches the low 32 bits (a plain multiply only carries upward: without the fold,
    bit 63 of any two words would cancel, 2**63 + 2**63 == 0 mod 2**64). Four in-place passes
    and a reduction over one temporary."""
    y = words >> 32
    y &= 0xFFFFFFFF
    y ^= words
    y *= weights
    return y.sum(dim=-1)


def _tables(device: torch.device, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    with _tables_lock:  # the manager may hash from more than one thread
        return _tables_cached(device, max_blocks)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The tensor's bytes (C order) as int64 words, the zero-padded tail word (if the byte
    count is not a multiple of 8) and the byte count. No copy for a contiguous, 8-byte
    aligned tensor; otherwise one on-device copy."""
    if t.layout != torch.strided:
        raise ValueError(f"param_hash: unsupported tensor layout {t.layout} (hash the dense values)")
    t = t.detach().resolve_conj().resolve_neg()
    b = t.reshape(-1).view(torch.uint8)  # reshape copies a non-contiguous tensor, on its device
    nbytes = b.numel()
    nwords = nbytes // 8
    head = b[: nwords * 8]
    try:
        words = head.view(torch.int64)
    except RuntimeError:  # not 8-byte aligned (a view into a flat buffer at an odd offset)
        words = head.clone().view(torch.int64)
    tail: torch.Tensor | None = None
    if nbytes % 8:
        pad = torch.zeros(8, dtype=torch.uint8, device=b.device)
        pad[: nbytes % 8] = b[nwords * 8 :]
        tail = pad.view(torch.int64)
    return words, tail, nbytes


def param_hash_tensor(tensors: Iterable[torch.Tensor], *, max_blocks: int | None = None) -> torch.Tensor:
    """The 64-bit parameter hash as a 0-d int64 tensor on the first tensor's device (no host
    sync; see :func:`param_hash` for the definition). ``max_blocks`` (blocks per kernel)
    changes speed and memory, never the value."""
    acc: torch.Tensor | None = None
    for t in tensors:
        if acc is None:
            acc = torch.zeros((), dtype=torch.int64, device=t.device)
        words, tail, nbytes = _words(t)
        mb = max_blocks or _MAX_BLOCKS.get(t.device.type, 64)
        weights, powers = _tables(t.device, mb)
        acc = acc * u64_to_i64(_P) + nbytes
        nfull = words.numel() // BLOCK_WORDS
        start = 0
        while start < nfull:
            k = min(mb, nfull - start)
            blocks = words[start * BLOCK_WORDS : (start + k) * BLOCK_WORDS].view(k, BLOCK_WORDS)
            sums = _block_sums(blocks, weights)  # wrapping int64: exact, order-independent
            combined = (sums * powers[:k].flip(0)).sum()
            acc = acc * u64_to_i64(pow(_P, k, 1 << 64)) + combined.to(acc.device)
            start += k
        rest = words[nfull * BLOCK_WORDS :]
        if tail is not None:
            rest = torch.cat([rest, tail])
        if rest.numel():
            s = _block_sums(rest, weights[: rest.numel()])
            acc = acc * u64_to_i64(_P) + s.to(acc.device)
    if acc is None:
        return torch.zeros((), dtype=torch.int64)
    return acc


def param_hash(tensors: Iterable[torch.Tensor]) -> int:
    """A 64-bit hash (``0 <= h < 2**64``) of the exact bytes of ``tensors``, in order.

    Definition (the reference implementation in ``tests/test_guards.py`` follows it word for
    word): ``acc = 0``; per tensor, ``acc = acc*P + nbytes``; its bytes (C order, native byte
    order, zero-padded to a multiple of 8) are read as int64 words and cut into blocks of
    ``BLOCK_WORDS``; per block, ``acc = acc*P + sum_j fold(word[j]) * W[j]`` with
    ``fold(x) = x ^ (x >>> 32)``; all arithmetic mod 2**64; ``W[j]`` are fixed pseudo-random
    odd numbers (splitmix64), ``P`` a fixed odd constant.

    Why this and not CRC-32 (``isal``, a dependency) or xxHash (not one): the hash must run on
    the device that holds the parameters, without copying them to the host; this is four
    in-place elementwise kernels and a reduction per batch of blocks, on CPU and CUDA alike, and the host sees
    only the final 8 bytes. Integer multiply-add wraps exactly, and wrapping addition is
    associative, so the value does not depend on the reduction order, the device, the
    kernel split or the process: replicas compare it directly. Measured
    (``bench/sdc_cost.py``, one CPU thread, 5 MB of parameters): ~0.8 ms (~6 GB/s), against
    0.09 ms for ISA-L's CRC-32 and 0.07 ms for xxh3 on the host; it runs once every
    ``--sdc-check-every`` steps, so the difference is ~0.01% of a step at 100.

    What it detects: any change confined to one 8-byte word (in particular any single flipped
    bit) changes the hash, with certainty: ``fold`` is a bijection, so the folded word changes
    by some ``d != 0``, which is multiplied by an odd weight and by powers of the odd ``P``,
    all invertible mod 2**64. Two flipped bits in two words cancel only if their weighted
    changes do: the fold puts every flipped bit within the low 32 bits, so that takes a
    coincidence of at least 32 bits of two pseudo-random weights (~2**-32 in the worst case,
    bits 31/63; ~2**-(64-b) for bit b < 32); larger random damage collides with probability
    about 2**-64. Not a cryptographic hash (not meant to resist a forger: the replicas are
    trusted, their hardware is not).
    """
    return i64_to_u64(int(param_hash_tensor(tensors).item()))


# -------------------------------------------------------------------------------- exchange
class SdcExchangeError(RuntimeError):
    """The exchange's collective failed or timed out: the step must fail (its numbers were
    not seen by everyone); the process group is rebuilt at the next quorum."""


N = TypeVar("N", int, float)


class PendingExchange(Generic[N]):
    """An exchange in flight: :meth:`wait` returns every replica's row once the allreduce
    completes (row ``r`` = replica rank ``r``'s values)."""

    def __init__(self, work: Any, buf: torch.Tensor, replica_rank: int, world: int) -> None:
        self._work = work
        self._buf = buf
        self._replica_rank = replica_rank
        self._world = world

    def finished(self) -> bool:
        """Whether the collective has ended (FailFast asks, to decide whether a peer's death
        can still block it)."""
        return bool(self._work.is_completed())

    def wait(self, timeout: timedelta | float) -> list[list[N]]:
        """Block until every replica's row is here, at most ``timeout`` (seconds or a
        timedelta). Raises :class:`SdcExchangeError` on a failure or a timeout."""
        td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        where = f"replica rank {self._replica_rank} of {self._world}"
        try:
            done = self._work.wait(td)
        except Exception as e:
            raise SdcExchangeError(
                f"SDC check exchange failed at {where} (timeout {td.total_seconds():g} s): {e}; "
                "the step must fail"
            ) from e
        if done is False:
            raise SdcExchangeError(
                f"SDC check exchange at {where} did not complete within {td.total_seconds():g} s; "
                "the step must fail"
            )
        rows: list[list[N]] = self._buf.cpu().tolist()
        return rows


def exchange_buffer(
    replica_rank: int,
    world: int,
    values: Sequence[float] | Sequence[int],
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exchange's ``world x len(values)`` tensor: own row filled, the others zero. After a
    SUM allreduce over the replicas, ``buf.tolist()`` is every replica's row, exactly.

    ``out``: write the rows into this ``world x len(values)`` tensor (its dtype and device;
    ``dtype`` and ``device`` are then ignored) instead of a new one, e.g. the slots at the
    end of a staging tensor the rows ride in (:mod:`._ride`); returns it.

    Public so that the rows can ride in a collective the step makes anyway: appended to the
    gradients of a coalesced allreduce with op SUM (the gradients are divided afterwards, as
    the Manager does), the check adds no round trip at all (``bench/sdc_cost.py`` measures the
    three ways). Not with AVG: dividing the rows by the world size is not exact. ``dtype``
    may then be the gradients' (gloo coalesces one dtype only): a float32 row holds a norm
    to float32 precision (plenty for a 10x ratio; NaN/Inf stay NaN/Inf; above ~3.4e38 a norm
    reads as Inf) but not a hash, which needs float64 halves (:func:`u64_to_halves`) or int64."""
    if not 0 <= replica_rank < world:
        raise ValueError(f"replica_rank {replica_rank} is not in [0, {world})")
    if not values:
        raise ValueError("nothing to exchange")
    if out is None:
        buf = torch.zeros(world, len(values), dtype=dtype, device=device)
    elif tuple(out.shape) != (world, len(values)):
        raise ValueError(f"out has shape {tuple(out.shape)}, the rows need ({world}, {len(values)})")
    else:
        buf = out.zero_()
    buf[replica_rank] = torch.tensor(list(values), dtype=buf.dtype, device=buf.device)
    return buf


def start_exchange(
    pg: Any, replica_rank: int, world: int, values: Sequence[float], *, device: torch.device | str | None = None
) -> PendingExchange[float]:
    """Start the exchange of ``values`` (floats, e.g. ``[grad_norm]`` or ``[norm, *u64_to_halves(h)]``)
    among ``world`` replicas: one SUM allreduce of a float64 ``world x len(values)`` tensor.

    ``pg``: the raw cross-replica process group (a ``torch.distributed.ProcessGroup`` or
    rallypoint's reconfigurable one; anything whose ``allreduce([tensor], ReduceOp.SUM)``
    returns a work with ``wait(timeout)``), NOT a managed/averaging wrapper. ``device``: where
    the tensor lives (``None``: CPU, for gloo; ``"cuda"`` for NCCL). Every replica must call
    it with the same ``world`` and ``len(values)``."""
    buf = exchange_buffer(replica_rank, world, values, dtype=torch.float64, device=device)
    return PendingExchange(pg.allreduce([buf], ReduceOp.SUM), buf, replica_rank, world)


def start_exchange_ints(
    pg: Any, replica_rank: int, world: int, values: Sequence[int], *, device: torch.device | str | None = None
) -> PendingExchange[int]:
    """:func:`start_exchange` for int64 values (e.g. ``[u64_to_i64(param_hash(...))]``): SUM
    over zeros is exact for any int64."""
    buf = exchange_buffer(replica_rank, world, values, dtype=torch.int64, device=device)
    return PendingExchange(pg.allreduce([buf], ReduceOp.SUM), buf, replica_rank, world)


def exchange(
    pg: Any,
    replica_rank: int,
    world: int,
    values: Sequence[float],
    timeout: timedelta | float,
    *,
    device: torch.device | str | None = None,
) -> list[list[float]]:
    """:func:`start_exchange` and wait: every replica's row of floats."""
    return start_exchange(pg, replica_rank, world, values, device=device).wait(timeout)


def exchange_ints(
    pg: Any,
    replica_rank: int,
    world: int,
    values: Sequence[int],
    timeout: timedelta | float,
    *,
    device: torch.device | str | None = None,
) -> list[list[int]]:
    """:func:`start_exchange_ints` and wait: every replica's row of ints."""
    return start_exchange_ints(pg, replica_rank, world, values, device=device).wait(timeout)
