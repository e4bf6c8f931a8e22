"""Row-wise 8-bit quantization and the quantized allreduce.

Round trips are checked against the per-row bound the module promises (|x - deq| <=
scale/2, exact zeros, padding of the last row, bf16/fp16 inputs). The allreduce runs
on real ``ProcessGroupGloo`` groups (one thread per rank, a TCPStore on a free port)
and is compared with a full-precision gloo allreduce of the same inputs: identical
bits on every rank, error within the sum of the ranks' bounds, and an int8 payload of
the advertised size on the wire.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rallypoint.process_groups import ProcessGroupError, ProcessGroupGloo
from rallypoint.process_groups.quantization import (
    FP8_DTYPE,
    allreduce_quantized,
    dequantize_rowwise,
    payload_size,
    quantize_rowwise,
)

TOL = 1 + 1e-5  # fp32 rounding of x / s and of q * s on top of the s / 2 bound


def row_error_ok(x: torch.Tensor, row_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-element error, per-element bound, decoded) for a round trip of ``x``."""
    q, s = quantize_rowwise(x, row_size)
    deq = dequantize_rowwise(q, s, x.numel(), torch.float32)
    err = (x.reshape(-1).float() - deq).abs()
    bound = s.repeat_interleave(row_size)[: x.numel()] / 2 * TOL + 1e-30
    return err, bound, deq


def test_int8_round_trip_within_half_a_scale_per_row() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 3, 1000)  # rows of very different magnitude
    x[17] = 1e4  # an outlier coarsens only its own row
    q, s = quantize_rowwise(x, 64)
    assert q.dtype == torch.int8 and q.shape == (16, 64)  # 1000 = 15 full rows + a padded one
    assert s.dtype == torch.float32 and s.shape == (16,)
    assert int(q.abs().max()) <= 127
    assert bool((q[-1, 1000 - 15 * 64 :] == 0).all())  # padding encodes as zeros
    err, bound, _ = row_error_ok(x, 64)
    assert bool((err <= bound).all()), float((err - bound).max())
    # the outlier's row is coarse, the others are not
    assert float(s[0]) > 1e4 / 127 * 0.99 and float(s[1]) < 1.0


def test_zeros_are_exact_and_sizes_need_not_divide_rows() -> None:
    x = torch.zeros(3, 100)
    x[2, 50:] = torch.linspace(-1, 1, 50)
    for row_size in (1, 7, 64, 300, 1024):
        err, bound, deq = row_error_ok(x, row_size)
        assert deq.shape == (300,)
        assert bool((err <= bound).all())
        assert bool((deq[:250] == 0).all())  # zero rows (scale 0) decode exactly
    q, s = quantize_rowwise(torch.zeros(5), 4)
    assert s.tolist() == [0.0, 0.0] and bool((dequantize_rowwise(q, s, 5) == 0).all())
    # extreme values survive exactly: the absmax element maps to +-127
    y = torch.tensor([-3.0, 1.5, 3.0, 0.0])
    q, s = quantize_rowwise(y, 4)
    assert q.tolist()[0][0] == -127 and q.tolist()[0][2] == 127
    assert dequantize_rowwise(q, s, 4).tolist()[0] == -3.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    x = (torch.randn(777, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    err, bound, _ = row_error_ok(x, 128)  # bound relative to the exact fp32 value of x
    assert bool((err <= bound).all())
    q, s = quantize_rowwise(x, 128)
    out = dequantize_rowwise(q, s, x.numel(), dtype)
    assert out.dtype == dtype and out.shape == (777,)


def test_non_finite_rows_stay_non_finite_and_ints_are_rejected() -> None:
    x = torch.ones(8)
    x[1] = float("nan")
    q, s = quantize_rowwise(x, 4)
    deq = dequantize_rowwise(q, s, 8)
    assert not bool(torch.isfinite(deq[:4]).all())  # not laundered into numbers
    assert deq[4:].tolist() == [1.0] * 4
    with pytest.raises(TypeError):
        quantize_rowwise(torch.arange(4), 4)


@pytest.mark.skipif(FP8_DTYPE is None, reason="this torch build has no float8_e4m3fn")
def test_fp8_round_trip_relative_error() -> None:
    x = torch.randn(600, generator=torch.Generator().manual_seed(2))
    q, s = quantize_rowwise(x, 100, qdtype=FP8_DTYPE)
    assert q.dtype == FP8_DTYPE and q.element_size() == 1
    deq = dequantize_rowwise(q, s, 600)
    scale = s.repeat_interleave(100)
    # e4m3: 3 mantissa bits (relative 2^-4), subnormal step 2^-9 (absolute, in scale units)
    bound = (x.abs() * 2.0**-4 + scale * 2.0**-10) * TOL
    assert bool(((x - deq).abs() <= bound).all())


# ---------------------------------------------------------------------- on real groups


@pytest.fixture
def groups() -> Iterator[Callable[..., list[ProcessGroupGloo]]]:
    """Factory: ``n`` ProcessGroupGloo configured as one quorum (one thread each)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    made: list[ProcessGroupGloo] = []
    counter = iter(range(1, 1000))

    def make(n: int, timeout_s: float = 20.0) -> list[ProcessGroupGloo]:
        pgs = [ProcessGroupGloo(timeout=datetime.timedelta(seconds=timeout_s)) for _ in range(n)]
        made.extend(pgs)
        addr = f"127.0.0.1:{store.port}/quant{next(counter)}"
        on_all(pgs, lambda r, pg: pg.configure(addr, f"replica_{r}", r, n, quorum_id=1))
        return pgs

    yield make
    for pg in made:
        pg.shutdown()


def on_all(pgs: list[Any], fn: Callable[[int, Any], Any], timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank, pg)`` for every rank concurrently; their results in rank order."""
    with cf.ThreadPoolExecutor(len(pgs)) as ex:
        futs = [ex.submit(fn, r, pg) for r, pg in enumerate(pgs)]
        return [f.result(timeout) for f in futs]


def inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randn(1000, generator=g) * (rank + 1),
        torch.randn(3, 7, generator=g).to(torch.bfloat16),
        torch.zeros(5),
        torch.randn(2, 300, generator=g)[:, ::3],  # non-contiguous: written back in place
    ]


def test_three_ranks_bit_identical_and_within_bound_of_full_precision(groups: Any) -> None:
    pgs = groups(3)
    sent: list[list[tuple[torch.dtype, int]]] = [[] for _ in pgs]
    for r, pg in enumerate(pgs):
        real = pg.allgather_into_tensor_coalesced

        def recording(outs: Any, ins: Any, opts: Any = None, r: int = r, real: Any = real) -> Any:
            sent[r].extend((t.dtype, t.numel() * t.element_size()) for t in ins)
            return real(outs, ins, opts)

        pg.allgather_into_tensor_coalesced = recording  # type: ignore[method-assign]

    def quantized(r: int, pg: Any) -> list[torch.Tensor]:
        ts = inputs(r)
        ids = [t.data_ptr() for t in ts]
        assert allreduce_quantized(pg, ts).wait() is True
        assert [t.data_ptr() for t in ts] == ids  # in place
        return ts

    def exact(r: int, pg: Any) -> list[torch.Tensor]:
        ts = [t.double().contiguous() for t in inputs(r)]
        for t in ts:
            pg.allreduce([t]).wait()
        return ts

    got = on_all(pgs, quantized)
    ref = on_all(pgs, exact)[0]
    for r in (1, 2):
        for a, b in zip(got[0], got[r], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {r} differs from rank 0"
    # bound: sum over ranks of each contribution's scale / 2 (+ bf16 rounding of the result)
    flat_in = [torch.cat([t.reshape(-1).float() for t in inputs(r)]) for r in range(3)]
    bound = sum(quantize_rowwise(f)[1].repeat_interleave(256)[: f.numel()] / 2 for f in flat_in) * TOL
    flat_got = torch.cat([t.reshape(-1).double() for t in got[0]])
    flat_ref = torch.cat([t.reshape(-1) for t in ref])
    err = (flat_got - flat_ref).abs()
    bf = slice(1000, 1021)
    bound = bound.double()
    bound[bf] += flat_ref[bf].abs() * 2.0**-8  # the bf16 tensor's own rounding
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # it really was quantized
    assert bool((got[0][2] == 0).all())
    # on the wire: one int8 payload per rank, ~1 byte per value
    numel = sum(t.numel() for t in inputs(0))
    for r in range(3):
        assert sent[r] == [(torch.int8, payload_size(numel, 256))]
        assert payload_size(numel, 256) < numel * 1.1


def test_future_resolves_to_the_reduced_tensors(groups: Any) -> None:
    pgs = groups(2)

    def run(r: int, pg: Any) -> list[list[float]]:
        ts = [torch.full((4,), float(r + 1)), torch.tensor([0.5 * r, -2.0])]
        out = allreduce_quantized(pg, ts, timeout=datetime.timedelta(seconds=10)).get_future().wait()
        assert out[0] is ts[0] and out[1] is ts[1]
        return [t.tolist() for t in out]

    res = on_all(pgs, run)
    assert res[0] == res[1]
    assert res[0][0] == pytest.approx([3.0] * 4, abs=3 / 254)
    assert res[0][1] == pytest.approx([0.5, -4.0], abs=4 / 254)


def test_a_missing_peer_fails_the_work_within_the_timeout(groups: Any) -> None:
    pgs = groups(2, timeout_s=1.0)
    import time

    t0 = time.monotonic()
    work = allreduce_quantized(pgs[0], [torch.ones(10)])  # rank 1 never joins
    with pytest.raises(ProcessGroupError):
        work.wait()
    assert time.monotonic() - t0 < 5.0
    assert pgs[0].errored() is not None
    with pytest.raises(ProcessGroupError):
        allreduce_quantized(pgs[0], [torch.ones(10)]).get_future().wait()


def test_single_rank_and_empty_inputs_are_untouched() -> None:
    pg = ProcessGroupGloo()
    x = torch.randn(10)
    before = x.clone()
    assert allreduce_quantized(pg, [x]).wait() is True  # unconfigured group: size 1
    assert torch.equal(x, before)
    assert allreduce_quantized(pg, []).get_future().wait() == []
    with pytest.raises(TypeError):
        allreduce_quantized(pg, [torch.arange(3)])
