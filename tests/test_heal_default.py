"""Heals with the default Manager arguments never read FSDP2 state mid-step, and never
livelock (issue 41, item 3).

* The decision (``rallypoint/manager/_heal_thread.py``): a table for the pure function,
  the state inspection, and its caching (the state is read once per registration, on the
  training thread).
* The livelock that kept ``heal_on_training_thread`` opt-in: a state served on the
  training thread and frozen after the vote must stay fetchable until its receivers have
  it, a newer state replaces it, or it expires. Two ways it was withdrawn under a receiver
  that had not asked yet: a state with no data bytes counted as delivered at once (HTTP 410
  every round: tests/test_pg_reconfigure_manager.py's grow), and the next round's
  ``disallow_checkpoint`` withdrew a frozen state nobody had asked for yet.
* A real FSDP2 model (``fully_shard``, gloo, CPU), default Manager arguments, a sender
  whose forward is slow: the late replica heals, both end identical, and the state-dict
  callbacks ran only on each replica's training thread, never during forward.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from rallypoint.manager._heal import Healer
from rallypoint.manager._heal_thread import HealThread, decide, heal_thread, holds_dtensor
from rallypoint.transports.http import HTTPTransport, SourceRefused, TransferError
from replica_pair import done_together, early_then_late



# ------------------------------------------------------------------ the decision
@pytest.mark.parametrize("requested,holds,want", [
    (True, False, True), (True, True, True), (True, None, True),        # asked for: as asked
    (False, True, False), (False, False, False), (False, None, False),
    (None, True, True),    # DTensors (FSDP2): never read while forward swaps them
    (None, False, False),  # plain state: overlapped with forward, as before
    (None, None, True),    # could not be read: the safe choice
])
def test_which_thread_heals(requested: bool | None, holds: bool | None, want: bool) -> None:
    on, why = heal_thread(requested, holds)
    assert on is want and why


def test_holds_dtensor_walks_nested_state(mesh1: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    dt = distribute_tensor(torch.ones(4), mesh1, [Shard(0)])
    assert not holds_dtensor({"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"m": torch.ones(2)}},
                                                                        "param_groups": [{"lr": 0.1}]}})
    assert holds_dtensor({"optim": {"state": {0: {"exp_avg": dt}}, "param_groups": []}})
    assert holds_dtensor({"x": [1, (2, dt)]})
    assert not holds_dtensor(3) and not holds_dtensor(None)


def test_auto_reads_the_state_once_per_registration() -> None:
    reads: list[int] = []
    log = logging.getLogger("t")

    def read() -> Any:
        reads.append(1)
        return {"w": torch.ones(1)}

    h = HealThread(None)
    assert h.on is False and h.requested is None
    h.at_boundary(read, has_state=False, log=log)  # nothing registered yet: nothing to read
    assert reads == []
    for _ in range(5):  # cached: one read for many steps
        h.at_boundary(read, has_state=True, log=log)
    assert reads == [1] and h.on is False and "no DTensor" in h.why
    h.registered()  # another callback: decided again at the next boundary
    h.at_boundary(read, has_state=True, log=log)
    assert reads == [1, 1]
    h.set(True)  # an explicit setting wins at once and reads nothing
    h.registered()
    h.at_boundary(read, has_state=True, log=log)
    assert h.on is True and reads == [1, 1]
    h.set(None)  # back to auto
    h.at_boundary(read, has_state=True, log=log)
    assert h.on is False and reads == [1, 1, 1]


def test_auto_picks_the_training_thread_when_the_state_cannot_be_read() -> None:
    def boom() -> Any:
        raise RuntimeError("not ready")

    assert decide(None, boom)[0] is True
    assert decide(False, boom) == (False, heal_thread(False, None)[1])  # explicit: never read


# ------------------------------------------------------------------ the livelock, in the transport
def _transport() -> HTTPTransport:
    return HTTPTransport(timeout=timedelta(seconds=10), bind="127.0.0.1:0", advertise_host="127.0.0.1",
                         publish_wait=timedelta(0))


def _healer(tr: HTTPTransport) -> Healer:
    return Healer(tr, 0, timedelta(seconds=10), timedelta(seconds=5), logging.LoggerAdapter(logging.getLogger("t")))


def _q(step: int) -> Any:
    return SimpleNamespace(max_step=step, recover_dst_replica_ranks=[1], stripe_dst_replica_ranks=[])


def _fetch(rx: HTTPTransport, src: HTTPTransport, step: int) -> Any:
    """``rx`` fetches step ``step`` from ``src``."""
    return rx.recv_checkpoint(src_rank=0, metadata=src.metadata(), step=step, timeout=timedelta(seconds=5))


@pytest.mark.parametrize("state", [
    {"torchft": {"step": 3, "batches_committed": 6}, "user": {"default": {}}},  # no data bytes at all
    {"torchft": {"step": 3}, "user": {"default": {"w": torch.zeros(0)}}},       # only an empty tensor
], ids=["no_tensor", "empty_tensor"])
def test_a_state_with_no_data_stays_served_until_its_receiver_asks(state: dict[str, Any]) -> None:
    """The grow test's livelock: served on the training thread, frozen after the vote, and
    the receiver asks only afterwards (its step was slower). Before the fix it counted as
    delivered the moment it was served and was withdrawn at the freeze: 410."""
    tr, rx = _transport(), _transport()
    try:
        h = _healer(tr)
        h.serve(_q(3), state)
        h.after_vote(True)  # freeze_checkpoint: the sender's optimizer may step now
        got = _fetch(rx, tr, 3)
        assert got["torchft"]["step"] == 3 and got["user"]["default"].keys() == state["user"]["default"].keys()
        deadline = time.monotonic() + 5  # the receiver said done: now it goes
        while tr._served is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tr._served is None
        with pytest.raises((SourceRefused, TransferError), match="410"):
            _fetch(rx, tr, 3)
    finally:
        tr.shutdown()
        rx.shutdown()


def test_a_frozen_state_survives_the_next_rounds_disallow_until_its_receiver_has_it() -> None:
    """A sender served on the training thread (frozen after its vote), then took another
    step that served nothing (``disallow_checkpoint``) before the healing peer asked. The
    frozen copy must still be served, as it was at the vote, whatever the sender did since."""
    model = nn.Linear(1024, 512)  # 2 MiB weight: served live, copied by the freeze
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tr, rx = _transport(), _transport()
    try:
        h = _healer(tr)
        h.serve(_q(5), {"user": {"default": model.state_dict()}})
        h.after_vote(True)
        with torch.no_grad():  # the optimizer steps
            for p in model.parameters():
                p.add_(1.0)
        h.after_vote(False)  # the next round: nothing served, disallow_checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        got = _fetch(rx, tr, 5)["user"]["default"]
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    finally:
        tr.shutdown()
        rx.shutdown()


def test_a_frozen_state_nobody_asks_for_expires_and_a_newer_one_replaces_it() -> None:
    tr = HTTPTransport(timeout=timedelta(seconds=0.3), bind="127.0.0.1:0", advertise_host="127.0.0.1",
                       publish_wait=timedelta(0))
    rx = _transport()
    try:
        h = Healer(tr, 0, timedelta(seconds=0.3), timedelta(seconds=5), logging.LoggerAdapter(logging.getLogger("t")))
        h.serve(_q(1), {"user": {"w": torch.ones(300_000)}})
        h.after_vote(True)
        h.serve(_q(2), {"user": {"w": torch.full((300_000,), 2.0)}})  # a newer state replaces it
        h.after_vote(True)
        with pytest.raises((SourceRefused, TransferError), match="409: serving the checkpoint of step 2"):
            _fetch(rx, tr, 1)
        deadline = time.monotonic() + 5
        while tr._served is not None and time.monotonic() < deadline:  # expires after the timeout
            time.sleep(0.02)
        assert tr._served is None
        with pytest.raises((SourceRefused, TransferError), match="410"):
            _fetch(rx, tr, 2)
    finally:
        tr.shutdown()
        rx.shutdown()


# ------------------------------------------------------------------ the livelock, through Managers
def _manager(lh: Any, name: str, state_dict: Any, load: Any, **kw: Any) -> Any:
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    m = Manager(pg, load, state_dict, min_replica_size=1, rank=0, world_size=1, hostname="127.0.0.1",
                store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id=name,
                timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=20),
                connect_timeout=timedelta(seconds=10), **kw)
    return m, pg


def test_a_joiner_slower_to_ask_than_the_senders_step_heals_on_the_training_thread(lighthouse: Any,
                                                                                  monkeypatch: Any) -> None:
    """Very short steps on the sender; the joiner is slow to ask (its state_dict, which the
    fetch reads for ``into=``, takes 0.3 s). Before the fix every heal got HTTP 410 and the
    joiner never committed a step."""
    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")
    lh = lighthouse(min_replicas=1, join_timeout_ms=300)
    target = 12

    def run(name: str, slow: bool, started: threading.Event | None) -> tuple[int, bool, int]:
        def sd() -> dict[str, Any]:
            if slow:
                time.sleep(0.3)
            return {"meta": {"name": "x"}}

        m, pg = _manager(lh, name, sd, lambda s: None, heal_on_training_thread=True)
        refused = 0
        try:
            deadline = time.monotonic() + 60
            while not done_together(m, target) and time.monotonic() < deadline:
                if started is not None and m.current_step() >= 3:
                    started.set()
                m.start_quorum()
                m.allreduce(torch.ones(1)).wait()
                m.should_commit()
                refused += "410" in str(m.errored() or "")
            healed = any(r.healing and r.outcome == "committed" for r in m.step_records())
            return m.current_step(), healed, refused
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    (sa, ha, _), (sb, hb, refused) = early_then_late(lambda ahead: run("ll_a", False, ahead),
                                                     lambda: run("ll_b", True, None), "the sender never reached step 3")
    assert sa >= target and sb >= target, (sa, sb, refused)
    assert hb and not ha, (ha, hb)
    assert refused == 0, f"{refused} heals refused with HTTP 410"


# ------------------------------------------------------------------ a real FSDP2 model, default arguments
def test_fsdp2_state_heals_with_the_default_arguments_never_read_mid_forward(mesh1: Any, lighthouse: Any,
                                                                            monkeypatch: Any) -> None:
    """TorchTitan's way (``set_state_dict_fns``, torchft's arguments only): an FSDP2 model
    (``fully_shard``) whose forward is slow, so a quorum arrives while it runs. With the
    default ``heal_on_training_thread`` the Manager decides the training thread: the late
    replica heals, both end with identical parameters and optimizer state, and no
    ``state_dict`` callback ran off the training thread or during forward."""
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")
    lh = lighthouse(min_replicas=1, join_timeout_ms=300)
    target = 8
    bad: list[str] = []
    def replica(name: str, seed: int, started: threading.Event | None) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        fully_shard(model[0], mesh=mesh1)
        fully_shard(model[2], mesh=mesh1)
        fully_shard(model, mesh=mesh1)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        trainer = threading.current_thread()
        in_forward = threading.Event()

        def pre(mod: Any, args: Any) -> None:
            in_forward.set()
            time.sleep(0.03)  # a slow forward: the quorum arrives during it

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(lambda mod, args, out: in_forward.clear())

        def save() -> dict[str, Any]:
            if threading.current_thread() is not trainer or in_forward.is_set():
                bad.append(f"{name}: state_dict on {threading.current_thread().name} "
                           f"(forward running: {in_forward.is_set()})")
            return {"model": model.state_dict(), "optim": opt.state_dict()}

        def load(sd: dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        m, pg = _manager(lh, name, None, None)  # torchft's arguments only
        m.set_state_dict_fns(load, save)
        try:
            deadline = time.monotonic() + 60
            while not done_together(m, target) and time.monotonic() < deadline:
                if started is not None and m.current_step() >= 3:
                    started.set()
                m.start_quorum()
                g = torch.Generator().manual_seed(m.current_step())
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                for p in model.parameters():
                    m.allreduce(p.grad.to_local()).wait()  # type: ignore[union-attr]
                if m.should_commit():
                    opt.step()
            assert done_together(m, target), (f"{name} at step {m.current_step()}, no round committed with both "
                                              f"replicas: {m.errored()}")
            out: dict[str, Any] = {f"p.{n}": p.to_local().detach().clone()  # type: ignore[attr-defined]
                                   for n, p in model.named_parameters()}
            for i, p in enumerate(model.parameters()):
                for k, v in opt.state[p].items():
                    out[f"o.{i}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            out["auto"] = m.heal_on_training_thread
            out["healed"] = any(r.healing and r.outcome == "committed" for r in m.step_records())
            return out
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    sa, sb = early_then_late(lambda ahead: replica("fs_a", 1, ahead), lambda: replica("fs_b", 2, None),
                             "replica a never reached step 3")
    assert sa.pop("auto") is True and sb.pop("auto") is True  # decided: DTensors heal on the training thread
    assert sb.pop("healed") and not sa.pop("healed")
    assert bad == [], bad[:3]
    assert sorted(sa) == sorted(sb) and len(sa) >= 8
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_a_default_manager_reads_its_state_once_per_registration_to_decide(mesh1: Any, lighthouse: Any,
                                                                           monkeypatch: Any) -> None:
    """No per-step cost: the state-dict callbacks are called once, on the training thread,
    at the first ``start_quorum`` after a registration; plain state keeps the quorum thread,
    a registration that adds DTensors moves heals to the training thread."""
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setenv("RALLYPOINT_PG_HOST", "127.0.0.1")
    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    calls: list[str] = []

    def plain() -> dict[str, Any]:
        calls.append(threading.current_thread().name)
        return {"w": torch.ones(3)}

    m, pg = _manager(lh, "once", plain, lambda s: None)
    try:
        assert m.heal_on_training_thread is False  # undecided: nothing read yet
        for _ in range(5):
            m.start_quorum()
            m.allreduce(torch.ones(1)).wait()
            assert m.should_commit()
        assert calls == [threading.current_thread().name] and m.heal_on_training_thread is False
        dt = distribute_tensor(torch.ones(4), mesh1, [Shard(0)])
        m.register_state_dict_fn("fsdp", lambda s: None, lambda: {"p": dt})
        for _ in range(3):
            m.start_quorum()
            m.allreduce(torch.ones(1)).wait()
            assert m.should_commit()
        assert len(calls) == 2 and m.heal_on_training_thread is True
        m.heal_on_training_thread = False  # an explicit setting wins
        m.start_quorum()
        assert m.should_commit() and m.heal_on_training_thread is False and len(calls) == 2
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
