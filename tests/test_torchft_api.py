"""torchft's conveniences that rallypoint's own paths do not need, with torchft's meaning:
``ProcessGroup.broadcast_one``, ``Manager.wrap_future``, the state dict's read gate
(``disallow_state_dict_read`` / ``allow_state_dict_read``) and ``ddp.PureDistributedDataParallel``.

What a torchft user checks: the broadcast reaches the other rank from the root they named;
a wrapped future that fails or hangs yields the default and the step does not commit; a
healing peer never reads the state between disallow and allow (and the closer itself still
can); the pure DDP's gradients are averaged when ``backward()`` returns and the step commits.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from rallypoint.integrations.ddp import PureDistributedDataParallel
from rallypoint.manager import Manager
from rallypoint.manager._state import UserState
from rallypoint.process_groups import ProcessGroupGloo
from test_ddp import solo  # noqa: F401 - a one-replica Manager, shut down at teardown
from test_process_groups import addr, configure_threads, master  # noqa: F401 - the store fixture

T = timedelta


# ----------------------------------------------------------------- broadcast_one


def test_broadcast_one_sends_the_roots_tensor_to_the_other_rank(master: Any) -> None:  # noqa: F811
    pgs = [ProcessGroupGloo(timeout=T(seconds=10)) for _ in range(2)]
    configure_threads(pgs, addr(master), quorum_id=21)
    try:
        tensors = [torch.zeros(4), torch.arange(4, dtype=torch.float32) + 1]
        works: list[Any] = [None, None]
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                works[r] = pgs[r].broadcast_one(tensors[r], root=1)
                works[r].wait()
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not errors and not any(t.is_alive() for t in threads)
        assert torch.equal(tensors[0], torch.tensor([1.0, 2.0, 3.0, 4.0]))  # root 1's tensor, not rank 0's
    finally:
        for p in pgs:
            p.shutdown()


# ----------------------------------------------------------------- the read gate


def _state() -> tuple[UserState, list[str]]:
    st = UserState(read_timeout_s=5.0)
    reads: list[str] = []

    def save() -> dict[str, int]:
        reads.append(threading.current_thread().name)
        return {"x": 1}

    st.register("k", lambda sd: None, save)
    return st, reads


def test_a_read_waits_while_another_thread_disallows_and_goes_on_after_allow() -> None:
    st, reads = _state()
    st.disallow_read()
    got: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: got.append(st.snapshot(dict)), name="quorum")
    reader.start()
    reader.join(timeout=0.3)
    assert reader.is_alive() and reads == []  # nothing was read while disallowed
    st.allow_read()
    reader.join(timeout=10)
    assert not reader.is_alive() and reads == ["quorum"] and got[0]["user"] == {"k": {"x": 1}}


def test_the_thread_that_disallowed_still_reads() -> None:
    st, reads = _state()
    st.disallow_read()
    assert st.snapshot(dict)["user"] == {"k": {"x": 1}}  # a heal served on the training thread
    st.disallow_read()  # a no-op when already disallowed
    st.allow_read()
    st.allow_read()  # and when already allowed
    assert st.read_allowed()


def test_a_read_disallowed_too_long_times_out_and_reads_nothing() -> None:
    st, reads = _state()
    st.read_timeout_s = 0.2
    st.disallow_read()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            st.snapshot(dict)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    t0 = time.monotonic()
    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive() and time.monotonic() - t0 < 5
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    assert "disallow_state_dict_read" in str(errors[0]) and reads == []
    st.allow_read()


def test_disallow_waits_for_a_read_in_progress() -> None:
    st = UserState(read_timeout_s=5.0)
    inside, release = threading.Event(), threading.Event()

    def slow_save() -> int:
        inside.set()
        release.wait(10)
        return 1

    st.register("k", lambda sd: None, slow_save)
    reader = threading.Thread(target=lambda: st.snapshot(dict))
    reader.start()
    assert inside.wait(10)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (st.disallow_read(), closed.set()))
    closer.start()
    assert not closed.wait(0.3)  # the read is still in progress
    release.set()
    assert closed.wait(10)
    reader.join(timeout=10)
    closer.join(timeout=10)


# ----------------------------------------------------------------- a real Manager


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))


def test_wrap_future_passes_a_value_and_turns_a_failure_or_a_timeout_into_the_default(solo: Any) -> None:  # noqa: F811
    model = _mlp()
    m = solo(ProcessGroupGloo(timeout=T(seconds=5)), model, torch.optim.SGD(model.parameters(), lr=0.1))
    m.start_quorum()
    ok: torch.futures.Future[int] = torch.futures.Future()
    wrapped = m.wrap_future(ok, default=-1)
    ok.set_result(7)
    assert wrapped.wait() == 7 and m.errored() is None

    bad: torch.futures.Future[int] = torch.futures.Future()
    wrapped = m.wrap_future(bad, default=-1)
    bad.set_exception(RuntimeError("peer gone"))
    assert wrapped.wait() == -1
    assert "peer gone" in str(m.errored())
    assert m.should_commit() is False  # the reported error fails the step

    m.start_quorum()
    hung: torch.futures.Future[int] = torch.futures.Future()
    t0 = time.monotonic()
    assert m.wrap_future(hung, default=-2, timeout=T(seconds=0.2)).wait() == -2
    assert time.monotonic() - t0 < 4
    assert isinstance(m.errored(), TimeoutError)
    assert m.should_commit() is False


class _LazyMean:
    """A work that averages its tensor with a peer's only when waited for (as a real
    asynchronous allreduce completes later): the peer's gradient is 3x ours."""

    def __init__(self, t: torch.Tensor, log: list[str]) -> None:
        self.t, self.log = t, log

    def wait(self) -> bool:
        self.t.mul_(2.0)  # (g + 3g) / 2
        self.log.append("wait")
        return True


class _FakeManager:
    def __init__(self) -> None:
        self.log: list[str] = []

    def allreduce(self, tensor: torch.Tensor, /, **_: Any) -> _LazyMean:
        self.log.append("post")
        return _LazyMean(tensor, self.log)

    def report_error(self, e: Exception) -> None:
        raise AssertionError(f"unexpected error: {e}")


def test_pure_ddp_waits_every_gradient_before_backward_returns() -> None:
    fake = _FakeManager()
    model, plain = _mlp(), _mlp()
    ddp = PureDistributedDataParallel(fake, model)  # type: ignore[arg-type]
    x = torch.randn(4, 5)
    for step in range(2):  # twice: the wait is queued again at each backward
        fake.log.clear()
        model.zero_grad()
        plain.zero_grad()
        ddp(x).sum().backward()
        plain(x).sum().backward()
        n = len(list(model.parameters()))
        assert fake.log.count("post") == n and fake.log.count("wait") == n, (step, fake.log)
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.allclose(p.grad, 2.0 * q.grad)  # type: ignore[operator]


def test_pure_ddp_trains_and_commits_with_a_real_manager(solo: Any) -> None:
    model, plain = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    m = solo(ProcessGroupGloo(timeout=T(seconds=5)), model, opt)
    ddp = PureDistributedDataParallel(m, model)
    x = torch.randn(4, 5)
    for _ in range(3):
        m.start_quorum()
        opt.zero_grad()
        popt.zero_grad()
        ddp(x).sum().backward()
        plain(x).sum().backward()
        assert m.should_commit()
        opt.step()
        popt.step()
    assert m.current_step() == 3
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p, q)  # the mean over the one replica is its own gradient
