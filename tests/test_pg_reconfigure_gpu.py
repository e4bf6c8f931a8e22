"""GPU checks of the reconfigure API (``-m gpu``; skipped without CUDA): NCCL and Baby
NCCL rebuilt from handles (``reconfigure()``), on one device with one rank, and on two
devices with two ranks in both handle orders (rank = position of the handle)."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp

from rallypoint.process_groups import ProcessGroupBabyNCCL, ProcessGroupNCCL
from rallypoint.process_groups.reconfigure import make_options

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
T = datetime.timedelta(seconds=30)
KINDS = {"nccl": ProcessGroupNCCL, "babynccl": ProcessGroupBabyNCCL}


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")


def _threads(fn: Any, n: int) -> list[Any]:
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
        t.join(180)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_rank_reconfigures_from_its_handle_aborts_and_reconfigures_again(kind: str) -> None:
    torch.cuda.set_device(0)
    pg = KINDS[kind](timeout=T)
    pg.set_rank_info("r0", 0, 1, 0)
    try:
        for uuid in (1, 2):
            assert pg.reconfigure(make_options(uuid, [pg.get_reconfigure_handle()], T)).wait()
            t = torch.full((8,), 3.0, device="cuda")
            pg.allreduce([t], ReduceOp.SUM).wait()
            assert t.tolist() == [3.0] * 8 and pg.size() == 1
        pg.abort()
        assert pg.errored() is not None
        pg.reconfigure(make_options(3, [pg.get_reconfigure_handle()], T)).wait()
        assert pg.errored() is None
        t = torch.ones(4, device="cuda")
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert t.tolist() == [1.0] * 4
    finally:
        pg.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a device per rank")
@pytest.mark.parametrize("kind", list(KINDS))
def test_two_ranks_on_two_devices_take_the_rank_of_their_handle(kind: str) -> None:
    pgs: list[Any] = []
    for d in range(2):
        torch.cuda.set_device(d)
        pgs.append(KINDS[kind](timeout=T))
        pgs[-1].set_rank_info(f"r{d}", 0, 1, d)
    handles = [pg.get_reconfigure_handle() for pg in pgs]

    def go(uuid: int, order: list[int]) -> list[list[float]]:
        def one(d: int) -> list[float]:
            torch.cuda.set_device(d)
            pgs[d].reconfigure(make_options(uuid, [handles[i] for i in order], T)).wait()
            assert pgs[d].rank() == order.index(d)
            out = [torch.zeros(1, device=f"cuda:{d}") for _ in order]
            pgs[d].allgather([out], [torch.tensor([float(d)], device=f"cuda:{d}")]).wait()
            return [x.item() for x in out]
        return _threads(one, 2)

    try:
        assert go(10, [0, 1]) == [[0.0, 1.0]] * 2
        assert go(11, [1, 0]) == [[1.0, 0.0]] * 2
    finally:
        for pg in pgs:
            pg.shutdown()
