"""In-process tests of the process-group contract: store addresses and prefixes,
configure/abort/errored/shutdown, rank()/size(), bounded waits with clear errors,
the dummy, error-swallowing, fault-injecting and managed groups, and DDP."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp, Work

from rallypoint.process_groups import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedCollectives,
    ManagedProcessGroup,
    NotConfiguredError,
    ProcessGroup,
    ProcessGroupAborted,
    ProcessGroupDummy,
    ProcessGroupError,
    ProcessGroupGloo,
    ProcessGroupTimeout,
)
from rallypoint.process_groups._store import StoreClients, fresh_prefix_store, parse_store_addr
from rallypoint.process_groups.work import CompletedWork

T = datetime.timedelta


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def master() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=10))


_n = iter(range(10**6))


def addr(master: Any, host: str = "127.0.0.1") -> str:
    h = f"[{host}]" if ":" in host else host
    return f"{h}:{master.port}/unit{next(_n)}"


def configure_threads(pgs: list[ProcessGroup], store_addr: str, quorum_id: int = 1) -> None:
    """Configure ``pgs`` as ranks of one group from threads (gloo's connect blocks)."""
    errs: list[BaseException] = []

    def run(r: int) -> None:
        try:
            pgs[r].configure(store_addr, f"replica{r}", r, len(pgs), quorum_id=quorum_id, group_rank=0)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(len(pgs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errs, errs


# ------------------------------------------------------------------ store addresses


@pytest.mark.parametrize(
    "text,host,port,prefix",
    [
        ("localhost:1234/my/prefix", "localhost", 1234, "my/prefix"),
        ("10.0.0.1:29500", "10.0.0.1", 29500, ""),
        ("[::1]:29500/p/q", "::1", 29500, "p/q"),
        ("[fe80::1%eth0]:1/x", "fe80::1%eth0", 1, "x"),
    ],
)
def test_parse_store_addr(text: str, host: str, port: int, prefix: str) -> None:
    a = parse_store_addr(text)
    assert (a.host, a.port, a.prefix) == (host, port, prefix)
    assert parse_store_addr(str(a)) == a


@pytest.mark.parametrize("bad", ["nohost", ":12/x", "::1:29500/x", "[::1]29500", "h:notaport/x", "h:0/x", "h:70000"])
def test_parse_store_addr_rejects_with_the_address_in_the_message(bad: str) -> None:
    with pytest.raises(ValueError, match="store address|port"):
        parse_store_addr(bad)


def test_every_configure_gets_a_fresh_prefix_and_peers_agree(master: Any) -> None:
    a = addr(master)
    clients = StoreClients()
    s0, p0 = fresh_prefix_store(a, rank=0, quorum_id=4, group_rank=1, timeout=T(seconds=5), clients=clients)
    s1, p1 = fresh_prefix_store(a, rank=1, quorum_id=4, group_rank=1, timeout=T(seconds=5), clients=clients)
    assert p0 == p1 and "q4" in p0 and "g1" in p0  # the two ranks of one configure meet
    s0.set("k", b"old")
    s0b, p0b = fresh_prefix_store(a, rank=0, quorum_id=4, group_rank=1, timeout=T(seconds=5), clients=clients)
    assert p0b != p0  # the same (quorum, group rank) again: never the same keys
    assert s0b.check(["k"]) is False
    _, other_q = fresh_prefix_store(a, rank=0, quorum_id=5, group_rank=1, timeout=T(seconds=5), clients=clients)
    _, other_g = fresh_prefix_store(a, rank=0, quorum_id=4, group_rank=2, timeout=T(seconds=5), clients=clients)
    assert len({p0, p0b, other_q, other_g}) == 4


# ------------------------------------------------------------------ contract


def test_is_a_torch_process_group_and_reports_configured_rank_and_size(master: Any) -> None:
    pgs = [ProcessGroupGloo(timeout=T(seconds=10)) for _ in range(2)]
    assert isinstance(pgs[0], dist.ProcessGroup)
    assert (pgs[1].rank(), pgs[1].size()) == (0, 1)  # before configure
    configure_threads(pgs, addr(master), quorum_id=3)
    assert [(p.rank(), p.size()) for p in pgs] == [(0, 2), (1, 2)]
    assert "quorum=3" in repr(pgs[1])
    # a reconfigure to a 1-rank group updates both
    pgs[1].configure(addr(master), "replica1", 0, 1, quorum_id=4)
    assert (pgs[1].rank(), pgs[1].size()) == (0, 1)
    for p in pgs:
        p.shutdown()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
def test_configure_over_ipv6_store_address() -> None:
    master6 = dist.TCPStore("::1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=10))
    pg = ProcessGroupGloo(timeout=T(seconds=10))
    pg.configure(f"[::1]:{master6.port}/v6", "r", 0, 1, quorum_id=1)
    t = torch.tensor([2.0])
    pg.allreduce([t], ReduceOp.AVG).wait()
    assert t.tolist() == [2.0]
    pg.shutdown()


def test_ops_before_configure_raise_clearly() -> None:
    pg = ProcessGroupGloo()
    with pytest.raises(NotConfiguredError, match="allreduce .*before configure"):
        pg.allreduce([torch.ones(1)])
    with pytest.raises(ValueError, match="rank 3 is not in a group of 2"):
        pg.configure("127.0.0.1:1/x", "r", 3, 2)


def test_wait_times_out_with_op_peers_and_quorum_in_the_error(master: Any) -> None:
    pgs = [ProcessGroupGloo(timeout=T(seconds=0.5)) for _ in range(2)]
    configure_threads(pgs, addr(master), quorum_id=11)
    start = time.monotonic()
    work = pgs[0].allreduce([torch.ones(3)])  # rank 1 never joins the op
    with pytest.raises(ProcessGroupTimeout, match=r"allreduce among 2 peers in quorum 11 .*timed out") as ei:
        work.wait()
    assert time.monotonic() - start < 3.0
    assert (ei.value.op, ei.value.world_size, ei.value.quorum_id) == ("allreduce", 2, 11)
    assert pgs[0].errored() is ei.value
    # an explicit shorter wait timeout is honoured too
    w2 = pgs[1].barrier()
    t0 = time.monotonic()
    with pytest.raises(ProcessGroupError):
        w2.wait(T(seconds=0.2))
    assert time.monotonic() - t0 < 2.0
    # reconfigure clears errored()
    configure_threads(pgs, addr(master), quorum_id=12)
    assert pgs[0].errored() is None and pgs[1].errored() is None
    for p in pgs:
        p.shutdown()


def test_abort_fails_later_ops_until_reconfigure(master: Any) -> None:
    pg = ProcessGroupGloo(timeout=T(seconds=5))
    pg.configure(addr(master), "r", 0, 1, quorum_id=1)
    pg.abort()
    assert isinstance(pg.errored(), ProcessGroupAborted)
    with pytest.raises(ProcessGroupAborted, match="aborted"):
        pg.allreduce([torch.ones(1)]).wait()
    pg.configure(addr(master), "r", 0, 1, quorum_id=2)
    assert pg.errored() is None
    t = torch.ones(2)
    pg.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0]
    pg.set_timeout(T(seconds=7))
    assert pg.timeout() == T(seconds=7)
    pg.shutdown()
    with pytest.raises(NotConfiguredError):
        pg.allreduce([t])


def test_configure_fails_within_timeout_when_peers_never_come(master: Any) -> None:
    pg = ProcessGroupGloo(timeout=T(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(ProcessGroupError, match=r"configure of ProcessGroupGloo \(rank 0 of 2, quorum 9"):
        pg.configure(addr(master), "r", 0, 2, quorum_id=9)
    assert time.monotonic() - t0 < 5
    assert pg.errored() is not None
    pg.shutdown()


# ------------------------------------------------------------------ dummy / wrappers


def test_dummy_completes_at_once_and_lets_ddp_construct() -> None:
    pg = ProcessGroupDummy(rank=1, world_size=4)
    assert (pg.rank(), pg.size()) == (1, 4)
    t = torch.ones(2)
    w = pg.allreduce([t])
    assert w.wait() and w.is_completed()
    assert w.get_future().wait() == [t]
    outs = [[torch.zeros(2) for _ in range(4)]]
    pg.allgather(outs, [torch.tensor([1.0, 2.0])]).wait()
    assert all(o.tolist() == [1.0, 2.0] for o in outs[0])
    model = torch.nn.Linear(3, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy())
    ddp(torch.ones(4, 3)).sum().backward()
    assert model.weight.grad is not None


def test_ddp_built_on_dummy_averages_through_our_group_in_a_comm_hook(master: Any) -> None:
    """The integration pattern (as torchft's): DDP is constructed on a dummy group,
    gradients go through our group's Work futures in a comm hook. (torch's C++ side
    reads a Python group's size as 1, so DDP's built-in reducer cannot run on a
    reconfigurable group directly.)"""
    pgs = [ProcessGroupGloo(timeout=T(seconds=10)) for _ in range(2)]
    configure_threads(pgs, addr(master))
    grads: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]

    def hook(pg, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        return pg.allreduce([bucket.buffer()], ReduceOp.AVG).get_future().then(lambda f: f.value()[0])

    def train(r: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy())
        ddp.register_comm_hook(pgs[r], hook)
        ddp(torch.full((1, 3), float(r + 1))).sum().backward()
        grads[r] = model.weight.grad.clone()

    ts = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    # averaged: ((1,1,1) + (2,2,2)) / 2
    assert grads[0].tolist() == grads[1].tolist() == [[1.5, 1.5, 1.5]]
    for p in pgs:
        p.shutdown()


def test_fake_wrapper_injects_one_failure_and_the_group_stays_broken_until_configure() -> None:
    """As after a real failure, no later op is issued until the group is reconfigured: an
    issued one would pair with the peers' injected-away op (another size: in gloo, SIGABRT)."""
    inner = ProcessGroupDummy(0, 2)
    fake = FakeProcessGroupWrapper(inner)
    assert (fake.rank(), fake.size()) == (0, 2)
    fake.inject(RuntimeError("boom"))
    w = fake.allreduce([torch.ones(1)])
    with pytest.raises(RuntimeError, match="boom"):
        w.wait()
    with pytest.raises(RuntimeError, match="boom"):
        w.get_future().wait()
    later = fake.allreduce([torch.ones(2)])
    with pytest.raises(ProcessGroupError, match="not issued: an earlier op"):
        later.wait()
    assert inner.ops == 0 and fake.injected == 1
    fake.configure("", "r", 0, 2, quorum_id=2)
    assert fake.allreduce([torch.ones(1)]).wait() and inner.ops == 1  # fired once; a new configuration works
    fake.inject(ValueError("at call"), on="call")
    with pytest.raises(ValueError, match="at call"):
        fake.broadcast([torch.ones(1)])
    assert inner.ops == 1 and fake.injected == 2


def test_error_swallowing_records_first_error_and_noops_until_reconfigure(master: Any) -> None:
    inner = ProcessGroupGloo(timeout=T(seconds=5))
    fake = FakeProcessGroupWrapper(inner)
    pg = ErrorSwallowingProcessGroupWrapper(fake)
    pg.configure(addr(master), "r", 0, 1, quorum_id=1)
    fake.inject(RuntimeError("first"))
    t = torch.tensor([3.0])
    assert pg.allreduce([t]).wait()  # swallowed
    assert "first" in str(pg.errored())
    fake.inject(RuntimeError("second"), on="call")
    w = pg.allreduce([t])  # a no-op now: the injection is not consumed
    assert w.wait() and "first" in str(pg.errored())
    assert fake.injected == 1
    pg.configure(addr(master), "r", 0, 1, quorum_id=2)
    assert pg.errored() is None
    w = pg.allreduce([t])  # the pending "second" fires at call and is swallowed
    assert w.wait() and "second" in str(pg.errored())
    pg.configure(addr(master), "r", 0, 1, quorum_id=3)
    fut = pg.allreduce([t], ReduceOp.AVG).get_future()
    assert fut.wait()[0].tolist() == [3.0] and pg.errored() is None
    pg.shutdown()


class _Comm:
    """Satisfies ManagedCollectives: averages over ``n`` participants of equal value."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor) -> Work:
        self.calls += 1
        return CompletedWork([tensor])  # average of identical tensors: unchanged

    def num_participants(self) -> int:
        return self.n

    def participating_rank(self) -> int:
        return 2


def test_managed_group_routes_allreduce_through_the_protocol() -> None:
    comm = _Comm(3)
    assert isinstance(comm, ManagedCollectives)
    pg = ManagedProcessGroup(comm)
    assert (pg.rank(), pg.size()) == (2, 3)
    t = torch.tensor([2.0])
    pg.allreduce([t], ReduceOp.AVG).wait()
    assert t.tolist() == [2.0]
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.SUM
    assert pg.allreduce([t], o).get_future().wait()[0].tolist() == [6.0]
    dist.all_reduce(t, group=pg)  # torch's own call path
    assert t.tolist() == [18.0] and comm.calls == 3
    with pytest.raises(NotImplementedError, match="MAX"):
        pg.allreduce([t], ReduceOp.MAX)
    with pytest.raises(NotImplementedError, match="does not support broadcast"):
        pg.broadcast([t])
    with pytest.raises(TypeError, match="num_participants"):
        ManagedProcessGroup(object())  # type: ignore[arg-type]


def test_baby_abort_kills_the_child_and_reconfigure_replaces_it(master: Any) -> None:
    from rallypoint.process_groups import ProcessGroupBabyGloo

    pg = ProcessGroupBabyGloo(timeout=T(seconds=10))
    pg.configure(addr(master), "r", 0, 1, quorum_id=1)
    first = pg.child_pid()
    t = torch.tensor([4.0, 6.0])
    pg.allreduce([t], ReduceOp.AVG).wait()
    assert t.tolist() == [4.0, 6.0]
    pg.abort()
    assert isinstance(pg.errored(), ProcessGroupAborted)
    with pytest.raises(FileNotFoundError):  # killed and reaped
        open(f"/proc/{first}/stat").close()
    with pytest.raises(ProcessGroupAborted):
        pg.allreduce([t]).wait()
    pg.configure(addr(master), "r", 0, 1, quorum_id=2)
    second = pg.child_pid()
    assert second != first and pg.errored() is None
    pg.allreduce([t]).wait()
    assert t.tolist() == [4.0, 6.0]
    pg.shutdown()
    with pytest.raises(FileNotFoundError):
        open(f"/proc/{second}/stat").close()


def test_baby_abort_of_a_child_reaped_meanwhile_raises_nothing(master: Any) -> None:
    """The reader thread may reap a dying child (reading its exit code) between abort's
    ``is_alive()`` and its kill: abort still ends quietly, the group reads aborted, and a
    configure replaces the child (it raised ProcessLookupError: a CI failure)."""
    from rallypoint.process_groups import ProcessGroupBabyGloo

    pg = ProcessGroupBabyGloo(timeout=T(seconds=10))
    pg.configure(addr(master), "r", 0, 1, quorum_id=1)
    proc = pg._proc
    assert proc is not None
    proc.kill()
    proc.join(10)  # reaped here, as the reader thread would
    assert proc.exitcode is not None
    proc.is_alive = lambda: True  # type: ignore[method-assign]  # what abort saw just before
    pg.abort()
    assert isinstance(pg.errored(), ProcessGroupAborted)
    pg.configure(addr(master), "r", 0, 1, quorum_id=2)
    t = torch.tensor([1.0, 3.0])
    pg.allreduce([t], ReduceOp.AVG).wait()
    assert t.tolist() == [1.0, 3.0] and pg.errored() is None
    pg.shutdown()


# ------------------------------------------------------------------ waiting: in the backend first, then on an event


def _later(delay_s: float, fn: Any) -> threading.Thread:
    """Run ``fn`` on a thread after ``delay_s`` (a peer that joins the op late)."""
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()))
    t.start()
    return t


@pytest.mark.parametrize("late_s", [0.0, 0.05])  # within the first wait in the backend; past it, on the event
def test_a_wait_returns_the_mean_once_and_a_second_wait_returns_at_once(master: Any, late_s: float) -> None:
    pgs = [ProcessGroupGloo(timeout=T(seconds=10)) for _ in range(2)]
    configure_threads(pgs, addr(master))
    a, b = torch.full((3,), 1.0), torch.full((3,), 3.0)
    avg = AllreduceOptions()
    avg.reduceOp = ReduceOp.AVG  # type: ignore[assignment]  # stubs: RedOpType
    peer: list[Work] = []
    joiner = _later(late_s, lambda: peer.append(pgs[1].allreduce([b], avg)))
    work = pgs[0].allreduce([a], avg)
    assert work.wait() is True
    joiner.join(10)
    assert peer[0].wait() is True
    assert a.tolist() == b.tolist() == [2.0, 2.0, 2.0]  # divided once, whichever wait saw it
    t0 = time.monotonic()
    assert work.wait() is True and peer[0].wait() is True
    assert time.monotonic() - t0 < 1.0  # a finished work's event is set on either path
    assert a.tolist() == [2.0, 2.0, 2.0]
    for p in pgs:
        p.shutdown()


def test_waiters_of_one_work_on_two_threads_both_see_it_finish(master: Any) -> None:
    pgs = [ProcessGroupGloo(timeout=T(seconds=10)) for _ in range(2)]
    configure_threads(pgs, addr(master))
    t0, t1 = torch.ones(2), torch.ones(2)
    work = pgs[0].allreduce([t0])
    seen: list[bool] = []
    other = threading.Thread(target=lambda: seen.append(work.wait()))
    other.start()
    joiner = _later(0.05, lambda: pgs[1].allreduce([t1]).wait())
    assert work.wait() is True
    other.join(10)
    joiner.join(10)
    assert seen == [True] and t0.tolist() == [2.0, 2.0]
    for p in pgs:
        p.shutdown()


def test_an_abort_past_the_first_wait_releases_the_waiter_at_once(master: Any) -> None:
    pgs = [ProcessGroupGloo(timeout=T(seconds=20)) for _ in range(2)]
    configure_threads(pgs, addr(master), quorum_id=5)
    work = pgs[0].allreduce([torch.ones(1)])  # rank 1 never joins
    aborter = _later(0.2, pgs[0].abort)
    t0 = time.monotonic()
    with pytest.raises(ProcessGroupAborted):
        work.wait()
    assert time.monotonic() - t0 < 3.0  # not the group's 20 s timeout
    aborter.join(10)
    pgs[1].abort()


def test_a_late_sender_does_not_fail_the_receivers_wait(master: Any) -> None:
    # A send or recv has no future: it gets no short first wait in the backend (gloo
    # fails a send or recv whose limited wait runs out), only the op's whole timeout.
    pgs = [ProcessGroupGloo(timeout=T(seconds=10)) for _ in range(2)]
    configure_threads(pgs, addr(master))
    got = torch.zeros(4)
    sender = _later(0.05, lambda: pgs[0].send([torch.arange(4.0)], 1).wait())
    assert pgs[1].recv([got], 0).wait() is True
    sender.join(10)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
    for p in pgs:
        p.shutdown()
