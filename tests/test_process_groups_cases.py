"""Worker-side collective cases for the process-group tests (no tests here):
every collective run on the group under test and on a plain torch gloo group with
the same inputs, both results returned for the test to compare."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from test_process_groups_util import STATE, plain


def _inputs(rank: int, n: int = 6, dtype: Any = None) -> Any:
    import torch

    dtype = dtype or torch.float32
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank * 10).to(dtype)


def w_collectives(host: str, port: int, ref_prefix: str, rank: int, world: int, key: str = "pg") -> dict[str, Any]:
    """Run every collective on our group and on a plain torch gloo group; both results.

    Only used with in-order ops, so our group and the reference see identical inputs.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        AllgatherOptions,
        AllreduceCoalescedOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
        ReduceOp,
        ReduceScatterOptions,
    )

    pg = STATE[key]
    assert pg.rank() == rank and pg.size() == world, (pg.rank(), pg.size())
    store = dist.PrefixStore(ref_prefix, dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)))
    ref = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=10))
    out: dict[str, Any] = {}

    def both(name: str, fn: Callable[[Any, bool], Any]) -> None:
        ours = fn(pg, True)
        theirs = fn(ref, False)
        out[name] = (plain(ours), plain(theirs))

    def ar(op: Any, dtype: Any = None) -> Callable[[Any, bool], Any]:
        def fn(g: Any, is_ours: bool) -> Any:
            t = _inputs(rank, dtype=dtype)
            o = AllreduceOptions()
            if op == ReduceOp.AVG and not is_ours:
                o.reduceOp = ReduceOp.SUM
                g.allreduce([t], o).wait()
                return t / world if t.is_floating_point() else t.div(world, rounding_mode="trunc")
            o.reduceOp = op
            g.allreduce([t], o).wait()
            return t

        return fn

    for op in ("SUM", "AVG", "MIN", "MAX"):
        both(f"allreduce_{op}", ar(getattr(ReduceOp, op)))
    both("allreduce_SUM_int64", ar(ReduceOp.SUM, torch.int64))
    both("allreduce_AVG_int64", ar(ReduceOp.AVG, torch.int64))

    def coalesced(g: Any, is_ours: bool) -> Any:
        ts = [_inputs(rank, 5), _inputs(rank + 1, 3)]
        o = AllreduceCoalescedOptions()
        o.reduceOp = ReduceOp.SUM
        g.allreduce_coalesced(ts, o).wait()
        return ts

    both("allreduce_coalesced", coalesced)

    def coalesced_avg_mixed(g: Any, is_ours: bool) -> Any:
        ts = [_inputs(rank, 5), _inputs(rank, 4, torch.float64)]
        if is_ours:
            o = AllreduceCoalescedOptions()
            o.reduceOp = ReduceOp.AVG
            g.allreduce_coalesced(ts, o).wait()
            return ts
        for t in ts:
            g.allreduce([t], AllreduceOptions()).wait()
        return [t / world for t in ts]

    both("allreduce_coalesced_avg_mixed_dtypes", coalesced_avg_mixed)

    def allgather(g: Any, is_ours: bool) -> Any:
        outs = [[torch.zeros(6) for _ in range(world)]]
        g.allgather(outs, [_inputs(rank)], AllgatherOptions()).wait()
        return outs

    both("allgather", allgather)

    def allgather_into(g: Any, is_ours: bool) -> Any:
        o = torch.zeros(6 * world)
        g._allgather_base(o, _inputs(rank), AllgatherOptions()).wait()
        return o

    both("allgather_into_tensor", allgather_into)

    def broadcast(g: Any, is_ours: bool) -> Any:
        t = _inputs(rank)
        o = BroadcastOptions()
        o.rootRank = 1
        g.broadcast([t], o).wait()
        return t

    both("broadcast", broadcast)

    def rs_list(op: Any) -> Callable[[Any, bool], Any]:
        def fn(g: Any, is_ours: bool) -> Any:
            inputs = [[_inputs(rank + j, 4) for j in range(world)]]
            outs = [torch.zeros(4)]
            o = ReduceScatterOptions()
            o.reduceOp = op if is_ours else ReduceOp.SUM
            g.reduce_scatter(outs, inputs, o).wait()
            if op == ReduceOp.AVG and not is_ours:
                outs[0] /= world
            return outs

        return fn

    both("reduce_scatter_SUM", rs_list(ReduceOp.SUM))
    both("reduce_scatter_AVG", rs_list(ReduceOp.AVG))

    def rs_tensor(g: Any, is_ours: bool) -> Any:
        out = torch.zeros(3)
        g._reduce_scatter_base(out, _inputs(rank, 3 * world), ReduceScatterOptions()).wait()
        return out

    both("reduce_scatter_tensor", rs_tensor)

    def rs_emulated(g: Any, is_ours: bool) -> Any:
        if is_ours:
            g.emulate_reduce_scatter = True
        try:
            a = [torch.zeros(4)]
            g.reduce_scatter(a, [[_inputs(rank + j, 4) for j in range(world)]], ReduceScatterOptions()).wait()
            b = torch.zeros(3)
            g._reduce_scatter_base(b, _inputs(rank, 3 * world), ReduceScatterOptions()).wait()
            return [a[0], b]
        finally:
            if is_ours:
                g.emulate_reduce_scatter = False

    if hasattr(pg, "emulate_reduce_scatter"):
        both("reduce_scatter_emulated", rs_emulated)

    def a2a_even(g: Any, is_ours: bool) -> Any:
        out = torch.zeros(2 * world)
        g.alltoall_base(out, _inputs(rank, 2 * world), [], [], AllToAllOptions()).wait()
        return out

    both("alltoall_base_even", a2a_even)

    def a2a_uneven(g: Any, is_ours: bool) -> Any:
        # rank r sends (j + 1) elements to rank j, so it receives r + 1 from each.
        in_splits = [j + 1 for j in range(world)]
        out_splits = [rank + 1] * world
        out = torch.zeros(sum(out_splits))
        g.alltoall_base(out, _inputs(rank, sum(in_splits)), out_splits, in_splits, AllToAllOptions()).wait()
        return out

    both("alltoall_base_uneven", a2a_uneven)

    def sendrecv(g: Any, is_ours: bool) -> Any:
        dst, src = (rank + 1) % world, (rank - 1) % world
        t = torch.zeros(6)
        if rank % 2 == 0:
            g.send([_inputs(rank)], dst, 7).wait()
            g.recv([t], src, 7).wait()
        else:
            g.recv([t], src, 7).wait()
            g.send([_inputs(rank)], dst, 7).wait()
        return t

    both("send_recv_ring", sendrecv)

    def barrier(g: Any, is_ours: bool) -> Any:
        g.barrier(BarrierOptions()).wait()
        return "ok"

    both("barrier", barrier)

    # Through torch.distributed's own functions (our group is not dist-registered).
    t = _inputs(rank)
    dist.all_reduce(t, group=pg)
    r = _inputs(rank)
    ref.allreduce([r], AllreduceOptions()).wait()
    out["dist.all_reduce"] = (plain(t), plain(r))
    o = torch.zeros(6 * world)
    dist.all_gather_into_tensor(o, _inputs(rank), group=pg)
    r = torch.zeros(6 * world)
    ref._allgather_base(r, _inputs(rank), AllgatherOptions()).wait()
    out["dist.all_gather_into_tensor"] = (plain(o), plain(r))
    work = dist.all_reduce(_inputs(rank), group=pg, async_op=True)
    fut_val = work.get_future().wait()
    out["get_future"] = (plain(fut_val[0]), plain(r[6 * 0 : 6] * 0 + _sum_inputs(world)))
    return out


def _sum_inputs(world: int) -> Any:
    return sum(_inputs(r) for r in range(world))
