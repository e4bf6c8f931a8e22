"""GPU checks of the process groups (``-m gpu``; skipped without CUDA).

NCCL needs one device per rank, so multi-rank NCCL tests need >= 2 GPUs; the rest
run on one device."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ReduceOp

from rallypoint.process_groups import (
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupError,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
T = datetime.timedelta
_n = iter(range(10**6))


@pytest.fixture(scope="module")
def master() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=30))


def addr(master: Any) -> str:
    return f"127.0.0.1:{master.port}/gpu{next(_n)}"


def in_threads(fn: Any, n: int) -> list[Any]:
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            out[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def test_nccl_one_rank_configure_allreduce_abort_reconfigure(master: Any) -> None:
    pg = ProcessGroupNCCL(timeout=T(seconds=20))
    for q in (1, 2):
        pg.configure(addr(master), "r", 0, 1, quorum_id=q)
        t = torch.full((8,), 3.0, device="cuda")
        pg.allreduce([t], ReduceOp.AVG).wait()
        assert t.tolist() == [3.0] * 8
    pg.abort()
    assert pg.errored() is not None
    pg.configure(addr(master), "r", 0, 1, quorum_id=3)
    assert pg.errored() is None
    t = torch.ones(4, device="cuda")
    pg.allreduce([t]).wait()
    assert t.tolist() == [1.0] * 4
    pg.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a device per rank")
def test_nccl_unmatched_op_times_out_and_aborts_the_communicator(master: Any) -> None:
    a = addr(master)
    pgs = [ProcessGroupNCCL(timeout=T(seconds=3)) for _ in range(2)]

    def conf(r: int) -> None:
        torch.cuda.set_device(r)
        pgs[r].configure(a, f"r{r}", r, 2, quorum_id=1)

    in_threads(conf, 2)
    torch.cuda.set_device(0)
    t0 = time.monotonic()
    with pytest.raises(ProcessGroupError, match="allreduce among 2 peers in quorum 1"):
        pgs[0].allreduce([torch.ones(4, device="cuda:0")]).wait()
    assert time.monotonic() - t0 < 10
    assert pgs[0].errored() is not None
    for p in pgs:
        p.shutdown()


def test_gloo_with_cuda_tensors(master: Any) -> None:
    a = addr(master)
    pgs = [ProcessGroupGloo(timeout=T(seconds=20)) for _ in range(2)]
    in_threads(lambda r: pgs[r].configure(a, f"r{r}", r, 2, quorum_id=1), 2)

    def run(r: int) -> list[float]:
        t = torch.full((4,), float(r + 1), device="cuda")
        pgs[r].allreduce([t]).wait()
        return t.tolist()

    assert in_threads(run, 2) == [[3.0] * 4] * 2
    for p in pgs:
        p.shutdown()


def test_baby_nccl_orders_the_collective_after_the_callers_stream(master: Any) -> None:
    pg = ProcessGroupBabyNCCL(timeout=T(seconds=60))
    pg.configure(addr(master), "r", 0, 1, quorum_id=1)
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the stream busy, then write
    t.fill_(2.0)
    pg.allreduce([t]).wait()  # without the event the child could read zeros
    torch.cuda.synchronize()
    assert float(t.min()) == 2.0 and float(t.max()) == 2.0
    pid = pg.child_pid()
    pg.shutdown()
    assert pid is not None


def test_baby_gloo_with_cuda_tensors(master: Any) -> None:
    pg = ProcessGroupBabyGloo(timeout=T(seconds=60))
    pg.configure(addr(master), "r", 0, 1, quorum_id=1)
    t = torch.full((16,), 5.0, device="cuda")
    pg.allreduce([t], ReduceOp.AVG).wait()
    assert t.tolist() == [5.0] * 16
    pg.shutdown()
