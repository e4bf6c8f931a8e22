"""Heal failures are retried, not fatal (issue 41): a source that dies mid-transfer is
replaced by another source of the same quorum; when every source fails, the heal fails
this step only and the next quorum retries after a growing backoff; DiLoCo's start round
retries for as long as the manager's quorum timeout allows, not 5 times."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from rallypoint.manager import _heal
from rallypoint.manager._heal import Healer
from rallypoint.manager._retry import heal_backoff_s, keep_retrying, retry_pause_s, source_order
from rallypoint.transports.http import HTTPTransport

LOG = logging.LoggerAdapter(logging.getLogger("test"))


@pytest.mark.parametrize("failures,want", [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.4), (6, 3.2), (7, 5.0), (1000, 5.0)])
def test_heal_backoff_table(failures: int, want: float) -> None:
    assert heal_backoff_s(failures) == pytest.approx(want)


@pytest.mark.parametrize("assigned,sources,failed,want", [
    (1, [0, 1, 2], set(), [1, 0, 2]),
    (1, [0, 1, 2], {1}, [0, 2]),
    (1, [0, 1, 2], {0, 1, 2}, []),
    (3, [], set(), [3]),  # a transport that does not stripe: the assigned source only
    (3, [], {3}, []),
])
def test_source_order_table(assigned: int, sources: list[int], failed: set[int], want: list[int]) -> None:
    assert source_order(assigned, sources, failed) == want


@pytest.mark.parametrize("started,now,budget,attempt,keep,pause", [
    (0.0, 1.0, 60.0, 1, True, 0.05),
    (0.0, 1.0, 60.0, 8, True, 1.0),  # more than 5 attempts: still retrying
    (0.0, 59.5, 60.0, 20, True, 0.5),  # never past the budget
    (0.0, 60.0, 60.0, 3, False, 0.0),
])
def test_start_round_retry_table(started: float, now: float, budget: float, attempt: int, keep: bool,
                                 pause: float) -> None:
    assert keep_retrying(started, now, budget) is keep
    assert retry_pause_s(attempt, started, now, budget) == pytest.approx(pause)


# ------------------------------------------------------------------ a source dies mid-transfer
def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"user": {"default": {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(7, generator=g)}},
            "torchft": {"step": 5, "batches_committed": 10}}


@pytest.fixture
def sources() -> Iterator[tuple[HTTPTransport, HTTPTransport, HTTPTransport]]:
    def make() -> HTTPTransport:
        return HTTPTransport(timeout=timedelta(seconds=10), bind="127.0.0.1:0", advertise_host="127.0.0.1",
                             retries=0)

    made = [make(), make(), make()]
    yield made[0], made[1], made[2]
    for t in made:
        t.shutdown(wait=False)


def _dies_mid_transfer(t: HTTPTransport) -> list[int]:
    """Make ``t`` send the first piece of any body, then drop the connection."""
    orig = t._pieces
    calls: list[int] = []

    def dying(served: Any, start: int, end: int, with_header: bool, *kind: Any) -> Iterator[memoryview]:
        it = orig(served, start, end, with_header, *kind)
        calls.append(start)
        if with_header:
            yield next(it)
        else:
            piece = next(it)
            yield piece[: max(1, len(piece) // 2)]
        raise ConnectionResetError("test: the source died mid-transfer")

    t._pieces = dying  # type: ignore[method-assign]
    return calls


def _quorum(dead_first: bool = True) -> Any:
    return SimpleNamespace(quorum_id=3, max_step=5, recover_src_replica_rank=0,
                           recover_src_manager_address="A", recover_src_replica_ranks=[0, 1],
                           recover_src_manager_addresses=["A", "B"])


@pytest.mark.parametrize("stripe", ["0", "1"], ids=["one_source_at_a_time", "striped"])
def test_a_source_dying_mid_transfer_is_replaced_by_another(sources: Any, monkeypatch: Any, stripe: str) -> None:
    a, b, me = sources
    monkeypatch.setenv(_heal.STRIPE_ENV, stripe)
    state = _state()
    for t in (a, b):
        t.send_checkpoint(dst_ranks=[2], step=5, state_dict=state, timeout=timedelta(seconds=10))
    died = _dies_mid_transfer(a)
    healer = Healer(me, 0, timedelta(seconds=20), timedelta(seconds=5), LOG)
    monkeypatch.setattr(healer, "_metadata", lambda addr, timeout: {"A": a.metadata(), "B": b.metadata()}[addr])
    got = healer.fetch(_quorum())
    assert died, "the assigned source was asked first"
    for k, v in state["user"]["default"].items():
        assert torch.equal(got["user"]["default"][k], v), k
    assert healer.failed_heals == 0 and healer.backoff_s() == 0.0  # a source failing is no failed heal


def test_every_source_failing_fails_this_heal_and_backs_off(sources: Any, monkeypatch: Any) -> None:
    a, b, me = sources
    monkeypatch.setenv(_heal.STRIPE_ENV, "0")
    for t in (a, b):
        t.send_checkpoint(dst_ranks=[2], step=5, state_dict=_state(), timeout=timedelta(seconds=10))
        _dies_mid_transfer(t)
    healer = Healer(me, 0, timedelta(seconds=20), timedelta(seconds=5), LOG)
    monkeypatch.setattr(healer, "_metadata", lambda addr, timeout: {"A": a.metadata(), "B": b.metadata()}[addr])
    for n in (1, 2):
        with pytest.raises(RuntimeError, match=r"failed from every source tried \(replica ranks \[0, 1\]\)"):
            healer.fetch(_quorum())
        assert healer.failed_heals == n
    assert healer.backoff_s() == pytest.approx(0.2)


# ------------------------------------------------------------------ DiLoCo's start round
def _diloco_start(lh: Any, fail_rounds: int, timeout_s: float) -> tuple[Any, int, float]:
    from diloco_worker import make_manager
    from rallypoint.integrations.local_sgd import DiLoCo

    m, pg = make_manager(lh.address(), "solo", 1, timeout_s=timeout_s)  # quorum timeout: 2 x timeout_s
    left = [fail_rounds]
    orig = m.should_commit

    def should_commit(*a: Any, **k: Any) -> bool:
        if left[0] > 0:
            left[0] -= 1
            m.report_error(RuntimeError("test: the start round failed"))
        return bool(orig(*a, **k))

    m.should_commit = should_commit
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    t0 = time.monotonic()
    try:
        with DiLoCo(m, [model], inner, outer, sync_every=2):
            model(torch.ones(4, 3)).sum().backward()
            inner.step()  # the start round runs as the first inner step begins
        return m, fail_rounds - left[0], time.monotonic() - t0
    finally:
        m.shutdown(wait=False)
        pg.shutdown()


def test_diloco_start_round_survives_more_than_5_failed_rounds(lighthouse) -> None:
    lh = lighthouse(min_replicas=1)
    m, failed, _ = _diloco_start(lh, fail_rounds=8, timeout_s=10.0)
    assert failed == 8
    assert m._setup_rounds == 1 and m.current_step() == 0  # the start round committed, after 8 failures


def test_diloco_start_round_gives_up_at_the_quorum_timeout(lighthouse) -> None:
    lh = lighthouse(min_replicas=1)
    with pytest.raises(RuntimeError, match=r"start round failed \d+ times over .* the quorum timeout \(2 s\)"):
        _diloco_start(lh, fail_rounds=10**6, timeout_s=1.0)


class _Foreign:
    """A transport of someone else's (torchft's signature): no into=/mesh=."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        return {}


class _Kw:
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta, **kw: Any) -> Any:
        return kw


@pytest.mark.parametrize("transport,takes", [(HTTPTransport, True), (_Foreign, False), (_Kw, True), (object, False)])
def test_into_and_mesh_go_only_to_a_transport_that_takes_them(transport: Any, takes: bool) -> None:
    from rallypoint.manager._heal import _takes_into
    from rallypoint.transports.pg import PGTransport

    assert _takes_into(PGTransport)
    assert _takes_into(transport) is takes


# ------------------------------------------------------------------ end to end
def test_source_dying_mid_transfer_the_joiner_heals_from_the_other_and_the_job_goes_on(lighthouse,
                                                                                       tmp_path) -> None:
    """Three replica processes; replica_0 (the joiner's assigned source) dies after sending
    part of the heal's data. Striping off, so the joiner fetches from one source at a time:
    it turns to replica_1, heals, and the job goes on; everyone ends identical."""
    from replica_worker import Replicas

    lh = lighthouse(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=30_000)
    r = Replicas(tmp_path, lh.address(), env={_heal.STRIPE_ENV: "0"})
    try:
        opts: dict[str, Any] = {"delay": 0.05, "timeout": 10, "width": 80_000}  # a 1.3 MB weight
        sender = r.start("replica_0", seed=1, fault={"at": "mid_transfer", "step": 3}, **opts)
        r.start("replica_1", seed=2, **opts)
        r.wait_for("two replicas at step 3", lambda: min(r.step("replica_0"), r.step("replica_1")) >= 3, 30)
        r.start("replica_2", seed=3, **opts)
        assert r.wait_dead(sender, 30) == -9, r.logs()
        r.wait_for("replica_2 healed", lambda: r.step("replica_2") >= 4, 30)
        names = ["replica_1", "replica_2"]
        target = max(r.step(x) for x in names) + 3
        r.finish(target, timeout=30)
        r.assert_identical(names, target)
        healer = "".join(f.read_text() for f in r.tmp.glob("replica_2.*.log"))
        assert "heal from replica rank 0 failed" in healer, healer[-4000:]  # the source did die mid-heal
        assert "trying another source" in healer, healer[-4000:]  # in the same quorum, not only the next
        assert "healing to step" in healer and "from replica rank 1" in healer, healer[-4000:]
    finally:
        r.kill_all()


def test_a_received_state_that_cannot_be_applied_backs_off_and_an_applied_one_resets() -> None:
    """A heal is done once its state is applied: a state that fails to apply counts like a
    failed fetch (the backoff grows), one that applies starts the backoff over."""
    from rallypoint.manager._heal_step import heal_here
    from rallypoint.manager._record import Round, StepRecord
    from rallypoint.manager._state import UserState

    healer = SimpleNamespace(failed_heals=0)
    loaded: list[Any] = []
    fail = [True]

    def load(sd: Any) -> None:
        if fail[0]:
            raise ValueError("test: does not fit")
        loaded.append(sd)

    state = UserState()
    state.register("default", load, lambda: {"w": 1})
    errors: list[Exception] = []
    m = SimpleNamespace(_healer=healer, _ff=SimpleNamespace(heal_busy=False), heal_mesh=None, _user_state=state,
                        _log=LOG, _step=4, report_error=errors.append, load_state_dict=lambda sd: None,
                        _manager_state_dict=lambda: state.snapshot(dict))

    def round_with(pending: Any) -> None:
        m._cur = Round(StepRecord(round=1, step=4, since=0.0, started=0.0))
        m._cur.apply_due, m._cur.pending, m._cur.rec.healing = True, pending, True
        heal_here(m)  # type: ignore[arg-type]

    received = {"user": {"default": {"w": 2}}, "torchft": {"step": 4, "batches_committed": 8}}
    round_with(received)
    round_with(received)
    assert healer.failed_heals == 2 and len(errors) == 2 and not loaded
    round_with(None)  # the fetch failed: counted there, not again here
    assert healer.failed_heals == 2 and len(errors) == 3
    fail[0] = False
    round_with(received)
    assert healer.failed_heals == 0 and loaded == [{"w": 2}] and len(errors) == 3
