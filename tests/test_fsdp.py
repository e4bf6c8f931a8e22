"""FSDP2 inside replica groups, averaged across groups by the manager
(``rallypoint.integrations.fsdp``).

In-process (a 1-rank gloo world): the helper's validation, the hook firing once per FSDP
unit per backward, the thread guard of the heal state, and a heal's state round trip
through the wire format into a fresh replica (no optimizer state yet).

Multi-process (tests/fsdp_worker.py; 2 replica groups x 2 ranks = 4 processes, gloo on
127.0.0.1): a healthy run equals a plain single-process reference and rank g of one
group holds exactly what rank g of the other holds; a group SIGKILLed mid-backward
comes back, heals (model and Adam state) and ends identical, while the survivor kept
committing; the sender's state is read on the training thread with the async quorum.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import fsdp_worker
from fsdp_worker import Groups
from rallypoint.integrations.fsdp import fully_shard_replicated, register_state
from rallypoint.transports import wire

HEARTBEAT_MS = 30_000  # liveness comes from the relay/abort path, not heartbeat expiry


# ----------------------------------------------------------------------- in-process


class FakeManager:
    """What the helper touches on a manager; ``allreduce`` records each shard and adds
    ``offset`` (so a test sees that the hook's result reaches the gradients)."""

    def __init__(self, world_size: int = 1, rank: int = 0, offset: float = 0.0) -> None:
        self.group_world_size = world_size
        self.group_rank = rank
        self.heal_on_training_thread = False
        self.heal_mesh: Any = None
        self.offset = offset
        self.shards: list[int] = []
        self.registered: dict[str, tuple[Any, Any]] = {}
        self.errors: list[Exception] = []

    def allreduce(self, t: torch.Tensor, reduce_op: Any = None) -> Any:
        from rallypoint.manager._work import DoneWork

        self.shards.append(t.numel())
        t.add_(self.offset)
        return DoneWork(t)

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.registered[key] = (load, save)

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)



def _adam(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=0.05)


def test_helper_refuses_a_mismatched_manager_or_mesh(mesh1: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="replica group of 2 ranks, the FSDP mesh has 1"):
        fully_shard_replicated(fsdp_worker.make_model(), FakeManager(world_size=2), mesh=mesh1)
    with pytest.raises(ValueError, match="2 dimensions"):
        fully_shard_replicated(fsdp_worker.make_model(), FakeManager(), mesh=init_device_mesh("cpu", (1, 1)))
    bare = FakeManager()
    del bare.heal_on_training_thread
    with pytest.raises(TypeError, match="heal_on_training_thread"):
        fully_shard_replicated(fsdp_worker.make_model(), bare, mesh=mesh1)
    # An optimizer built before sharding holds the replaced parameters: refused.
    model = fsdp_worker.make_model()
    stale = _adam(model.parameters())
    fsdp = fully_shard_replicated(model, FakeManager(), mesh=mesh1)
    with pytest.raises(ValueError, match="build the optimizer after sharding"):
        register_state(FakeManager(), fsdp.module, stale)


def test_hook_fires_once_per_fsdp_unit_and_feeds_the_gradients(mesh1: Any) -> None:
    """Three FSDP units (two Linear + the parameterless root): two shards per backward,
    each averaged by the manager, and what the manager returns is the gradient."""
    mgr = FakeManager(offset=1.0)
    fsdp = fully_shard_replicated(fsdp_worker.make_model(), mgr, _adam, mesh=mesh1,
                                  shard_submodules=(nn.Linear,))
    assert mgr.heal_on_training_thread is True and mgr.heal_mesh is mesh1
    assert set(mgr.registered) == {"fsdp"}
    plain = fsdp_worker.make_model()
    x, y = fsdp_worker.global_batch(0, 8)
    for step in range(2):
        fsdp.optimizer.zero_grad()
        nn.functional.mse_loss(fsdp.module(x), y).backward()
        assert fsdp.averager.calls == 2 * (step + 1)
    units = sorted(sum(p.numel() for p in plain[i].parameters()) for i in (0, 2))
    assert sorted(mgr.shards[:2]) == units and sorted(mgr.shards[2:]) == units, mgr.shards
    plain.zero_grad()
    nn.functional.mse_loss(plain(x), y).backward()
    for (name, p), q in zip(fsdp.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad + 1.0, msg=name)  # the manager's +1 arrived
    assert mgr.errors == []


def test_state_guard_and_heal_round_trip_into_a_fresh_replica(mesh1: Any) -> None:
    """The sender's state (DTensors) goes through the wire format into a replica whose
    optimizer has no state yet, exactly as the manager fetches it (``into=`` its current
    state, ``mesh=`` for what that lacks); params and Adam state then equal the sender's,
    and both keep training identically. Reading the state off the training thread fails."""
    src = fully_shard_replicated(fsdp_worker.make_model(), FakeManager(), _adam, mesh=mesh1,
                                 shard_submodules=(nn.Linear,))
    for s in range(3):
        x, y = fsdp_worker.global_batch(s, 8)
        src.optimizer.zero_grad()
        nn.functional.mse_loss(src.module(x), y).backward()
        src.optimizer.step()
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: errors.append(_raises(src.state.save)), name="quorum-like")
    t.start()
    t.join(10)
    assert errors and isinstance(errors[0], RuntimeError) and "training thread" in str(errors[0])

    torch.manual_seed(123)
    fresh_model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))  # other weights
    dst_mgr = FakeManager()
    dst = fully_shard_replicated(fresh_model, dst_mgr, _adam, mesh=mesh1, shard_submodules=(nn.Linear,))
    assert dst.optimizer.state_dict()["state"] == {}
    params_before = [id(p) for p in dst.module.parameters()]
    data = wire.to_bytes(src.state.save())
    received = wire.decode(data, into=dst.state.save(), mesh=dst_mgr.heal_mesh)
    dst.state.load(received)
    assert [id(p) for p in dst.module.parameters()] == params_before
    assert dst.state.loads == 1
    _assert_same(src, dst)
    for s in range(3, 5):  # both go on identically: the healed FSDP module still trains
        x, y = fsdp_worker.global_batch(s, 8)
        for r in (src, dst):
            r.optimizer.zero_grad()
            nn.functional.mse_loss(r.module(x), y).backward()
            r.optimizer.step()
    _assert_same(src, dst)
    # A replica that fell behind but kept its optimizer state: received values are copied
    # into its own DTensors (into=), and it equals the sender again.
    x, y = fsdp_worker.global_batch(9, 8)
    dst.optimizer.zero_grad()
    nn.functional.mse_loss(dst.module(x), y).backward()
    dst.optimizer.step()
    exp_avg = dst.optimizer.state[next(iter(dst.module.parameters()))]["exp_avg"]
    dst.state.load(wire.decode(wire.to_bytes(src.state.save()), into=dst.state.save(), mesh=dst_mgr.heal_mesh))
    assert dst.optimizer.state[next(iter(dst.module.parameters()))]["exp_avg"] is exp_avg  # loaded in place
    _assert_same(src, dst)


def _raises(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def _assert_same(a: Any, b: Any) -> None:
    sa, sb = fsdp_worker.local_shards(a.module, a.optimizer), fsdp_worker.local_shards(b.module, b.optimizer)
    assert sorted(sa) == sorted(sb) and any(".exp_avg" in k for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ----------------------------------------------------------------------- multi-process


@pytest.fixture
def groups_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Groups] = []

    def make(lh: Any) -> Groups:
        g = Groups(tmp_path, lh.address())
        made.append(g)
        return g

    yield make
    for g in made:
        g.kill_all()


def _full(shards: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    """The whole tensor from the ranks' Shard(0) pieces (torch.chunk order)."""
    return torch.cat([s[key] for s in shards], dim=0)


def _assert_groups_agree(g: Groups, names: list[str], target: int) -> list[list[dict[str, torch.Tensor]]]:
    prog = {(n, r): g.progress(n, r) for n in names for r in range(g.world)}
    assert all(p is not None and p["step"] == target for p in prog.values()), (prog, g.logs())
    for r in range(g.world):
        hashes = {prog[(n, r)]["hash"] for n in names}
        assert len(hashes) == 1, (r, hashes, g.logs())
    assert prog[(names[0], 0)]["hash"] != prog[(names[0], 1)]["hash"]  # distinct shards per rank
    assert len({p["batches"] for p in prog.values()}) == 1, prog
    # The heal state is only ever read on the training thread, and it was read.
    for (n, r), p in prog.items():
        assert set(p["save_threads"]) <= {p["main_thread"]}, (n, r, p["save_threads"])
    assert any(p["save_threads"] for p in prog.values())
    return [[torch.load(g.out(n, r).with_suffix(".json.pt")) for r in range(g.world)] for n in names]


def test_healthy_2x2_equals_the_reference(lighthouse, groups_factory) -> None:
    """Both groups from the start (min_replica_size=2: every step has both); after 6
    steps every rank holds the reference's shard of params and Adam state (the reference
    averages the groups' gradients; at step 0 the group healing from the other contributes
    zeros), and the hook fired once per FSDP unit (2) per backward."""
    lh = lighthouse(min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=HEARTBEAT_MS)
    g = groups_factory(lh)
    names = ["A", "B"]
    for i, n in enumerate(names):
        g.start(n, index=i, groups=2, min_replica_size=2)
    target = 6
    g.finish(target, timeout=80)
    shards = _assert_groups_agree(g, names, target)
    heals = {n: [g.progress(n, r)["heals"] for r in range(2)] for n in names}
    # init_sync: one group (both its ranks) healed at step 0 from the other, the primary.
    healed = [n for n in names if heals[n] == [1, 1]]
    assert len(healed) == 1 and heals[names[1 - names.index(healed[0])]] == [0, 0], heals
    primary = 1 - names.index(healed[0])
    for n in names:
        for r in range(2):
            p = g.progress(n, r)
            assert p["hook_calls"] == [2] * len(p["hook_calls"]), p
            assert all(c == 1 and k == 2 for _, k, c in p["history"]), p["history"]
    ref_params, ref_optim = fsdp_worker.reference(target, groups=2, world=2, first_step_from=primary)
    got = shards[0]
    for i, key in enumerate(ref_params):
        torch.testing.assert_close(_full(got, f"model.{key}"), ref_params[key], rtol=1e-5, atol=1e-6, msg=key)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(_full(got, f"optim.{i}.{k}"), ref_optim[i][k], rtol=1e-5, atol=1e-7,
                                       msg=f"{key}.{k}")
        assert float(got[0][f"optim.{i}.step"]) == target


def test_group_killed_mid_backward_heals_to_identical_state(lighthouse, groups_factory, tmp_path: Path) -> None:
    """Group B's two ranks SIGKILL themselves in the gradient hook (mid-backward, while A
    waits in the cross-group all-reduce). A keeps committing alone; B's replacement (other
    initial weights, pre-warmed) joins, heals from A on the training thread (model + Adam
    state), and at the end rank g of A equals rank g of the new B bit for bit."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=HEARTBEAT_MS)
    g = groups_factory(lh)
    kill, go = tmp_path / "kill", tmp_path / "go"
    g.start("A", index=0, groups=2, delay=0.05)
    g.start("B", index=1, groups=2, delay=0.05, fault={"at": "mid_backward", "step": 2, "file": str(kill)})
    g.start("B2", index=1, groups=2, delay=0.05, seed_offset=1, wait_file=str(go))
    g.wait_for("A and B training, B2 standing by",
               lambda: g.step("A") >= 2 and g.step("B") >= 2 and g.ready("B2"), 90)
    kill.write_text("1")
    assert g.wait_dead("B", 30) == [-9, -9], g.logs()
    at_kill = g.step("A")
    g.wait_for("A committing alone", lambda: g.step("A") >= at_kill + 2, 30)
    for r in range(2):
        alone = [s for s, k, c in g.progress("A", r)["history"] if k == 1 and c == 1]
        assert alone, g.progress("A", r)["history"]
    go.write_text("1")
    g.wait_for("B2 healed and committing", lambda: g.step("B2") > at_kill + 2, 45)
    assert all(g.progress("B2", r)["heals"] >= 1 for r in range(2)), g.logs()
    target = max(g.step("A"), g.step("B2")) + 3
    del g.procs["B"]  # dead on purpose: finish() checks the others exit cleanly
    g.finish(target, timeout=40)
    shards = _assert_groups_agree(g, ["A", "B2"], target)
    for r in range(2):
        assert sorted(shards[0][r]) == sorted(shards[1][r])
        assert any(".exp_avg" in k for k in shards[0][r])
        for k, v in shards[0][r].items():
            assert torch.equal(v, shards[1][r][k]), (r, k)
    for log in sorted(tmp_path.glob("A-r*.log")):  # the heal came from A: it served its state
        assert "serving step" in log.read_text(), log.name
