"""FSDP2 (DTensor) state heals without ``into=``/``mesh=`` (issue 41): received DTensors
arrive as ``SentDTensor`` (``mesh=DEFER``, what the Manager's heal asks for) and are placed
on the receiver's own meshes and placements when applied, as TorchTitan's state (plain
``module.state_dict()`` / ``optimizer.state_dict()`` of an FSDP2 model) needs; state the
receiver lacks (a fresh replica's optimizer) is built on the sender's placements on a mesh
of the same shape; no mesh at all is an error naming the key."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from rallypoint.manager._heal_step import place_dtensors
from rallypoint.transports import wire
from rallypoint.transports._rebuild import has_sent_dtensors, rebuild_dtensors
from replica_pair import done_together, early_then_late



class Replica:
    """TorchTitan-like: an FSDP2 model and Adam, state = plain state dicts (DTensors)."""

    def __init__(self, mesh: Any, seed: int) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
        for m in self.model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.05)

    def save(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])

    def train(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        self.opt.zero_grad()
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()

    def shards(self) -> dict[str, torch.Tensor]:
        out = {f"p.{n}": _local(p) for n, p in self.model.named_parameters()}
        for i, p in enumerate(self.model.parameters()):
            for k, v in self.opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out[f"o.{i}.{k}"] = _local(v)
        return out


def _local(t: Any) -> torch.Tensor:
    """A copy of a DTensor's local shard."""
    return t.to_local().detach().clone()


def _same(a: Replica, b: Replica) -> None:
    sa, sb = a.shards(), b.shards()
    assert sorted(sa) == sorted(sb) and any(".exp_avg" in k for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_fresh_replica_heals_fsdp2_state_without_into_or_mesh(mesh1: Any) -> None:
    from torch.distributed.tensor import DTensor

    src = Replica(mesh1, seed=1)
    for s in range(3):
        src.train(s)
    dst = Replica(mesh1, seed=2)
    assert dst.opt.state_dict()["state"] == {}  # a fresh replica: no Adam state yet
    # As the quorum thread receives it: nothing of the receiver's state is read.
    received = wire.decode(wire.to_bytes(src.save()), mesh=wire.DEFER)
    assert has_sent_dtensors(received)
    assert isinstance(received["model"]["0.weight"], wire.SentDTensor)
    calls: list[int] = []

    def current() -> dict[str, Any]:
        calls.append(1)
        return dst.save()

    placed = place_dtensors(received, current, None)  # on the training thread
    assert calls == [1] and not has_sent_dtensors(placed)
    w = placed["model"]["0.weight"]
    assert isinstance(w, DTensor) and w.device_mesh == mesh1
    exp_avg = placed["optim"]["state"][0]["exp_avg"]  # the receiver had none: built on the model's mesh
    assert isinstance(exp_avg, DTensor) and exp_avg.device_mesh == mesh1
    dst.load(placed)
    _same(src, dst)
    for s in range(3, 5):  # both train on identically
        src.train(s)
        dst.train(s)
    _same(src, dst)
    # Training-thread heal of a replica that has state: into= plus DEFER for the rest.
    dst.train(9)
    dst.load(place_dtensors(wire.decode(wire.to_bytes(src.save()), into=dst.save(), mesh=wire.DEFER),
                            dst.save, None))
    _same(src, dst)


def test_plain_state_is_returned_untouched() -> None:
    sd = {"a": torch.ones(2), "b": [1, 2]}
    assert place_dtensors(sd, lambda: pytest.fail("no DTensor: the current state is not read"), None) is sd


def test_received_dtensor_takes_the_receivers_placements(mesh1: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sent = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh1, [Shard(0)])
    mine = DTensor.from_local(torch.zeros(3, 2), mesh1, [Replicate()])
    got = rebuild_dtensors(wire.decode(wire.to_bytes({"w": sent}), mesh=wire.DEFER), {"w": mine})
    assert tuple(got["w"].placements) == (Replicate(),)
    assert torch.equal(got["w"].full_tensor(), torch.arange(6.0).reshape(3, 2))


def test_a_dtensor_with_no_mesh_to_go_on_names_its_key(mesh1: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    sent = DTensor.from_local(torch.ones(4), mesh1, [Shard(0)])
    received = wire.decode(wire.to_bytes({"optim": {"momentum_buffer": sent}}), mesh=wire.DEFER)
    with pytest.raises(ValueError, match=r"momentum_buffer.*no mesh of that shape.*heal_mesh"):
        rebuild_dtensors(received, {}, default_mesh=lambda shape: None)
    # The default process group (1 rank here) has the sender's mesh size: a mesh is made on it.
    got = rebuild_dtensors(received, {})
    assert torch.equal(got["optim"]["momentum_buffer"].to_local(), torch.ones(4))
    # A mesh of another shape in the receiver's own state is not taken for it.
    other = received["optim"]["momentum_buffer"]
    other.meta["mesh_shape"] = [2]
    with pytest.raises(ValueError, match="momentum_buffer"):
        rebuild_dtensors(received, {"w": DTensor.from_local(torch.ones(1), mesh1, [Shard(0)])})


# ------------------------------------------------------------------ through real Managers
@pytest.mark.parametrize("training_thread", [True, False], ids=["training_thread", "quorum_thread"])
def test_manager_heals_a_late_replicas_dtensor_state_by_default(mesh1: Any, lighthouse: Any,
                                                                training_thread: bool) -> None:
    """TorchTitan's way: DTensor parameters, plain ``state_dict()``s registered with
    ``set_state_dict_fns``, no ``into=``/``mesh=``/``heal_mesh`` anywhere. A replica joining
    at step 3 (fresh SGD: no momentum_buffer yet) heals from its peer, whichever thread heals,
    and both end with identical parameters and momentum."""
    import threading
    from datetime import timedelta

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse(min_replicas=1, join_timeout_ms=300)
    target = 8

    def replica(name: str, seed: int, started: threading.Event | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        model = nn.Linear(6, 4)
        for n, p in list(model.named_parameters()):
            setattr(model, n, nn.Parameter(distribute_tensor(p.detach(), mesh1, [Shard(0)])))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
        m = Manager(pg, None, None, min_replica_size=1, rank=0, world_size=1, hostname="127.0.0.1",
                    store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id=name,
                    timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=20),
                    connect_timeout=timedelta(seconds=10), heal_on_training_thread=training_thread)
        m.set_state_dict_fns(lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
                             lambda: {"model": model.state_dict(), "optim": opt.state_dict()})
        try:
            deadline = time.monotonic() + 60
            while not done_together(m, target) and time.monotonic() < deadline:
                if started is not None and m.current_step() >= 3:
                    started.set()  # the late replica may start now
                m.start_quorum()
                g = torch.Generator().manual_seed(m.current_step())
                x = distribute_tensor(torch.randn(8, 6, generator=g), mesh1, [Shard(0)])
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                for p in model.parameters():
                    assert isinstance(p.grad, DTensor)
                    m.allreduce(p.grad.to_local()).wait()
                if m.should_commit():
                    opt.step()
                time.sleep(0.02)
            assert done_together(m, target), (f"{name} at step {m.current_step()}, no round committed with both "
                                              f"replicas: {m.errored()}")
            out = {f"p.{n}": _local(p) for n, p in model.named_parameters()}
            # A healing round (not necessarily committed: a round that fails for both after
            # the state landed leaves b at a's state and step, with nothing left to heal).
            out["healed"] = torch.tensor([any(r.healing for r in m.step_records())])
            for i, p in enumerate(model.parameters()):
                out[f"m.{i}"] = _local(opt.state[p]["momentum_buffer"])
            return out
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    sa, sb = early_then_late(lambda ahead: replica("dt_a", 1, ahead), lambda: replica("dt_b", 2, None),
                             "replica a never reached step 3")
    assert sb.pop("healed").item() and not sa.pop("healed").item()  # b healed; a never did
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
