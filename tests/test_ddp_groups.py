"""``rallypoint.DistributedDataParallel`` in replica groups of several ranks: the gradients
are the mean over every rank of every participating group, as plain torch DDP over all
ranks would give, with no user code inside the group.

What a user checks:
- the averaged gradient equals the arithmetic mean of the 4 ranks' own gradients (2
  groups x 2 ranks, each rank a thread with real gloo process groups), and group rank 0's
  parameters win at construction;
- with the corruption checks' rows riding in the last bucket's collective, the mean comes
  back in the staging tensor and reaches the gradients the same, with and without
  ``gradient_as_bucket_view``;
- a rank of the group that is gone makes ``backward()`` raise (the group must restart),
  and the step does not commit;
- which process group averages inside the group (table of the pure decision);
- 2 groups of 2 ranks, each launched by ``rallypoint run --nproc-per-node 2``, trained with
  only the public wrappers on different data per rank: all 4 ranks hold identical
  parameters at every committed step, also after a SIGKILL of one rank and the heal of
  its group.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import wait_until
from rallypoint.integrations import DistributedDataParallel
from rallypoint.integrations._intra import GroupPlan, plan_group
from supervisor_util import _env, events, run_group, strays  # noqa: F401 - strays is a fixture

# ---------------------------------------------------------------- in one process: 4 ranks as threads


def _gloo(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float = 10.0) -> dist.ProcessGroup:
    """A gloo ProcessGroup of ``size`` ranks (threads of this process) rendezvousing under ``prefix``."""
    s = dist.PrefixStore(prefix, store)
    backend = dist.ProcessGroupGloo(s, rank, size, timedelta(seconds=timeout_s))
    pg = dist.ProcessGroup(s, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


class CrossGroups:
    """The manager's part, for a test: a mean over the groups of the tensors of one group
    rank, through a real gloo group of those ranks; records reported errors."""

    def __init__(self, pg: dist.ProcessGroup, groups: int) -> None:
        self.pg, self.groups = pg, groups
        self.errors: list[Exception] = []

    def allreduce(self, tensor: torch.Tensor, /, *, reduce_op: Any = None) -> Any:
        work = self.pg.allreduce([tensor])
        groups = self.groups

        class Done:
            def wait(self) -> None:
                work.wait()
                tensor.div_(groups)

        return Done()

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(group: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * group + rank)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def _in_threads(fn: Any, n: int) -> list[Any]:
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    if errors:
        raise errors[0]
    return out


def _local_grads(reference: nn.Module) -> list[list[torch.Tensor]]:
    """Each of the 4 ranks' own gradients of ``reference`` on its batch (no averaging)."""
    local = []
    for i in range(4):
        reference.zero_grad()
        x, y = _batch(*divmod(i, 2))
        nn.functional.mse_loss(reference(x), y).backward()
        local.append([p.grad.clone() for p in reference.parameters()])  # type: ignore[union-attr]
    return local


def _mean(local: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The arithmetic mean of the ranks' gradients, parameter by parameter."""
    return [torch.stack([g[k] for g in local]).mean(0) for k in range(len(local[0]))]


def test_gradients_are_the_mean_over_every_rank_of_every_group() -> None:
    """2 groups x 2 ranks, each rank its own model seed and batch: after one backward,
    every rank's gradients equal the arithmetic mean of the 4 ranks' own gradients of
    group rank 0's model (which DDP broadcast inside each group), bit-identical on all 4."""
    store = dist.HashStore()
    models = [_mlp(seed=10 * (i % 2)) for i in range(4)]  # group rank 1 starts elsewhere: the broadcast fixes it

    def rank_fn(i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        group, rank = divmod(i, 2)
        intra = _gloo(store, f"group{group}", rank, 2)
        cross = CrossGroups(_gloo(store, f"cross{rank}", group, 2), groups=2)
        model = models[i]
        ddp = DistributedDataParallel(cross, model, process_group=intra, bucket_cap_mb=0.0005)
        try:
            assert ddp.group_plan == GroupPlan("given", 2, rank)
            x, y = _batch(group, rank)
            nn.functional.mse_loss(ddp(x), y).backward()
            assert ddp.buckets_reduced >= 2 and not cross.errors
            return [p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        finally:
            ddp.shutdown()

    results = _in_threads(rank_fn, 4)
    reference = _mlp(seed=0)  # group rank 0's initialisation
    for params, _ in results:
        assert all(torch.equal(p, q) for p, q in zip(params, reference.parameters()))
    local = _local_grads(reference)
    mean = _mean(local)
    for _, grads in results:
        for got, want in zip(grads, mean):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for _, grads in results[1:]:  # identical bits on every rank, so the parameters never drift
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))
    assert not all(torch.allclose(a, b) for a, b in zip(local[0], local[1]))  # the ranks' data really differ


class RidingCrossGroups(CrossGroups):
    """``CrossGroups`` with ``allreduce_last``, as rallypoint's Manager has it with the
    corruption checks on: the last bucket's mean comes back in the staging tensor the
    checks' rows ride in, and the rows (every group's norm) are checked after backward."""

    def __init__(self, pg: dist.ProcessGroup, groups: int, group: int) -> None:
        import logging

        from rallypoint.manager._guard import SdcGuard

        super().__init__(pg, groups)
        self.group, self.failed = group, []
        self.guard = SdcGuard(True, 0, logging.LoggerAdapter(logging.getLogger("test"), {}))
        self.guard.new_round()
        self.timeout = timedelta(seconds=10)  # the FailFast part: posts, hears failures
        self.riding: Any = None

    def quorum(self) -> Any:
        from rallypoint.manager.recovery import QuorumResult

        return QuorumResult(quorum_id=1, replica_rank=self.group, replica_world_size=self.groups,
                            recover_src_manager_address="", recover_src_replica_rank=None,
                            recover_dst_replica_ranks=[], store_address="", max_step=0, max_replica_rank=None,
                            max_world_size=self.groups, heal=False, commit_failures=0,
                            replica_ids=[f"g{q}" for q in range(self.groups)])

    def add_work(self, start: Any) -> Any:
        return start()

    def comm_failed(self, e: Exception) -> None:
        self.failed.append(e)

    def abort(self, e: Exception, cause: Any = None) -> None:
        self.failed.append(e)

    def allreduce_last(self, tensor: torch.Tensor) -> Any:
        self.riding = self.guard.post_riding(self.pg, self.quorum(), True, tensor, True, self.groups,
                                             f"g{self.group}", self)
        return self.riding


@pytest.mark.parametrize("as_view", [False, True])
def test_the_last_bucket_with_the_checks_rows_gives_the_same_mean(as_view: bool) -> None:
    """The last bucket's mean comes back in the staging tensor the corruption checks' rows
    ride in (its future completes with that tensor, not the bucket): torch's reducer puts
    it into the gradients, with and without ``gradient_as_bucket_view``, and the result is
    the same mean over the 4 ranks, bit-identical, as without the ride; the rows arrive."""
    store = dist.HashStore()
    models = [_mlp(seed=0) for _ in range(4)]  # before the threads: torch's generator is global

    def rank_fn(i: int) -> list[torch.Tensor]:
        group, rank = divmod(i, 2)
        intra = _gloo(store, f"g{as_view}{group}", rank, 2)
        cross = RidingCrossGroups(_gloo(store, f"c{as_view}{rank}", group, 2), groups=2, group=group)
        model = models[i]
        ddp = DistributedDataParallel(cross, model, process_group=intra, bucket_cap_mb=0.0005,
                                      gradient_as_bucket_view=as_view)
        try:
            x, y = _batch(group, rank)
            nn.functional.mse_loss(ddp(x), y).backward()
            assert cross.riding is not None and ddp.buckets_reduced >= 2 and not cross.errors and not cross.failed
            why, done = cross.guard.check(cross.pg, cross.quorum(), True, cross.timeout, f"g{group}")
            assert why is None and done["sdc_checked"] == ["grad"] and cross.guard.riding_exchanges == 1
            return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        finally:
            ddp.shutdown()

    results = _in_threads(rank_fn, 4)
    mean = _mean(_local_grads(_mlp(seed=0)))
    for grads in results:
        for got, want in zip(grads, mean):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0]))


def test_a_rank_of_the_group_gone_makes_backward_raise_and_the_step_fail() -> None:
    """Rank 1 of a group of 2 builds the wrapper and never trains: rank 0's allreduce inside
    the group times out, ``backward()`` raises an error that says the group must restart,
    and the manager was told (the step would not commit)."""
    store = dist.HashStore()
    built = threading.Barrier(2)
    outcome: dict[str, Any] = {}
    models = [_mlp(0), _mlp(0)]

    def rank_fn(rank: int) -> None:
        intra = _gloo(store, "g", rank, 2, timeout_s=1.0)
        cross = CrossGroups(_gloo(store, f"x{rank}", 0, 1), groups=1)
        ddp = DistributedDataParallel(cross, models[rank], process_group=intra)
        built.wait(30)
        if rank == 1:
            return  # this rank is "gone": it never joins the gradient allreduce
        x, y = _batch(0, 0)
        with pytest.raises(RuntimeError) as err:
            nn.functional.mse_loss(ddp(x), y).backward()
        outcome["message"], outcome["errors"] = str(err.value), list(cross.errors)
        ddp.shutdown()

    _in_threads(rank_fn, 2)
    assert "inside this replica group failed" in outcome["message"]
    assert "restart as a whole" in outcome["message"]
    assert outcome["errors"], "the failure was not reported to the manager"


@pytest.mark.parametrize(
    ("given", "default", "manager", "environ", "want"),
    [
        # a group of one rank: nothing to average inside it
        (None, None, (1, 0), {}, GroupPlan("alone")),
        (None, None, (None, None), {}, GroupPlan("alone")),
        (None, None, (None, None), {"WORLD_SIZE": "1"}, GroupPlan("alone")),
        (None, (1, 0), (1, 0), {}, GroupPlan("alone")),
        ((1, 0), None, (4, 2), {}, GroupPlan("alone")),
        # the caller's group wins, whatever its size (a data-parallel subgroup under TP)
        ((2, 1), (4, 3), (4, 3), {}, GroupPlan("given", 2, 1)),
        # torch's default group, when it is the replica group's
        (None, (2, 1), (2, 1), {}, GroupPlan("default", 2, 1)),
        (None, (2, 1), (None, None), {"WORLD_SIZE": "2", "RANK": "1"}, GroupPlan("default", 2, 1)),
        # not initialised, several ranks: initialise it in the group's store
        (None, None, (2, 1), {"MASTER_ADDR": "h", "MASTER_PORT": "5"}, GroupPlan("init", 2, 1, "h:5")),
        (None, None, (None, None), {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"},
         GroupPlan("init", 3, 2, "h:5")),
        # not initialised, several ranks, no store (ranks as threads, torchft's own tests): across groups only
        (None, None, (2, 0), {}, GroupPlan("cross", 2, 0)),
        (None, None, (None, None), {"WORLD_SIZE": "2", "MASTER_ADDR": "h"}, GroupPlan("cross", 2, 0)),
    ],
)
def test_which_group_averages_inside_the_replica_group(given: Any, default: Any, manager: Any,
                                                        environ: dict[str, str], want: GroupPlan) -> None:
    assert plan_group(given, default, manager, environ) == want


@pytest.mark.parametrize(
    ("default", "manager", "environ", "says"),
    [
        ((4, 0), (2, 0), {}, "default process group has 4 rank(s) but the manager's replica group has 2"),
        ((1, 0), (2, 0), {}, "has 1 rank(s)"),
        ((2, 1), (2, 0), {}, "rank 1 of the default process group but group rank 0"),
        (None, (None, None), {"WORLD_SIZE": "x"}, "WORLD_SIZE='x' is not a number"),
    ],
)
def test_bad_setups_are_refused_with_what_to_do(default: Any, manager: Any, environ: dict[str, str],
                                                 says: str) -> None:
    with pytest.raises(ValueError) as err:
        plan_group(None, default, manager, environ)
    assert says in str(err.value)


# ---------------------------------------------------------------- real groups under `rallypoint run`

#: A user's training script: only the public API, nothing that averages inside the group.
TRAIN = textwrap.dedent(
    """
    import hashlib, json, os, sys, time
    from datetime import timedelta
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import rallypoint

    out, stop = sys.argv[1], sys.argv[2]
    gid, rank, world = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(10 * rank + inc)  # every rank and start differs: DDP's broadcast and the heal must agree them
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 8, generator=gen), torch.randn(4096, 2, generator=gen))
    sampler = rallypoint.DistributedSampler(data, replica_rank=gid, num_replica_groups=2, group_rank=rank,
                                            num_replicas=world)
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)

    def load(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = rallypoint.Manager(pg=rallypoint.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                                 load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                           "optim": inner.state_dict()},
                                 hostname="127.0.0.1", timeout=timedelta(seconds=10),
                                 quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30))
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    ddp = rallypoint.DistributedDataParallel(manager, model)
    optimizer = rallypoint.Optimizer(manager, inner)
    log = open(os.path.join(out, f"g{gid}.r{rank}.i{inc}.jsonl"), "a", buffering=1)

    def target():
        try:
            with open(stop) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def batches():
        while True:
            yield from loader

    it = batches()
    while target() is None or manager.current_step() < target():
        xb, yb = next(it)  # before zero_grad(): see rallypoint.integrations.data
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(xb), yb).backward()
        participants = manager.num_participants()
        committed = optimizer.step()
        sha = hashlib.sha256(b"".join(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist())
                                      for p in model.parameters())).hexdigest()
        log.write(json.dumps({"step": manager.current_step(), "committed": committed, "sha": sha,
                              "participants": participants, "pid": os.getpid(), "t": time.time()}) + "\\n")
        time.sleep(0.02)
    ddp.shutdown()
    manager.shutdown()
    """
)


def _records(out: Path) -> dict[tuple[int, int, int], list[dict]]:
    """Every rank's step records, by (group, rank, incarnation)."""
    recs: dict[tuple[int, int, int], list[dict]] = {}
    for f in out.glob("g*.r*.i*.jsonl"):
        g, r, i = (int(part[1:]) for part in f.name.split(".")[:3])
        lines = [ln for ln in f.read_text().splitlines() if ln.endswith("}")]  # a line being written is skipped
        recs[(g, r, i)] = [json.loads(ln) for ln in lines]
    return recs


def _latest(out: Path, g: int, r: int, i: int) -> dict | None:
    rows = _records(out).get((g, r, i))
    return rows[-1] if rows else None


@pytest.mark.slow
def test_two_groups_of_two_ranks_stay_identical_through_a_kill_and_heal(procs: Any, lighthouse: Any, tmp_path: Path,
                                                                        strays: Any) -> None:  # noqa: F811
    """Two replica groups, each ``rallypoint run --nproc-per-node 2`` of a script that uses
    only the public wrappers (Manager, DistributedDataParallel, Optimizer,
    DistributedSampler), every rank on its own data and its own initialisation. Rank 1 of
    group 1 is SIGKILLed mid-training; its supervisor restarts the group, which heals from
    group 0. At every committed step, every rank that made it holds the same parameters as
    every other: across ranks of a group and across groups, before and after the heal."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=5_000)
    out, stop = tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    env = _env(RALLYPOINT_LIGHTHOUSE=lh.address())
    sups = [run_group(procs, "--nproc-per-node", "2", "--replica-group-id", str(g), "--restart-backoff", "0.1",
                      "--grace-period", "5", "--no-standby", str(tmp_path / "train.py"), str(out), str(stop),
                      name=f"group{g}", env=env) for g in range(2)]

    def both_groups_train() -> dict | None:  # a committed step of group 1 rank 1 with both groups taking part
        last = _latest(out, 1, 1, 0)
        return last if last and last["committed"] and last["participants"] == 2 and last["step"] >= 3 else None

    victim = wait_until(both_groups_train, timeout=60, interval=0.05, what="both groups to train together")
    strays.append(victim["pid"])
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = victim["step"]

    def healed_and_training() -> bool:
        rows = [_latest(out, 1, r, 1) for r in range(2)]
        return all(row and row["committed"] and row["participants"] == 2 and row["step"] >= killed_at + 3
                   for row in rows)

    wait_until(healed_and_training, timeout=60, interval=0.05, what="group 1 to restart, heal and train again")
    recs = _records(out)
    last = max(row["step"] for rows in recs.values() for row in rows) + 3
    stop.write_text(str(last))
    for s in sups:
        assert s.wait(60) == 0, s.stderr_text()[-4000:]

    (restart,) = events(sups[1], "restart")
    assert (restart["rank"], restart["signal"], restart["incarnation"]) == (1, "SIGKILL", 1), restart
    assert events(sups[0], "restart") == []
    recs = _records(out)
    assert set(recs) == {(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 1)}
    by_step: dict[int, dict[tuple[int, int, int], str]] = {}
    for who, rows in recs.items():
        for row in rows:
            if row["committed"]:
                by_step.setdefault(row["step"], {})[who] = row["sha"]
    drift = {step: shas for step, shas in by_step.items() if len(set(shas.values())) > 1}
    assert not drift, f"ranks hold different parameters at committed steps: {drift}"
    # Every rank committed the last step; the restarted group healed (its first commit is
    # far from step 1) and then committed steps together with group 0.
    assert set(by_step[last]) == {(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)}
    first_after = min(row["step"] for row in recs[(1, 0, 1)] if row["committed"])
    assert first_after > killed_at
    shared = [s for s, shas in by_step.items() if {(0, 0, 0), (1, 0, 1), (1, 1, 1)} <= set(shas)]
    assert len(shared) >= 3, sorted(by_step)
