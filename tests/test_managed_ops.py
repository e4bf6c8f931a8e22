"""torchft API gaps TorchTitan meets (issue 41): ``ManagedProcessGroup`` and
``Manager.allreduce`` pass MAX/MIN/... through as torchft does (a replica that does not
contribute puts in the op's identity, so the others' result is unchanged), and
``Manager.set_state_dict_fns`` (torchft 0.2's deprecated name) registers state."""

from __future__ import annotations

import concurrent.futures as cf
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from rallypoint.manager._work import allreduce_args, neutral_fill
from rallypoint.process_groups import ManagedProcessGroup
from rallypoint.process_groups.work import CompletedWork
from rallypoint.process_groups.wrappers import managed_route

INF = float("inf")


@pytest.mark.parametrize("op,dtype,want", [
    (ReduceOp.SUM, torch.float32, [0.0, 0.0]),
    (ReduceOp.AVG, torch.float32, [0.0, 0.0]),
    (ReduceOp.MAX, torch.float32, [-INF, -INF]),
    (ReduceOp.MIN, torch.float32, [INF, INF]),
    (ReduceOp.MAX, torch.int32, [torch.iinfo(torch.int32).min] * 2),
    (ReduceOp.MIN, torch.int64, [torch.iinfo(torch.int64).max] * 2),
    (ReduceOp.PRODUCT, torch.float32, [1.0, 1.0]),
    (ReduceOp.BAND, torch.int32, [-1, -1]),
    (ReduceOp.BOR, torch.int32, [0, 0]),
    (ReduceOp.BXOR, torch.int32, [0, 0]),
    (ReduceOp.MAX, torch.bool, [False, False]),
    (ReduceOp.MIN, torch.bool, [True, True]),
])
def test_neutral_fill_puts_in_the_identity_of_the_op(op: Any, dtype: torch.dtype, want: list) -> None:
    t = torch.tensor([5, 7], dtype=dtype)
    assert neutral_fill(op, t)
    assert t.tolist() == want
    other = torch.tensor([3, 2], dtype=dtype)  # reducing with the identity changes nothing
    if op in (ReduceOp.MAX, ReduceOp.MIN) and dtype != torch.bool:
        f = torch.maximum if op == ReduceOp.MAX else torch.minimum
        assert f(t, other).tolist() == other.tolist()


def test_neutral_fill_refuses_an_op_without_identity() -> None:
    t = torch.tensor([1.0, 2.0])
    assert not neutral_fill(ReduceOp.BAND, t)  # no bitwise AND of floats
    assert t.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("op,zeros,ok", [
    (ReduceOp.MAX, False, True),
    (ReduceOp.MAX, True, True),  # a healing replica contributes -inf: fine
    (ReduceOp.MIN, True, True),
    (ReduceOp.SUM, True, True),
    (ReduceOp.PREMUL_SUM, True, False),
])
def test_allreduce_args_table(op: Any, zeros: bool, ok: bool) -> None:
    if ok:
        assert allreduce_args(False, op, zeros, "r") == (False, op)
    else:
        with pytest.raises(ValueError, match="healing or spares"):
            allreduce_args(False, op, zeros, "r")


@pytest.mark.parametrize("op,takes,route", [
    (ReduceOp.AVG, True, "avg"), (ReduceOp.AVG, False, "avg"),
    (ReduceOp.SUM, True, "sum"), (ReduceOp.SUM, False, "sum"),
    (ReduceOp.MAX, True, "pass"), (ReduceOp.MIN, True, "pass"), (ReduceOp.PRODUCT, True, "pass"),
    (ReduceOp.MAX, False, "refuse"),
])
def test_managed_route_table(op: Any, takes: bool, route: str) -> None:
    assert managed_route(op, takes) == route


class _OpComm:
    """A comm whose allreduce takes the op (as the Manager's does): records what it got."""

    def __init__(self) -> None:
        self.ops: list[Any] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG) -> Any:
        self.ops.append(reduce_op)
        if reduce_op == ReduceOp.MAX:
            tensor.copy_(torch.maximum(tensor, torch.full_like(tensor, 4.0)))  # the "other replica" has 4
        return CompletedWork([tensor])

    def num_participants(self) -> int:
        return 2


def test_managed_group_passes_max_through_to_the_manager() -> None:
    import torch.distributed as dist
    from torch.distributed import AllreduceOptions

    comm = _OpComm()
    pg = ManagedProcessGroup(comm)
    t = torch.tensor([1.0, 9.0])
    pg.allreduce([t], ReduceOp.MAX).wait()
    assert t.tolist() == [4.0, 9.0]
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.MIN  # type: ignore[assignment]  # stubs: RedOpType converts
    pg.allreduce([t], o).wait()
    dist.all_reduce(t, op=ReduceOp.MAX, group=pg)  # torch's own path, as TorchTitan's loss sync calls it
    assert comm.ops == [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.MAX]


def test_manager_max_across_two_groups_and_set_state_dict_fns(lighthouse) -> None:
    """Two real Managers: MAX gives the max on both; a replica that does not contribute
    (here: forced out) puts in -inf, so the result is the other's value, not max(x, 0);
    ``set_state_dict_fns`` registers under torchft's key."""
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    ms: list[Any] = []

    def make(i: int) -> Any:
        m = Manager(pgs[i], None, None, min_replica_size=1, rank=0, world_size=1,
                    hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                    replica_id=f"mx{i}", timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10),
                    connect_timeout=timedelta(seconds=10), init_sync=False)
        m.set_state_dict_fns(lambda sd: None, lambda: {"w": i})
        return m

    def step(i: int) -> tuple[list[float], list[float], bool]:
        m = ms[i]
        m.start_quorum()
        t = torch.tensor([-5.0 - i, float(i)])
        pg = ManagedProcessGroup(m)
        pg.allreduce([t], ReduceOp.MAX).wait()
        if i == 1:
            m._participating_rank = None  # as a healing replica: contributes the identity
        u = torch.tensor([-3.0 - i, -7.0])
        m.allreduce(u, reduce_op=ReduceOp.MAX).wait()
        return t.tolist(), u.tolist(), m.should_commit()

    try:
        with cf.ThreadPoolExecutor(2) as ex:
            ms.extend(ex.map(make, range(2)))
            (t0, u0, _), (t1, u1, _) = ex.map(step, range(2), timeout=60)
        assert t0 == t1 == [-5.0, 1.0]
        assert u0 == u1 == [-3.0, -7.0]  # replica 1 put in -inf, not 0
        for i, m in enumerate(ms):
            assert m._manager_state_dict()["user"] == {"set_state_dict_fns": {"w": i}}
    finally:
        for m in ms:
            m.shutdown()
        for pg in pgs:
            pg.shutdown()
