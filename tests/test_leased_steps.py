"""A one-rank replica group on a quorum lease starts and votes its rounds on the training
thread (no hand-off to the quorum thread or the server's loop), with the same results as
the loop's path; whatever the lease does not serve still asks the lighthouse. And the
step reports of a lease are paced (power-of-two batches of rounds, each saying how many),
which the lighthouse's straggler scorer and goodput ledger read per round."""

from __future__ import annotations

import concurrent.futures as cf
import math
from datetime import timedelta
from typing import Any

import pytest
import torch

from rallypoint.lighthouse import ledger as gl
from rallypoint.lighthouse import stragglers as sg
from rallypoint.manager._lease import MAX_PACE, REPORT_INTERVAL_S, StatsBatch, report_pace

T = timedelta(seconds=10)


def _requests(lh: Any) -> float:
    for line in lh.core.metrics.render().decode().splitlines():
        if line.startswith("rallypoint_lighthouse_quorum_requests_total "):
            return float(line.split()[1])
    raise AssertionError("no quorum request counter")


class _Pair:
    """Two one-rank replica groups (Managers in this process, one thread each) training a
    4-parameter model in lockstep, counting the rounds that went to the quorum thread."""

    def __init__(self, lh: Any) -> None:
        from rallypoint.manager import Manager
        from rallypoint.process_groups import ProcessGroupGloo

        self.models = [torch.nn.Linear(2, 2) for _ in range(2)]
        for m in self.models:
            torch.nn.init.constant_(m.weight, 0.5)
            torch.nn.init.constant_(m.bias, 0.0)
        self.pgs = [ProcessGroupGloo(timeout=T) for _ in range(2)]
        self.submitted = [0, 0]
        self.ex = cf.ThreadPoolExecutor(2)
        self.fail_at: dict[int, int] = {}  # replica -> step at which it reports an error once

        def make(i: int) -> Any:
            model = self.models[i]
            return Manager(self.pgs[i], model.load_state_dict, model.state_dict, min_replica_size=2, rank=0,
                           world_size=1, hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                           replica_id=f"lease{i}", timeout=T, quorum_timeout=T, connect_timeout=T)

        self.ms = list(self.ex.map(make, range(2)))
        for i, m in enumerate(self.ms):
            real = m._executor.submit

            def counted(*a: Any, _i: int = i, _real: Any = real, **kw: Any) -> Any:
                self.submitted[_i] += 1
                return _real(*a, **kw)

            m._executor.submit = counted

    def _step(self, i: int) -> bool:
        m, model = self.ms[i], self.models[i]
        m.start_quorum()
        x = torch.full((4, 2), float(i + 1))
        model.zero_grad()
        model(x).sum().backward()
        for p in model.parameters():
            assert p.grad is not None
            m.allreduce(p.grad).wait()
        if self.fail_at.get(i) == m.current_step():
            del self.fail_at[i]
            m.report_error(RuntimeError("injected by the test"))
        ok = m.should_commit()
        if ok:
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p -= 0.01 * p.grad
        return ok

    def steps(self, n: int) -> list[tuple[bool, bool]]:
        """``n`` steps of each replica, each on its own thread (as separate processes would)."""
        a, b = self.ex.map(lambda i: [self._step(i) for _ in range(n)], range(2), timeout=60)
        return list(zip(a, b))

    def until(self, step: int) -> None:
        """Each replica steps until it has committed ``step`` steps (at most 50 tries)."""
        def run(i: int) -> None:
            for _ in range(50):
                if self.ms[i].current_step() >= step:
                    return
                self._step(i)
            raise AssertionError(f"replica {i} is at step {self.ms[i].current_step()} after 50 tries")

        list(self.ex.map(run, range(2), timeout=60))

    def close(self) -> None:
        for m in self.ms:
            m.shutdown()
        for pg in self.pgs:
            pg.shutdown()
        self.ex.shutdown()


@pytest.fixture
def pair(lighthouse: Any) -> Any:
    lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
    p = _Pair(lh)
    p.lh = lh  # type: ignore[attr-defined]
    yield p
    p.close()


def test_rounds_on_a_lease_run_on_the_training_thread_and_stay_in_lockstep(pair: Any) -> None:
    pair.steps(4)  # the first quorum grants the lease
    assert pair.lh.status()["lease"]["quorum_id"] is not None
    served = [m._server._lease.served for m in pair.ms]
    submitted, asked = list(pair.submitted), _requests(pair.lh)
    results = pair.steps(10)
    assert all(a and b for a, b in results)  # every step committed on both
    assert pair.submitted == submitted, "a leased round went to the quorum thread"
    assert _requests(pair.lh) == asked, "a leased round asked the lighthouse"
    assert [m._server._lease.served - s for m, s in zip(pair.ms, served)] == [10, 10]
    assert [m.current_step() for m in pair.ms] == [14, 14]
    for a, b in zip(pair.models[0].parameters(), pair.models[1].parameters()):
        assert torch.equal(a, b)  # averaged gradients, identical updates
    rec = pair.ms[0].step_record()
    assert rec.outcome == "committed" and rec.participants == tuple(sorted(m.replica_id for m in pair.ms))


def test_a_failed_step_leaves_the_lease_and_asks_the_lighthouse(pair: Any) -> None:
    pair.steps(4)
    submitted, asked = list(pair.submitted), _requests(pair.lh)
    pair.fail_at[1] = pair.ms[1].current_step()
    pair.until(10)
    assert [m.current_step() for m in pair.ms] == [10, 10]
    # replica 1 retries its step off the lease: it asks the lighthouse, the lease ends for
    # replica 0 too, and replica 1 heals from it
    assert pair.submitted[0] > submitted[0] and pair.submitted[1] > submitted[1] and _requests(pair.lh) > asked
    failed = [r.step for r in pair.ms[1].step_records() if r.outcome == "failed"]
    assert failed and failed[0] == 4, failed  # the injected error failed replica 1's step 4
    for a, b in zip(pair.models[0].parameters(), pair.models[1].parameters()):
        assert torch.equal(a, b)


def test_a_one_rank_groups_vote_is_its_own_and_another_process_cannot_vote_for_it(pair: Any) -> None:
    import grpc

    from rallypoint.manager.client import ManagerClient

    pair.steps(2)
    server = pair.ms[0]._server
    assert server.local_should_commit(0, 5, False, 1.0) is False
    assert server.local_should_commit(0, 5, True, 1.0) is True
    with ManagerClient(server.address(), connect_timeout=5) as c, pytest.raises((PermissionError, grpc.RpcError, ConnectionError)):
        c.should_commit(0, pair.ms[0]._step, True, 5)  # no rank key: rank 0 is held by this process


@pytest.mark.parametrize("step_s, pace", [
    (None, 1), (float("nan"), 1), (0.0, 1), (-1.0, 1), (1.0, 1), (REPORT_INTERVAL_S, 1),
    (REPORT_INTERVAL_S / 2, 2), (REPORT_INTERVAL_S / 3, 4), (0.003, 32), (1e-9, MAX_PACE),
])
def test_report_pace_is_the_smallest_power_of_two_that_spans_the_interval(step_s: float | None, pace: int) -> None:
    assert report_pace(step_s) == pace
    assert pace & (pace - 1) == 0  # a power of two: groups with different paces share report steps


def _data(step: int, step_s: float = 0.003, compute_s: float = 0.001) -> dict:
    return {"step": step, "step_stats": {"step": step - 1, "outcome": "committed", "compute_s": compute_s,
                                         "step_s": step_s}}


def test_short_steps_are_reported_in_paced_batches_that_count_their_rounds() -> None:
    b = StatsBatch()
    assert b.add(_data(1), 1, 1) == [_data(1)] and b.pace == 32  # 3 ms steps: every 32 after this report
    reports = [r for s in range(2, 97) for r in b.add(_data(s), s, 1)]
    assert [r["step"] for r in reports] == [32, 64, 96]
    assert reports[0]["step_stats"]["rounds"] == 31 and reports[1]["step_stats"]["rounds"] == 32
    assert math.isclose(reports[1]["step_stats"]["step_s"], 32 * 0.003)
    # the pace multiplies the grant's report_every (a large lease): multiples of both
    b2 = StatsBatch()
    b2.add(_data(2), 2, 2)
    assert [r["step"] for s in range(3, 200) for r in b2.add(_data(s), s, 2)] == [64, 128, 192]


def _flagged(per_round: dict[str, float]) -> list[str]:
    """Group a reports every 32 rounds, group b every 8 (its batches end at a's steps too),
    each with ``per_round`` seconds of compute per round: who the scorer flags."""
    t = sg.StragglerTracker(sg.Policy(mode="report", threshold=2.0, window=4, votes=2))
    flagged: list[str] = []
    for step in range(7, 32 * 8, 8):
        for group, rounds in (("b", 8), ("a", 32)):
            if (step + 1) % rounds:
                continue
            stats = sg.StepStats(step=step, outcome="committed", compute_s=per_round[group] * rounds, rounds=rounds)
            flagged += [e.group for e in t.observe(group, stats, 0.0, lambda: {"a", "b"}, 1) if e.kind == sg.STRAGGLER]
    return flagged


def test_the_scorer_compares_groups_per_round_whatever_their_batch() -> None:
    assert _flagged({"a": 0.001, "b": 0.001}) == []  # same per round: a's 4x larger sums are not slowness
    assert _flagged({"a": 0.003, "b": 0.001}) == ["a"]  # 3x slower per round: flagged
    parsed = sg.parse_step_stats('{"step_stats": {"step": 9, "outcome": "committed", "compute_s": 0.5, "rounds": 5}}')
    assert parsed is not None and parsed.rounds == 5
    for bad in ('"rounds": -1', '"rounds": 1.5', '"rounds": "2"'):
        with pytest.raises(sg.BadStepStats, match="rounds"):
            sg.parse_step_stats('{"step_stats": {"step": 9, "outcome": "committed", "compute_s": 0.5, %s}}' % bad)


def test_the_ledger_counts_every_round_of_a_batched_report() -> None:
    led = gl.Ledger()
    led.join("g", 0.0)
    led.round("g", sg.StepStats(step=31, outcome="committed", compute_s=0.03, step_s=0.1, rounds=32), 1.0)
    led.round("g", sg.StepStats(step=32, outcome="committed", compute_s=0.001, step_s=0.003), 1.1)
    assert led.groups[gl.group_of("g")].totals.rounds["committed"] == 33


def test_an_error_acting_on_a_leased_quorum_fails_the_step_not_the_call(pair: Any) -> None:
    """What the training thread does with a leased answer can fail (a configure, say): as on
    the quorum thread, the step fails and the next one recovers; start_quorum() never raises."""
    pair.steps(4)
    m = pair.ms[0]
    real = m._took_quorum
    calls = [0]

    def once(*a: Any, **kw: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("boom while acting on the quorum")
        real(*a, **kw)

    m._took_quorum = once
    pair.until(10)
    assert calls[0] >= 2
    failed = [r for r in m.step_records() if r.outcome == "failed"]
    assert failed and "boom while acting on the quorum" in (failed[0].error or ""), failed
    for a, b in zip(pair.models[0].parameters(), pair.models[1].parameters()):
        assert torch.equal(a, b)
