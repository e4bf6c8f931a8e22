"""The optimizer wrapper and the replica-aware sampler (``rallypoint.integrations``).

Unit tests drive them with plain data and a fake manager; one multi-process test runs
two replica groups (``tests/optim_worker.py``) that train through both with a StepLR,
SIGKILLs one, restarts it, and checks that after healing every replica holds the same
parameters, learning rate, scheduler epoch and sampler position (torchtitan#4598: a
healed replica once resumed with the wrong learning rate).
"""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from rallypoint.integrations.data import DistributedSampler
from rallypoint.integrations.optim import Optimizer, OptimizerWrapper

# ----------------------------------------------------------------------- sampler


def shards(size: int, groups: int, ranks: int, epoch: int = 0, **kw: Any) -> dict[tuple[int, int], list[int]]:
    out = {}
    for r in range(groups):
        for g in range(ranks):
            s = DistributedSampler(list(range(size)), replica_rank=r, num_replica_groups=groups, group_rank=g,
                                   num_replicas=ranks, **kw)
            s.set_epoch(epoch)
            out[(r, g)] = list(s)
    return out


@pytest.mark.parametrize("size,groups,ranks", [(48, 2, 3), (48, 3, 1), (7, 1, 1), (64, 4, 2)])
def test_shards_are_disjoint_and_cover_the_dataset(size: int, groups: int, ranks: int) -> None:
    for epoch in (0, 1):
        got = shards(size, groups, ranks, epoch)
        flat = [i for v in got.values() for i in v]
        assert sorted(flat) == list(range(size)), "every sample exactly once per epoch"
        assert len({len(v) for v in got.values()}) == 1


def test_uneven_dataset_pads_or_drops_like_torch() -> None:
    padded = shards(50, 2, 3)  # 6 global ranks, 9 each: 4 padding duplicates
    flat = [i for v in padded.values() for i in v]
    assert set(flat) == set(range(50)) and len(flat) == 54
    dropped = shards(50, 2, 3, drop_last=True)  # 8 each, no sample twice
    flat = [i for v in dropped.values() for i in v]
    assert len(flat) == len(set(flat)) == 48


def test_shard_is_torchs_at_the_global_rank() -> None:
    ds = list(range(37))
    for r in range(3):
        for g in range(2):
            ours = DistributedSampler(ds, replica_rank=r, num_replica_groups=3, group_rank=g, num_replicas=2, seed=5)
            ref = torch.utils.data.DistributedSampler(ds, num_replicas=6, rank=r * 2 + g, seed=5)
            for e in (0, 3):
                ours.set_epoch(e)
                ref.set_epoch(e)
                assert list(ours) == list(ref)
            assert (ours.rank, ours.num_replicas) == (r * 2 + g, 6)


def test_order_is_deterministic_per_epoch() -> None:
    a = shards(40, 2, 1, epoch=3, seed=9)
    assert a == shards(40, 2, 1, epoch=3, seed=9)
    assert a != shards(40, 2, 1, epoch=4, seed=9)
    assert a != shards(40, 2, 1, epoch=3, seed=10)
    ordered = shards(40, 2, 1, epoch=3, shuffle=False)
    assert ordered[(1, 0)] == list(range(1, 40, 2))


def test_resume_mid_epoch_from_a_state_dict() -> None:
    ds = list(range(30))
    a = DistributedSampler(ds, replica_rank=0, num_replica_groups=2, seed=1)
    a.set_epoch(2)
    it = iter(a)
    head = [next(it) for _ in range(6)]
    sd = a.state_dict()
    assert sd == {"epoch": 2, "consumed": 6, "num_samples": 15}
    rest = list(it)
    ref = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=0, seed=1)
    ref.set_epoch(2)
    assert head + rest == list(ref)

    # A fresh sampler of the *other* group resumes at the same position in its own shard.
    b = DistributedSampler(ds, replica_rank=1, num_replica_groups=2, seed=1)
    b.load_state_dict(sd)
    b.set_epoch(2)  # a resumed ``for e in range(start, n): set_epoch(e)`` loop keeps the position
    ref = DistributedSampler(ds, replica_rank=1, num_replica_groups=2, seed=1)
    ref.set_epoch(2)
    assert list(b) == list(ref)[6:]


def test_load_moves_an_iteration_under_way() -> None:
    """A healed replica keeps its DataLoader: the next batch comes from the restored position."""
    ds = torch.arange(40).float().unsqueeze(1)
    peer = DistributedSampler(ds, replica_rank=0, num_replica_groups=2, seed=4)
    peer_it = _forever(DataLoader(ds, batch_size=4, sampler=peer))
    for _ in range(7):  # into epoch 1 (5 batches of 4 per epoch)
        next(peer_it)
    stale = DistributedSampler(ds, replica_rank=0, num_replica_groups=2, seed=4)
    stale_it = _forever(DataLoader(ds, batch_size=4, sampler=stale))
    next(stale_it)
    assert peer.state_dict()["epoch"] == 1 and stale.state_dict()["epoch"] == 0
    stale.load_state_dict(peer.state_dict())
    for _ in range(8):  # across the next epoch boundary too
        assert torch.equal(next(stale_it), next(peer_it))
        assert stale.state_dict() == peer.state_dict()


def _forever(loader: DataLoader) -> Iterator[torch.Tensor]:
    while True:
        yield from loader


def test_exhausted_epoch_moves_to_the_next() -> None:
    s = DistributedSampler(list(range(12)), replica_rank=1, num_replica_groups=3, seed=2)
    first = list(s)
    assert s.state_dict()["epoch"] == 1 and s.consumed == 0
    s.set_epoch(1)  # the usual loop: no reset, it is the current epoch
    second = list(s)
    ref = torch.utils.data.DistributedSampler(list(range(12)), num_replicas=3, rank=1, seed=2)
    assert first == list(ref)
    ref.set_epoch(1)
    assert second == list(ref)
    s.set_epoch(0)
    assert list(s) == first
    loader_pos = DistributedSampler(list(range(40)), replica_rank=0, num_replica_groups=2)
    batches = iter(DataLoader(list(range(40)), batch_size=4, sampler=loader_pos))
    for _ in range(3):
        next(batches)
    assert loader_pos.state_dict() == {"epoch": 0, "consumed": 12, "num_samples": 20}


def test_bad_arguments_and_foreign_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="replica_rank"):
        DistributedSampler(list(range(10)), replica_rank=2, num_replica_groups=2)
    with pytest.raises(ValueError, match="group_rank"):
        DistributedSampler(list(range(10)), replica_rank=0, num_replica_groups=2, group_rank=1)
    s = DistributedSampler(list(range(10)), replica_rank=0, num_replica_groups=2)
    with pytest.raises(ValueError, match="shard of 3 samples"):
        s.load_state_dict({"epoch": 0, "consumed": 1, "num_samples": 3})
    with pytest.raises(ValueError, match="bad sampler position"):
        s.load_state_dict({"epoch": 0, "consumed": 6, "num_samples": 5})


# ----------------------------------------------------------------------- optimizer


class FakeManager:
    """Records start_quorum calls, answers should_commit from a script, keeps the
    registered state-dict callbacks so a test can play a heal."""

    def __init__(self, commits: list[bool] | None = None) -> None:
        self.commits = list(commits or [])
        self.quorums = 0
        self.fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def start_quorum(self) -> None:
        self.quorums += 1

    def should_commit(self) -> bool:
        return self.commits.pop(0) if self.commits else True

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        assert key not in self.fns
        self.fns[key] = (load, save)

    def save(self) -> dict[str, Any]:
        # A copy, as the wire makes one: nothing of the sender is shared with the receiver.
        return copy.deepcopy({k: save() for k, (_, save) in self.fns.items()})

    def load(self, state: dict[str, Any]) -> None:
        for k, (load, _) in self.fns.items():
            load(state[k])


def make(commits: list[bool] | None = None, seed: int = 0) -> tuple[nn.Module, FakeManager, Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    m = FakeManager(commits)
    return model, m, Optimizer(m, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))


def train_step(model: nn.Module, opt: Optimizer) -> bool:
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    return opt.step()


def test_steps_only_when_the_step_commits() -> None:
    model, m, opt = make([True, False, True])
    w0 = model.weight.detach().clone()
    assert train_step(model, opt) is True and m.quorums == 1
    w1 = model.weight.detach().clone()
    assert not torch.equal(w0, w1)
    assert train_step(model, opt) is False and opt.last_step_committed is False
    assert torch.equal(model.weight, w1), "an uncommitted step changes nothing"
    assert model.weight.grad is not None  # zero_grad(set_to_none=True) ran before backward
    assert train_step(model, opt) is True and m.quorums == 3
    assert not torch.equal(model.weight, w1)
    with pytest.raises(ValueError, match="closures"):
        opt.step(lambda: 0.0)


def test_passes_the_optimizer_api_through() -> None:
    model, _, opt = make()
    assert isinstance(opt, torch.optim.Optimizer) and OptimizerWrapper is Optimizer
    assert opt.param_groups is opt.optim.param_groups and opt.state is opt.optim.state
    assert opt.defaults["lr"] == 0.5
    train_step(model, opt)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lr"] == 0.5 and len(sd["state"]) == 2
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 0.1})
    assert len(opt.optim.param_groups) == 2
    _, _, other = make(seed=1)
    other.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.1})
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[1]["lr"] == 0.1 and len(other.state) == 2


def test_scheduler_steps_on_commit_only() -> None:
    model, _, opt = make([True, False, False, True, True])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.register_scheduler(sched)
    lrs = []
    for _ in range(5):
        train_step(model, opt)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.25, 0.25, 0.25, 0.125, 0.0625]
    assert sched.last_epoch == 3


def lr_after_heal(with_scheduler_state: bool) -> tuple[float, float]:
    """Replica A trains 5 committed steps; replica B (fresh) heals from A's state and
    both train 3 more: their learning rates."""
    model_a, ma, a = make(seed=0)
    sa = torch.optim.lr_scheduler.StepLR(a, step_size=2, gamma=0.1)
    a.register_scheduler(sa)
    ma.register_state_dict_fn("default", lambda sd: None, lambda: {"model": model_a.state_dict(), "optim": a.state_dict()})
    for _ in range(5):
        train_step(model_a, a)
    model_b, mb, b = make(seed=1)
    sb = torch.optim.lr_scheduler.StepLR(b, step_size=2, gamma=0.1)
    b.register_scheduler(sb)

    def load(sd: dict[str, Any]) -> None:
        model_b.load_state_dict(sd["model"])
        b.load_state_dict(sd["optim"])

    mb.register_state_dict_fn("default", load, lambda: {})
    state = ma.save()
    if not with_scheduler_state:
        del mb.fns["lr_scheduler"]  # what torchtitan#4598 did: only model + optimizer heal
    mb.load(state)
    for _ in range(3):
        train_step(model_a, a)
        train_step(model_b, b)
    assert torch.equal(model_a.weight, model_b.weight) or not with_scheduler_state
    return a.param_groups[0]["lr"], b.param_groups[0]["lr"]


def test_healed_replica_gets_its_peers_learning_rate() -> None:
    lr_a, lr_b = lr_after_heal(with_scheduler_state=True)
    assert lr_a == lr_b == pytest.approx(0.5 * 0.1 ** 4)
    lr_a, lr_b = lr_after_heal(with_scheduler_state=False)
    assert lr_a != lr_b, "without the scheduler's state the healed replica's schedule is stale"


def test_scheduler_state_sets_the_lr_even_without_optimizer_state() -> None:
    _, ma, a = make(seed=0)
    sa = torch.optim.lr_scheduler.StepLR(a, step_size=1, gamma=0.5)
    a.register_scheduler(sa)
    for _ in range(3):
        a.step()
    model_b, mb, b = make(seed=1)
    b.register_scheduler(torch.optim.lr_scheduler.StepLR(b, step_size=1, gamma=0.5))
    mb.load(ma.save())
    assert b.param_groups[0]["lr"] == a.param_groups[0]["lr"] == 0.0625


def test_register_scheduler_refuses_foreign_and_plateau_schedulers() -> None:
    model, _, opt = make()
    foreign = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), step_size=1)
    with pytest.raises(ValueError, match="built on this Optimizer"):
        opt.register_scheduler(foreign)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt.optim)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        opt.register_scheduler(plateau)
    opt.register_scheduler(plateau, key="plateau", step_on_commit=False)
    inner_sched = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=1, gamma=0.5)
    opt.register_scheduler(inner_sched)  # on the inner optimizer: same param groups
    train_step(model, opt)
    assert opt.param_groups[0]["lr"] == 0.25


# ----------------------------------------------------------------------- processes

HEARTBEAT_MS = 30_000


@pytest.fixture
def optim_replicas(tmp_path: Path) -> Iterator[Callable[[Any], Any]]:
    """``optim_replicas(lighthouse)`` -> an ``OptimReplicas``; its workers are SIGKILLed by
    pid and reaped at teardown."""
    from optim_worker import OptimReplicas

    made: list[Any] = []

    def make_(lh: Any) -> Any:
        r = OptimReplicas(tmp_path, lh.address())
        made.append(r)
        return r

    yield make_
    for r in made:
        r.kill_all()


def test_killed_replica_heals_lr_schedule_and_sampler_position(lighthouse, optim_replicas) -> None:
    lh = lighthouse(min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = optim_replicas(lh)
    go = r.tmp / "go-b2"
    r.start("a", seed=1, replica_rank=0, delay=0.05)
    b = r.start("b", seed=2, replica_rank=1, delay=0.05)
    # The replacement imports torch while b still runs (seconds on a busy machine) and
    # joins only once ``go`` exists.
    b2 = r.start("b", seed=3, replica_rank=1, delay=0.05, go=str(go))
    r.wait_for("both replicas at step 4 together",
               lambda: min(r.step("a"), r.step("b")) >= 4 and r.progress("a")["history"][-1][1] == 2, 90)
    os.kill(b.pid, signal.SIGKILL)
    r.wait_dead(b, 10)
    after = r.step("a")
    r.wait_for("a committing alone", lambda: r.step("a") >= after + 3, 20)
    assert b2.poll() is None, r.logs()
    (r.tmp / "b.json").unlink(missing_ok=True)  # the progress file of the killed b
    go.write_text("")
    r.wait_for("b healed and committing", lambda: r.step("b") > after + 3, 30)
    target = max(r.step("a"), r.step("b")) + 3
    r.finish(target, timeout=30)
    r.assert_identical(["a", "b"], target)
    pa, pb = r.progress("a"), r.progress("b")
    assert (pa["lr"], pa["last_lr"], pa["sched_epoch"]) == (pb["lr"], pb["last_lr"], pb["sched_epoch"]), (pa, pb)
    assert pa["sched_epoch"] == target, "the schedule advanced once per committed step"
    assert pa["lr"] == pytest.approx(0.1 * 0.5 ** (target // 3))
    assert pa["sampler"] == pb["sampler"], (pa["sampler"], pb["sampler"])
    # One batch of 4 per step, committed or not; b's own restarted run read fewer
    # batches than its position: the position came from a.
    pos = pa["sampler"]["epoch"] * 20 + pa["sampler"]["consumed"]
    assert pos % 4 == 0 and pos >= 4 * target, pa["sampler"]
    assert 4 * len(pb["history"]) < pos, (pb["history"], pa["sampler"])
