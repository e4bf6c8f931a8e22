"""The corruption checks' rows riding in the last gradient bucket's collective
(``rallypoint.manager._ride``): the row layout as tables, then three guards on a real
3-rank gloo group (threads in this process, a TCPStore on port 0) allreducing a bucket with
their rows in it: every bucket gets the exact mean, every guard the same rows and verdict,
in float32 and float64; a failed collective leaves the bucket as it was and fails the check.
Every wait has a timeout; the file runs in a few seconds."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from gloo_threads import gloo_group, on_ranks

from rallypoint.manager import _ride, _sdc
from rallypoint.manager._guard import SdcGuard
from rallypoint.manager.recovery import QuorumResult

NAN, INF = math.nan, math.inf
WORLD = 3
TIMEOUT = timedelta(seconds=10)
LOG = logging.LoggerAdapter(logging.getLogger("test_ride"), {})


# ----------------------------------------------------------------------------- the row layout
@pytest.mark.parametrize("h", [0, 1, 0xFFFF, 0x10000, 2**32 - 1, 2**32, 2**53 + 1, 2**63 + 12345, 2**64 - 1])
def test_hash_rides_as_exact_16_bit_pieces(h: int) -> None:
    """Every piece is exact in float32 (a 32-bit half is not), and the row comes back whole."""
    row = [1.0, 2.5, 1.0, *_sdc.u64_to_halves(h)]
    ride = _ride.to_ride_row(row)
    assert len(ride) == _ride.RIDE_COLUMNS and all(0 <= p <= 0xFFFF for p in ride[3:])
    as_f32 = torch.tensor(ride, dtype=torch.float32).tolist()
    back = _ride.from_ride_row(as_f32)
    assert _sdc.halves_to_u64(back[3], back[4]) == h and back[:3] == [1.0, 2.5, 1.0]


@pytest.mark.parametrize("norm", [NAN, INF, -INF, 0.0, 1e-30, 3e38])
def test_norm_rides_through_float32(norm: float) -> None:
    """NaN and Inf stay what they are; a finite norm keeps float32 precision."""
    back = _ride.from_ride_row(torch.tensor(_ride.to_ride_row([1.0, norm, 0.0, 0.0, 0.0]),
                                            dtype=torch.float32).tolist())
    if math.isnan(norm):
        assert math.isnan(back[1])
    else:
        assert back[1] == pytest.approx(norm, rel=1e-7)


@pytest.mark.parametrize("bad", [0.5, -1.0, 65536.0, NAN, INF])
def test_from_ride_row_refuses_what_is_not_a_piece(bad: float) -> None:
    with pytest.raises(ValueError, match="16-bit piece"):
        _ride.from_ride_row([1.0, 1.0, 1.0, 0.0, bad, 0.0, 0.0])


@pytest.mark.parametrize("row", [[1.0, 1.0, 1.0, 0.5, 0.0], [1.0, 1.0, 1.0, 2.0**32, 0.0], [1.0, 1.0]])
def test_to_ride_row_refuses_a_bad_row(row: list[float]) -> None:
    with pytest.raises(ValueError):
        _ride.to_ride_row(row)


# (dtype, layout/size, device) -> rides?
@pytest.mark.parametrize("tensor, rides", [
    (torch.zeros(10), True),
    (torch.zeros(10, dtype=torch.float64), True),
    (torch.zeros(10, dtype=torch.bfloat16), False),
    (torch.zeros(10, dtype=torch.float16), False),
    (torch.zeros(4, 4).t(), False),  # not contiguous
    (torch.zeros(_ride.RIDE_MAX_CPU_BYTES // 4), True),
    (torch.zeros(_ride.RIDE_MAX_CPU_BYTES // 4 + 1), False),  # the copy would cost more than it saves
])
def test_can_ride(tensor: torch.Tensor, rides: bool) -> None:
    assert _ride.can_ride(tensor) is rides
    assert SdcGuard(True, 0, LOG).can_ride(tensor) is rides
    assert SdcGuard(False, 0, LOG).can_ride(tensor) is False  # checks off: nothing to ride


def test_staging_is_kept_between_steps() -> None:
    st = _ride.Staging()
    a = st.load(torch.ones(8), 3)
    st.put_row([1.0] * 7, 1, 3)
    assert a[:8].tolist() == [1.0] * 8 and a[8:].view(3, 7).tolist() == [[0.0] * 7, [1.0] * 7, [0.0] * 7]
    b = st.load(torch.full((8,), 2.0), 3)
    assert b.data_ptr() == a.data_ptr() and b[8:].abs().sum() == 0  # reused, slots cleared
    c = st.load(torch.ones(8), 4)  # the quorum grew: a new tensor
    assert c.numel() == 8 + 4 * 7
    with pytest.raises(ValueError):
        st.put_row([1.0] * 7, 4, 4)
    with pytest.raises(ValueError):
        st.put_row([1.0] * 5, 0, 4)
    with pytest.raises(ValueError, match="loaded"):
        _ride.Staging().put_row([1.0] * 7, 0, 2)  # before any load


# ------------------------------------------------------------------------------ over gloo
def _on_ranks(fn: Callable[[int], Any], n: int = WORLD, timeout: float = 15.0) -> dict[int, Any]:
    return on_ranks(fn, n, timeout)


@pytest.fixture(scope="module")
def gloo3() -> Any:
    """A real 3-rank gloo group (one per thread) on a TCPStore that picked its own port."""
    yield from gloo_group(WORLD, "ride", TIMEOUT)


def _quorum(r: int, step: int) -> QuorumResult:
    return QuorumResult(quorum_id=7, replica_rank=r, replica_world_size=WORLD, recover_src_manager_address="",
                        recover_src_replica_rank=None, recover_dst_replica_ranks=[], store_address="",
                        max_step=step, max_replica_rank=None, max_world_size=WORLD, heal=False, commit_failures=0,
                        replica_ids=[f"g{q}" for q in range(WORLD)])


class _Sink:
    """What the Manager's FailFast is to the guard and the work: posts, and hears failures."""

    timeout = TIMEOUT

    def __init__(self) -> None:
        self.failed: list[Exception] = []
        self.aborted: list[tuple[Exception, str | None]] = []

    def add_work(self, start: Callable[[], Any]) -> Any:
        return start()

    def comm_failed(self, e: Exception) -> None:
        self.failed.append(e)

    def abort(self, e: Exception, cause: str | None = None) -> None:
        self.aborted.append((e, cause))


def _ride_round(gloo3: dict[int, Any], guards: dict[int, SdcGuard], buckets: dict[int, torch.Tensor],
                step: int) -> dict[int, tuple[str | None, dict[str, Any]]]:
    """Each group posts its last bucket with its row riding in it, waits, and checks."""
    sinks = {r: _Sink() for r in range(WORLD)}
    for g in guards.values():
        g.new_round()

    def ride(r: int) -> tuple[str | None, dict[str, Any]]:
        g, q = guards[r], _quorum(r, step)
        assert g.can_ride(buckets[r])
        work = g.post_riding(gloo3[r], q, True, buckets[r], True, WORLD, f"g{r}", sinks[r])
        assert isinstance(work, _ride.RidingWork)
        work.wait(TIMEOUT)
        ptr = buckets[r].data_ptr()
        mean = work.averaged()  # what DDP hands torch's reducer: the bucket, holding the mean
        assert mean is buckets[r] and mean.data_ptr() == ptr  # the reducer then copies nothing back
        return g.check(gloo3[r], q, True, TIMEOUT, f"g{r}", post=sinks[r].add_work)

    out = _on_ranks(ride)
    assert not any(s.failed or s.aborted for s in sinks.values())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_ride_in_the_bucket_and_everyone_agrees(gloo3: dict[int, Any], dtype: torch.dtype) -> None:
    """Three groups allreduce their last bucket with the rows in it: each bucket gets the
    mean, no collective of the checks' own is made, and every guard reaches the same
    verdict naming the group whose gradients are 1e6 times the others'; the parameters,
    hashed this round (check_every=1), agree."""
    buckets = {r: torch.full((1000,), 1e6 if r == 2 else 0.01 * (r + 1), dtype=dtype) for r in range(WORLD)}
    expected = sum(b.double() for b in buckets.values()) / WORLD
    guards = {r: SdcGuard(True, 1, LOG) for r in range(WORLD)}
    for g in guards.values():
        g.register_params([torch.arange(50, dtype=torch.float32)])
    out = _ride_round(gloo3, guards, buckets, 4)
    for r in range(WORLD):
        why, done = out[r]
        assert buckets[r].dtype == dtype and torch.allclose(buckets[r].double(), expected, rtol=1e-6)
        assert torch.equal(buckets[r], buckets[0])
        assert why is not None and "g2 (outlier" in why, why
        assert done["sdc_checked"] == ["grad", "param"] and done["sdc_bad"] == ["g2"] and done["sdc_failed"] == "grad"
        g = guards[r]
        assert (g.riding_exchanges, g.early_exchanges, g.late_exchanges) == (1, 1, 0)


def test_a_different_hash_rides_exactly_in_float32(gloo3: dict[int, Any]) -> None:
    """The parameter hashes ride in a float32 bucket as 16-bit pieces and arrive exact: the
    group whose parameters differ in one low bit is the minority everywhere and heals; the
    others commit."""
    base = torch.arange(50, dtype=torch.float32)
    flipped = base.clone()
    flipped.view(torch.int32)[7] ^= 1  # a low mantissa bit: the norms cannot see it
    guards = {r: SdcGuard(True, 1, LOG) for r in range(WORLD)}
    for r, g in guards.items():
        g.register_params([flipped if r == 1 else base])
    buckets = {r: torch.full((300,), 0.5) for r in range(WORLD)}
    out = _ride_round(gloo3, guards, buckets, 8)
    assert out[0][0] is None and out[2][0] is None, out
    why, done = out[1]
    assert why is not None and "parameter check" in why and "replica g1 heals from the majority" in why, why
    assert all(d["sdc_bad"] == ["g1"] for _, d in out.values())


def test_rows_from_a_non_contributing_group_are_not_counted(gloo3: dict[int, Any]) -> None:
    """A healing group rides along with zeros and an invalid row: the others' verdict is
    theirs alone, and its bucket still gets the mean of the contributors."""
    buckets = {r: (torch.zeros(64) if r == 0 else torch.full((64,), float(r))) for r in range(WORLD)}
    guards = {r: SdcGuard(True, 0, LOG) for r in range(WORLD)}
    for g in guards.values():
        g.new_round()

    def ride(r: int) -> tuple[str | None, dict[str, Any]]:
        g, q, sink = guards[r], _quorum(r, 9), _Sink()
        g.post_riding(gloo3[r], q, r != 0, buckets[r], r != 0, 2, f"g{r}", sink).averaged()
        return g.check(gloo3[r], q, r != 0, TIMEOUT, f"g{r}")

    out = _on_ranks(ride)
    assert all(why is None for why, _ in out.values()), out
    assert all(torch.equal(b, torch.full((64,), 1.5)) for b in buckets.values())


class _FailingWork:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return True


class _FailingPG:
    def __init__(self) -> None:
        self.posted: list[torch.Tensor] = []

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> _FailingWork:
        self.posted.append(tensors[0])
        return _FailingWork(RuntimeError("peer g1 closed the connection"))


def test_a_failed_collective_leaves_the_bucket_and_fails_the_check() -> None:
    bucket = torch.full((100,), 0.5)
    before = bucket.clone()
    g, sink, pg = SdcGuard(True, 0, LOG), _Sink(), _FailingPG()
    g.new_round()
    work = g.post_riding(pg, _quorum(0, 3), True, bucket, True, WORLD, "g0", sink)
    assert pg.posted[0].numel() == 100 + WORLD * _ride.RIDE_COLUMNS  # the bucket and the rows, one collective
    assert work.wait(TIMEOUT) is True  # routed to the manager, never raised mid-step
    assert torch.equal(bucket, before) and len(sink.failed) == 1 and work.error is sink.failed[0]
    assert work.averaged() is bucket  # DDP completes the bucket's future with its own gradients
    with pytest.raises(_sdc.SdcExchangeError, match="riding in the last gradient bucket failed at replica rank 0"):
        g.check(pg, _quorum(0, 3), True, TIMEOUT, "g0")


def test_rows_that_cannot_be_made_abort_instead_of_posting_nothing_silently() -> None:
    """A row that cannot be built (here: a replica rank outside the quorum) posts nothing;
    the guard aborts the process group, so peers waiting in the collective
    fail now, and the check reports the failure."""
    g, sink, pg = SdcGuard(True, 0, LOG), _Sink(), _FailingPG()
    g.new_round()
    q = _quorum(5, 3)  # a replica rank outside the quorum: put_row refuses
    assert g.post_riding(pg, q, True, torch.ones(10), True, WORLD, "g5", sink) is None
    assert not pg.posted and len(sink.aborted) == 1 and sink.aborted[0][1] == "comm"
    with pytest.raises(ValueError, match="replica_rank 5"):
        g.check(pg, q, True, TIMEOUT, "g5")


# ------------------------------------------------------------------------------------ GPU
class _SumOfOne:
    """A one-replica process group on any device: the sum is the tensor itself."""

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
        class _Done:
            def wait(self, timeout: timedelta | None = None) -> bool:
                return True

            def is_completed(self) -> bool:
                return True

        return _Done()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_ride_in_a_cuda_bucket() -> None:
    """On CUDA the staging tensor lives on the bucket's device (an NCCL collective takes
    it), the row is written there, and the mean and the rows come back right."""
    bucket = torch.full((4096,), 3.0, device="cuda")
    g, sink = SdcGuard(True, 1, LOG), _Sink()
    g.register_params([torch.arange(16.0, device="cuda")])
    g.new_round()
    q = QuorumResult(quorum_id=1, replica_rank=0, replica_world_size=1, recover_src_manager_address="",
                     recover_src_replica_rank=None, recover_dst_replica_ranks=[], store_address="", max_step=2,
                     max_replica_rank=None, max_world_size=1, heal=False, commit_failures=0, replica_ids=["g0"])
    assert g.can_ride(bucket) and _ride.can_ride(torch.zeros(_ride.RIDE_MAX_CPU_BYTES, device="cuda"))
    work = g.post_riding(_SumOfOne(), q, True, bucket, True, 2, "g0", sink)
    mean = work.averaged()
    assert mean.device.type == "cuda" and torch.equal(mean, torch.full_like(bucket, 1.5))
    why, done = g.check(_SumOfOne(), q, True, TIMEOUT, "g0")
    assert why is None and done["sdc_checked"] == ["grad", "param"] and not sink.failed
