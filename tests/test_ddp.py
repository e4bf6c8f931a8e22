"""``rallypoint.integrations.DistributedDataParallel``: torch DDP whose gradient buckets
are averaged through the manager.

What a user checks: wrapping a model changes nothing about its gradients; a failed
gradient allreduce never raises out of ``backward()``, the step just does not commit,
and the next step trains normally with no workaround (torchft 0.2.0 raises out of
backward and then fails every later forward); and with real replica processes, one
SIGKILLed inside the gradient allreduce, the survivors commit again within seconds,
the dead one restarts and heals, and all end identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from ddp_worker import DDPReplicas
from rallypoint.integrations import DistributedDataParallel
from rallypoint.manager import Manager
from rallypoint.process_groups import FakeProcessGroupWrapper, ProcessGroupError, ProcessGroupGloo

#: The heartbeat timeout: far longer than any bound below, so only the liveness stream
#: and the abort it triggers can explain a quick recovery.
HEARTBEAT_MS = 30_000
#: The workers' collective timeout (seconds): a survivor stuck in the allreduce would
#: stall at least this long.
COLLECTIVE_S = 10
#: How long survivors may take to commit again without the dead replica.
RECOVER_S = 6.0


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.fixture
def solo(lighthouse: Any) -> Iterator[Any]:
    """``solo(pg, model, opt)`` -> a Manager of a one-replica job (shut down at teardown)."""
    lh = lighthouse(min_replicas=1)
    made: list[tuple[Manager, Any]] = []

    def make(pg: Any, model: nn.Module, opt: torch.optim.Optimizer) -> Manager:
        def load(sd: dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["opt"])

        m = Manager(pg, load, lambda: {"model": model.state_dict(), "opt": opt.state_dict()}, min_replica_size=1,
                    rank=0, world_size=1, hostname="127.0.0.1", store_addr="127.0.0.1",
                    lighthouse_addr=lh.address(), replica_id="solo", timeout=timedelta(seconds=5),
                    quorum_timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=5))
        made.append((m, pg))
        return m

    yield make
    for m, pg in made:
        m.shutdown()
        pg.shutdown()


def test_single_replica_grads_match_plain_training(solo: Any) -> None:
    """One replica: every DDP gradient equals the unwrapped model's, every step commits
    and the parameters stay equal to a plain training loop's."""
    model, ref = _mlp(0), _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    m = solo(ProcessGroupGloo(timeout=timedelta(seconds=5)), model, opt)
    ddp = DistributedDataParallel(m, model, bucket_cap_mb=0.001)
    gen = torch.Generator().manual_seed(7)
    try:
        for step in range(4):
            x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
            m.start_quorum()
            opt.zero_grad()
            ref_opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            nn.functional.mse_loss(ref(x), y).backward()
            for g, r in zip(_grads(model), _grads(ref), strict=True):
                torch.testing.assert_close(g, r, rtol=0, atol=0)
            assert m.should_commit(), m.errored()
            assert m.current_step() == step + 1
            opt.step()
            ref_opt.step()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=0, atol=0)
        assert ddp.buckets_reduced >= 4 * 2  # several buckets per step, all through the manager
        assert ddp.bucket_failures == 0
    finally:
        ddp.shutdown()


def test_failed_gradient_allreduce_skips_the_step_and_the_next_one_trains(solo: Any) -> None:
    """The first bucket's allreduce fails: backward does not raise, the step does not
    commit, and the next step (same loop, no workaround) trains and commits with the
    right gradients."""
    model, ref = _mlp(1), _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=5)))
    m = solo(pg, model, opt)
    ddp = DistributedDataParallel(m, model, bucket_cap_mb=0.001)
    gen = torch.Generator().manual_seed(8)
    try:
        committed = []
        for step in range(4):
            x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
            m.start_quorum()
            if step == 1:
                m.wait_quorum()  # the injection must hit a gradient bucket, not the configure
                pg.inject(ProcessGroupError("injected: peer went away mid-allreduce", op="allreduce"))
            opt.zero_grad()
            ref_opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()  # never raises
            nn.functional.mse_loss(ref(x), y).backward()
            if step == 1:
                assert pg.injected == 1 and m.errored() is not None
            else:
                for g, r in zip(_grads(model), _grads(ref), strict=True):
                    torch.testing.assert_close(g, r, rtol=0, atol=0)
            ok = m.should_commit()
            committed.append(ok)
            if ok:
                opt.step()
                ref_opt.step()
        assert committed == [True, False, True, True]
        assert m.current_step() == 3
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=0, atol=0)
    finally:
        ddp.shutdown()


def test_failed_manager_never_breaks_the_reducer(solo: Any) -> None:
    """Even a manager whose allreduce raises (not just fails its work) leaves DDP usable:
    the hook records the error, completes the bucket with its local gradients, and a
    later step with a working manager trains as usual."""
    model = _mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = solo(ProcessGroupGloo(timeout=timedelta(seconds=5)), model, opt)
    ddp = DistributedDataParallel(m, model, bucket_cap_mb=0.001)
    real = m.allreduce
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    try:
        m.start_quorum()
        m.allreduce = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
        nn.functional.mse_loss(ddp(x), y).backward()
        m.allreduce = real  # type: ignore[method-assign]
        assert ddp.bucket_failures >= 1 and "boom" in str(m.errored())
        assert not m.should_commit()
        for _ in range(2):
            m.start_quorum()
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            assert m.should_commit(), m.errored()
        assert m.current_step() == 2
    finally:
        ddp.shutdown()


def test_rejects_bucket_rebuilding_options(solo: Any) -> None:
    """Options that let torch re-bucket after step one are refused with a reason."""
    with pytest.raises(ValueError, match="rebuild DDP buckets"):
        DistributedDataParallel(object(), _mlp(0), find_unused_parameters=False)
    with pytest.raises(ValueError, match="rebuild DDP buckets"):
        DistributedDataParallel(object(), _mlp(0), static_graph=True)
    with pytest.raises(ValueError, match="device_mesh"):
        DistributedDataParallel(object(), _mlp(0), device_mesh=None)


def _committed_without(r: DDPReplicas, names: list[str], after: dict[str, int], members: int) -> bool:
    """Every survivor committed a step past ``after`` in a quorum of ``members``."""
    for n in names:
        prog = r.progress(n)
        if prog is None or not any(s > after[n] and p == members and c for s, p, c in prog["history"]):
            return False
    return True


@pytest.mark.slow
def test_peer_killed_mid_gradient_allreduce(lighthouse: Any, ddp_replicas: Any) -> None:
    """Three DDP replicas; the last SIGKILLs itself inside the comm hook (at step 3 or
    later, once all three train together), after posting its first gradient bucket,
    leaving the others blocked in the second.
    The survivors' backward does not raise, that step does not commit, they commit
    again as a pair within RECOVER_S (collective timeout 10 s, heartbeat 30 s), the
    victim restarts and heals, and all three end at the same step with the same
    parameters."""
    # join_timeout covers a slow step: with a shorter one the replica that arrives last at
    # each quorum is left out while an earlier waiter is let in, and on a loaded 2-core
    # machine the three replicas can keep trading places instead of training together.
    lh = lighthouse(min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = ddp_replicas(lh)
    names = ["replica_0", "replica_1", "replica_2"]
    victim, survivors = names[-1], names[:-1]
    procs = {
        n: r.start(n, seed=i + 1, delay=0.05, timeout=COLLECTIVE_S, **({"fault": {"step": 3, "participants": 3}} if n == victim else {}))
        for i, n in enumerate(names)
    }
    # Importing torch in three processes at once takes a while on a busy 2-core machine:
    # that gets its own deadline, then the replacement starts importing while they train.
    r.wait_for("all three replicas training", lambda: all(r.progress(n) for n in names), 60)
    spare = r.start(victim, seed=99, delay=0.05, timeout=COLLECTIVE_S, standby=True)  # the restart, pre-imported
    rc = r.wait_dead(procs[victim], 30)
    assert rc == -9, f"{victim} exited {rc} instead of dying in the comm hook; logs:\n{r.logs()}"
    assert "SIGKILL in the comm hook at step" in r.logs()
    after = {s: r.step(s) for s in survivors}
    took = r.wait_for(f"survivors committing without {victim}",
                      lambda: _committed_without(r, survivors, after, len(survivors)), 20)
    assert took < RECOVER_S, f"survivors took {took:.1f}s to commit again (collective timeout {COLLECTIVE_S}s)"
    for s in survivors:
        prog = r.progress(s)
        assert prog is not None and "raised" not in prog, (prog, r.logs())
        # the step the victim died in was not committed: a quorum of three that failed
        assert any(p == 3 and not c for _, p, c in prog["history"]), (prog["history"], r.logs())
    r.release(spare, victim)
    r.wait_for(f"{victim} healed and committing", lambda: r.step(victim) > max(after.values()), 30)
    target = max(r.step(x) for x in names) + 3
    r.finish(target, timeout=30)  # every worker exits 0: no forward/backward ever raised
    r.assert_identical(names, target)
    for n in names:
        prog = r.progress(n)
        assert prog is not None and "raised" not in prog and prog["history"][-1][1] == 3, prog
