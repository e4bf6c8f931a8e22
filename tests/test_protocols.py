"""The structural seams: what a ``Manager`` needs of its process group
(``ReconfigurableProcessGroup``) and checkpoint transport (``CheckpointTransportLike``),
and what each integration needs of its manager (``ManagerLike`` and the narrower
protocols). mypy checks our classes against them statically (see each protocol
module); here the same holds at runtime with ``isinstance``, and small user-defined
classes that derive from nothing of ours plug in and work: a process group and a
transport drive a real ``Manager`` through a step, fake managers drive the optimizer
wrapper, DDP, FSDP's gradient hook and LocalSGD. torchft 0.2's own classes, where
installed, satisfy the protocols too.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp

from rallypoint.integrations import (
    DiLoCoManager,
    DistributedDataParallel,
    FSDPManager,
    GradientManager,
    LocalSGD,
    LocalSGDManager,
    ManagerLike,
    Optimizer,
    OptimizerManager,
)
from rallypoint.integrations.fsdp import GradientAverager
from rallypoint.manager import Manager
from rallypoint.process_groups import (
    AllgatherGroup,
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ReconfigurableProcessGroup,
)
from rallypoint.process_groups.work import CompletedWork
from rallypoint.transports.base import CheckpointTransport, CheckpointTransportLike
from rallypoint.transports.http import HTTPTransport
from rallypoint.transports.pg import PGTransport

MANAGER_PROTOCOLS = (OptimizerManager, GradientManager, FSDPManager, LocalSGDManager, DiLoCoManager, ManagerLike)


# ----------------------------------------------------------------------- user-defined classes


class UserGroup:
    """A process group of one replica that is no torch ProcessGroup: it records what
    the manager asks of it."""

    def __init__(self) -> None:
        self.configured: list[tuple[str, int, int, int | None, int | None, int | None]] = []
        self.allreduces = 0
        self.aborts = 0

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None) -> None:
        self.configured.append((store_addr, rank, world_size, quorum_id, group_rank, group_world_size))

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> CompletedWork:
        self.allreduces += 1
        return CompletedWork(tensors)  # one replica: the sum is the tensor itself

    def errored(self) -> Exception | None:
        return None

    def abort(self) -> None:
        self.aborts += 1

    def size(self) -> int:
        return 1

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object) -> CompletedWork:
        for o, i in zip(outputs, inputs):
            o.copy_(i.reshape(o.shape))
        return CompletedWork(outputs)


class UserTransport:
    """A checkpoint transport that derives from nothing: it records the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def metadata(self) -> str:
        self.calls.append("metadata")
        return "user://transport"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        self.calls.append("send")

    def disallow_checkpoint(self) -> None:
        self.calls.append("disallow")

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        raise AssertionError("a lone replica never heals")

    def shutdown(self, wait: bool = True) -> None:
        self.calls.append("shutdown")


class UserStepManager:
    """The least a manager must have for the optimizer wrapper."""

    def __init__(self) -> None:
        self.quorums = 0
        self.keys: list[str] = []

    def start_quorum(self) -> None:
        self.quorums += 1

    def should_commit(self) -> bool:
        return True

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None],
                               state_dict: Callable[[], Any]) -> None:
        self.keys.append(key)


class UserGradientManager:
    """The least a manager must have for DDP and FSDP's gradient hook: it halves every
    tensor (so the test sees its allreduce was used) and records the reduce ops."""

    def __init__(self) -> None:
        self.ops: list[Any] = []
        self.errors: list[Exception] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = ReduceOp.AVG) -> CompletedWork:
        self.ops.append(reduce_op)
        tensor.mul_(0.5)
        return CompletedWork([tensor])

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


class UserSyncManager:
    """The least a manager must have for LocalSGD."""

    def __init__(self) -> None:
        self.step = 0
        self.allreduces = 0

    def start_quorum(self) -> None:
        pass

    def allreduce(self, tensor: torch.Tensor) -> CompletedWork:
        self.allreduces += 1
        return CompletedWork([tensor])

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step


# ----------------------------------------------------------------------- process groups


def test_our_process_groups_satisfy_the_protocol() -> None:
    gloo = ProcessGroupGloo()
    baby = ProcessGroupBabyGloo()
    groups = [gloo, baby, ProcessGroupDummy(), ErrorSwallowingProcessGroupWrapper(gloo), FakeProcessGroupWrapper(gloo)]
    try:
        for pg in groups:
            assert isinstance(pg, ReconfigurableProcessGroup), type(pg).__name__
            assert isinstance(pg, AllgatherGroup), type(pg).__name__
        # NCCL groups need no GPU to be checked (only their methods are).
        for cls in (ProcessGroupNCCL, ProcessGroupBabyNCCL):
            assert issubclass(cls, ReconfigurableProcessGroup), cls.__name__
    finally:
        baby.shutdown()
        gloo.shutdown()


def test_a_user_process_group_satisfies_it_and_a_partial_one_does_not() -> None:
    assert isinstance(UserGroup(), ReconfigurableProcessGroup)

    class NoAbort:
        def configure(self, *args: Any, **kwargs: Any) -> None: ...
        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any: ...
        def errored(self) -> None: ...
        def size(self) -> int: return 1
        def allgather_into_tensor_coalesced(self, *args: Any) -> Any: ...

    assert not isinstance(NoAbort(), ReconfigurableProcessGroup)
    assert isinstance(NoAbort(), AllgatherGroup)  # enough for a quantized allreduce


# ----------------------------------------------------------------------- transports


def test_our_transports_and_a_user_transport_satisfy_the_protocol() -> None:
    http = HTTPTransport(timeout=timedelta(seconds=5), bind="127.0.0.1:0")
    try:
        assert isinstance(http, CheckpointTransportLike)
        assert isinstance(http, CheckpointTransport)
    finally:
        http.shutdown()
    assert isinstance(PGTransport(ProcessGroupDummy(), timeout=timedelta(seconds=5)), CheckpointTransportLike)
    assert isinstance(UserTransport(), CheckpointTransportLike)
    assert not isinstance(UserTransport(), CheckpointTransport)  # no base class needed

    class SendOnly:
        def metadata(self) -> str: return ""
        def send_checkpoint(self, *args: Any) -> None: ...

    assert not isinstance(SendOnly(), CheckpointTransportLike)


# ----------------------------------------------------------------------- the manager


def test_manager_satisfies_the_integration_protocols_and_runs_on_user_group_and_transport(
        lighthouse: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Manager over a user's process group and transport (neither derives from a class
    of ours) forms a quorum, reconfigures the group, averages through it and commits;
    the transport stays the caller's (not shut down by the manager)."""
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE"):
        monkeypatch.delenv(k, raising=False)
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    pg, transport = UserGroup(), UserTransport()
    m = Manager(pg, lambda sd: None, lambda: {"w": 1}, min_replica_size=1, rank=0, world_size=1,
                hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id="proto",
                checkpoint_transport=transport, timeout=timedelta(seconds=5),
                quorum_timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=5))
    try:
        for proto in MANAGER_PROTOCOLS:
            assert isinstance(m, proto), proto.__name__
        m.start_quorum()
        t = torch.tensor([2.0, 4.0])
        m.allreduce(t).wait()
        assert m.should_commit() is True
        assert t.tolist() == [2.0, 4.0] and m.current_step() == 1
        assert len(pg.configured) == 1 and pg.allreduces == 1
        _store, rank, world, quorum_id, group_rank, group_world = pg.configured[0]
        assert (rank, world, group_rank, group_world) == (0, 1, 0, 1) and quorum_id is not None
        assert "metadata" in transport.calls and "disallow" in transport.calls
    finally:
        m.shutdown()
    assert "shutdown" not in transport.calls


# ----------------------------------------------------------------------- integrations


def test_user_managers_satisfy_exactly_their_integrations_protocols() -> None:
    step, grad, sync = UserStepManager(), UserGradientManager(), UserSyncManager()
    assert isinstance(step, OptimizerManager) and not isinstance(step, GradientManager)
    assert isinstance(grad, GradientManager) and not isinstance(grad, FSDPManager)
    assert isinstance(sync, LocalSGDManager) and not isinstance(sync, DiLoCoManager)
    for m in (step, grad, sync):
        assert not isinstance(m, ManagerLike)


def test_user_managers_drive_the_integrations() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    step = UserStepManager()
    opt = Optimizer(step, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.register_scheduler(sched)
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    assert opt.step() is True and step.quorums == 1 and step.keys == ["lr_scheduler"]

    grad = UserGradientManager()
    g = torch.ones(4)
    GradientAverager(grad)(g)
    assert g.tolist() == [0.5] * 4 and grad.ops == [ReduceOp.AVG] and not grad.errors

    torch.manual_seed(0)
    plain, wrapped_inner = nn.Linear(3, 2), nn.Linear(3, 2)
    wrapped_inner.load_state_dict(plain.state_dict())
    ddp = DistributedDataParallel(grad, wrapped_inner)
    try:
        x = torch.randn(4, 3)
        plain(x).sum().backward()
        ddp(x).sum().backward()
        for p, q in zip(plain.parameters(), wrapped_inner.parameters()):
            assert q.grad is not None and p.grad is not None
            assert torch.allclose(q.grad, p.grad * 0.5)  # went through the user's allreduce
        assert not grad.errors
    finally:
        ddp.shutdown()

    sync = UserSyncManager()
    model = nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(sync, model, inner, sync_every=1):
        model(torch.ones(1, 3)).sum().backward()
        inner.step()
    assert sync.step == 1 and sync.allreduces == len(list(model.parameters()))


# ----------------------------------------------------------------------- torchft's classes


def test_torchft_classes_satisfy_the_protocols() -> None:
    """torchft 0.2's groups, transports and Manager plug in structurally (checked on the
    classes: building them needs a lighthouse or a server). Its Manager cannot heal on
    the training thread, so it is no FSDPManager."""
    tf_manager = pytest.importorskip("torchft.manager")
    tf_pg = pytest.importorskip("torchft.process_group")
    tf_http = pytest.importorskip("torchft.checkpointing.http_transport")
    tf_pgt = pytest.importorskip("torchft.checkpointing.pg_transport")
    for cls in (tf_pg.ProcessGroupGloo, tf_pg.ProcessGroupBabyGloo, tf_pg.ErrorSwallowingProcessGroupWrapper):
        assert issubclass(cls, ReconfigurableProcessGroup), cls.__name__
    for cls in (tf_http.HTTPTransport, tf_pgt.PGTransport):
        assert issubclass(cls, CheckpointTransportLike), cls.__name__
    for proto in (OptimizerManager, GradientManager, LocalSGDManager, DiLoCoManager):
        assert issubclass(tf_manager.Manager, proto), proto.__name__
    bare = object.__new__(tf_manager.Manager)  # no __init__: only the class's members
    assert not isinstance(bare, FSDPManager)
