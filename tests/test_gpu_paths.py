"""GPU paths that the other ``gpu``-marked files leave out (``-m gpu``; skipped without
CUDA, the 2-GPU ones without a second device).

Already covered elsewhere: one-rank NCCL configure/abort/reconfigure, an unmatched op
timing out (2 GPUs), Gloo and Baby Gloo with CUDA tensors, Baby NCCL ordering after the
caller's stream (test_process_groups_gpu.py); a PG heal of CUDA tensors over Gloo and
over NCCL between two GPUs, device tensors kept on the device by the wire format
(test_pg_transport.py); quantization and DiLoCo on CUDA (test_integrations_gpu.py); the
SDC hash on the device (test_guards.py).

Here: a 2-rank NCCL and Baby NCCL allreduce with a checked result, then a reconfigure to
one rank (2 GPUs); the HTTP heal of a CUDA state, in place and fresh (1 GPU); FSDP2 over
a CUDA mesh with the cross-replica averaging hook, and its heal state through the wire
format into a fresh CUDA replica (1 GPU, the in-process half of HSDP: the replica group
is the mesh, the manager averages across groups)."""

from __future__ import annotations

import datetime
import threading
from typing import Any, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.distributed_c10d import ReduceOp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
T = datetime.timedelta
_n = iter(range(10**6))


def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=30))


def _in_threads(fn: Any, n: int, timeout: float = 120) -> list[Any]:
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
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), f"a rank thread is still running after {timeout}s"
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


# ----------------------------------------------------------------------- 2 GPUs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a device per rank")
@pytest.mark.parametrize("kind", ["nccl", "baby-nccl"])
def test_two_rank_allreduce_on_two_gpus_then_one_rank(kind: str) -> None:
    """Rank r holds r+1 on cuda:r: SUM gives 3 and AVG 1.5 on both devices; then rank 0
    alone is reconfigured into a new quorum of one and still reduces."""
    from rallypoint.process_groups import ProcessGroupBabyNCCL, ProcessGroupNCCL

    store = _store()
    cls = ProcessGroupNCCL if kind == "nccl" else ProcessGroupBabyNCCL
    pgs = [cls(timeout=T(seconds=60)) for _ in range(2)]
    a = f"127.0.0.1:{store.port}/two{next(_n)}"

    def conf(r: int) -> None:
        torch.cuda.set_device(r)
        pgs[r].configure(a, f"r{r}", r, 2, quorum_id=1)

    def reduce(r: int) -> list[float]:
        torch.cuda.set_device(r)
        s = torch.full((1 << 16,), float(r + 1), device=f"cuda:{r}")
        v = torch.full((8,), float(r + 1), device=f"cuda:{r}")
        pgs[r].allreduce([s], ReduceOp.SUM).wait()
        pgs[r].allreduce([v], ReduceOp.AVG).wait()
        torch.cuda.synchronize(r)
        assert s.device.index == r and float(s.min()) == float(s.max()) == 3.0
        return v.tolist()

    try:
        _in_threads(conf, 2)
        assert _in_threads(reduce, 2) == [[1.5] * 8] * 2
        torch.cuda.set_device(0)
        pgs[1].shutdown()
        pgs[0].configure(f"127.0.0.1:{store.port}/one{next(_n)}", "r0", 0, 1, quorum_id=2)
        t = torch.full((4,), 7.0, device="cuda:0")
        pgs[0].allreduce([t], ReduceOp.SUM).wait()
        torch.cuda.synchronize(0)
        assert t.tolist() == [7.0] * 4
    finally:
        for p in pgs:
            p.shutdown()


# ----------------------------------------------------------------------- HTTP heal, CUDA


def _cuda_state() -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    return {
        "w": torch.randn(3 << 20, generator=g, device=dev),  # 12 MB: several checksum blocks
        "b": torch.arange(7, device=dev),
        "half": torch.randn(1000, generator=g, device=dev).to(torch.bfloat16),
        "strided": torch.randn(64, 32, generator=g, device=dev).t(),  # not contiguous
        "host": torch.ones(3),
        "step": 11,
    }


def test_http_heal_of_a_cuda_state_in_place_and_fresh() -> None:
    """The sender serves CUDA tensors (copied to the host as they are sent); a receiver
    with a CUDA state of the same shapes gets the values in its own tensors (same
    objects, same storage, still on the device); one without gets host tensors."""
    from rallypoint.transports.http import HTTPTransport

    sd = _cuda_state()
    tx = HTTPTransport(T(seconds=60), bind="127.0.0.1:0", advertise_host="127.0.0.1")
    rx = HTTPTransport(T(seconds=60), bind="127.0.0.1:0")
    try:
        tx.send_checkpoint([1], 5, sd, T(seconds=60))
        into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
        ptrs = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
        got = rx.recv_checkpoint(0, tx.metadata(), 5, T(seconds=60), into=into, in_place=True)
        torch.cuda.synchronize()
        assert got["step"] == 11
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                continue
            assert got[k] is into[k] and got[k].data_ptr() == ptrs[k], k
            assert got[k].device == v.device and torch.equal(got[k].cpu(), v.cpu()), k
        tx.send_checkpoint([1], 6, sd, T(seconds=60))
        fresh = rx.recv_checkpoint(0, tx.metadata(), 6, T(seconds=60))
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert fresh[k].device.type == "cpu" and torch.equal(fresh[k], v.cpu()), k
    finally:
        tx.shutdown()
        rx.shutdown()


# ----------------------------------------------------------------------- FSDP2 on CUDA


class _OneGroupManager:
    """What the FSDP helper touches on a manager, for a quorum of one replica group:
    ``allreduce`` is already the mean (it records the shards it saw)."""

    def __init__(self) -> None:
        self.group_world_size = 1
        self.group_rank = 0
        self.heal_on_training_thread = False
        self.heal_mesh: Any = None
        self.shards: list[tuple[int, str]] = []
        self.registered: dict[str, Any] = {}
        self.errors: list[Exception] = []

    def allreduce(self, t: torch.Tensor, reduce_op: Any = None) -> Any:
        from rallypoint.manager._work import DoneWork

        self.shards.append((t.numel(), t.device.type))
        return DoneWork(t)

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.registered[key] = (load, save)

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


@pytest.fixture
def cuda_mesh() -> Iterator[Any]:
    """A 1-rank NCCL world and a CUDA mesh in this process, torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    import fsdp_worker

    x, y = fsdp_worker.global_batch(step, 8)
    return x.cuda(), y.cuda()


def _local(p: Any) -> torch.Tensor:
    """A DTensor parameter's local shard."""
    return p.to_local()


def _train(r: Any, steps: range) -> None:
    for s in steps:
        x, y = _batch(s)
        r.optimizer.zero_grad()
        nn.functional.mse_loss(r.module(x), y).backward()
        r.optimizer.step()
    torch.cuda.synchronize()


def test_fsdp_on_cuda_averages_through_the_manager_and_heals_a_fresh_replica(cuda_mesh: Any) -> None:
    """FSDP2 over a CUDA mesh: the hook hands the manager CUDA gradient shards (one per
    FSDP unit per backward) and training matches plain CUDA training; the heal state
    (DTensors on the device, Adam state) goes through the wire format into a replica with
    other weights and no optimizer state, which then equals the sender and keeps training
    identically."""
    import fsdp_worker

    from rallypoint.integrations.fsdp import fully_shard_replicated
    from rallypoint.transports import wire

    def adam(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(ps, lr=0.05)

    mgr = _OneGroupManager()
    src = fully_shard_replicated(fsdp_worker.make_model(), mgr, adam, mesh=cuda_mesh, shard_submodules=(nn.Linear,))
    plain = fsdp_worker.make_model().cuda()
    plain_opt = adam(plain.parameters())
    for s in range(3):
        _train(src, range(s, s + 1))
        x, y = _batch(s)
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    assert len(mgr.shards) == 6 and all(dev == "cuda" for _, dev in mgr.shards), mgr.shards
    for (name, p), q in zip(src.module.named_parameters(), plain.parameters()):
        local = _local(p)
        assert local.is_cuda
        torch.testing.assert_close(local, q.detach(), msg=name)
    assert mgr.errors == []

    torch.manual_seed(123)
    dst_mgr = _OneGroupManager()
    dst = fully_shard_replicated(nn.Sequential(nn.Linear(fsdp_worker.IN, fsdp_worker.HIDDEN), nn.Tanh(),
                                               nn.Linear(fsdp_worker.HIDDEN, fsdp_worker.OUT)),
                                 dst_mgr, adam, mesh=cuda_mesh, shard_submodules=(nn.Linear,))
    before = [id(p) for p in dst.module.parameters()]
    assert src.state is not None and dst.state is not None
    dst.state.load(wire.decode(wire.to_bytes(src.state.save()), into=dst.state.save(), mesh=dst_mgr.heal_mesh))
    torch.cuda.synchronize()
    assert [id(p) for p in dst.module.parameters()] == before
    assert all(_local(p).is_cuda for p in dst.module.parameters())

    def same() -> None:
        sa = fsdp_worker.local_shards(src.module, src.optimizer)
        sb = fsdp_worker.local_shards(dst.module, dst.optimizer)
        assert sorted(sa) == sorted(sb) and any(".exp_avg" in k for k in sa)
        for k in sa:
            assert torch.equal(sa[k].cpu(), sb[k].cpu()), k

    same()
    _train(src, range(3, 5))
    _train(dst, range(3, 5))
    same()
