"""One rank of 2 replica groups x 2 ranks whose state is sharded (a DTensor ``Shard(0)``
over the group's ranks, as FSDP2 holds it), for ``test_checkpoint_dtensor.py``.

Usage: ``checkpoint_dtensor_worker.py RANK RENDEZVOUS_FILE DIR``. Saves step 2 with a
``DurableCheckpoint`` (each rank writes its own shard of its group's keys; an Adam over a
sharded parameter, after one step), then restores it into a fresh zeroed state whose Adam
has no state yet, and prints ``{"rank", "equal", "moments", "step"}`` as one JSON line.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any


def main(rank: int, rendezvous: str, path: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rallypoint.checkpoint import DurableCheckpoint
    from rallypoint.manager._state import UserState

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=4)
    shard = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))["shard"]

    class Standin:
        def __init__(self, fill: float | None) -> None:
            g = torch.Generator().manual_seed(0)
            full = [torch.randn(8, 4, generator=g), torch.randn(6, generator=g)]
            if fill is not None:
                full = [torch.full_like(t, fill) for t in full]
            self.state = {"w": distribute_tensor(full[0], shard, [Shard(0)]),
                          "v": distribute_tensor(full[1], shard, [Shard(0)]), "bias": full[1].clone() * 2}
            self.p = torch.nn.Parameter(distribute_tensor(full[0].clone() + 1, shard, [Shard(0)]))
            self.opt = torch.optim.Adam([self.p], lr=0.1)  # no state before its first step
            self.step_hooks: list[Any] = []
            self._user_state = UserState()
            self._user_state.register("default", self.load, lambda: {**self.state, "p": self.p,
                                                                      "opt": self.opt.state_dict()})
            self.step, self.group_rank, self.group_world_size, self.replica_id = 0, rank % 2, 2, f"g{rank // 2}"

        def load(self, sd: dict[str, Any]) -> None:
            self.opt.load_state_dict(sd.pop("opt"))
            sd.pop("p")  # loaded in place
            self.state.update(sd)

        def state_dict(self) -> dict[str, int]:
            return {"step": self.step, "batches_committed": 2 * self.step}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.step = int(sd["step"])

        def current_step(self) -> int:
            return self.step

        def step_record(self) -> Any:
            return None if self.step == 0 else types.SimpleNamespace(
                outcome="committed", replica_rank=rank // 2, replica_world_size=2, quorum_id=1, participants=("g0", "g1"))

    m = Standin(None)
    m.p.grad = m.p.detach() * 0.5  # one Adam step: exp_avg, exp_avg_sq and step exist
    m.opt.step()
    ck = DurableCheckpoint(m, path, every=2, commit_timeout=60)
    ck.at_boundary()  # the first round: nothing to restore
    m.step = 2
    ck.at_boundary()
    assert ck.wait(60), "the write did not finish"
    written = ck.stats()["last_bytes"]
    dist.barrier()
    fresh = Standin(0.0)
    DurableCheckpoint(fresh, path, every=2).at_boundary()
    equal = all(torch.equal(fresh.state[k].to_local(), m.state[k].to_local()) for k in ("w", "v")) \
        and torch.equal(fresh.state["bias"], m.state["bias"]) and torch.equal(fresh.p.to_local(), m.p.to_local())
    a, b = m.opt.state[m.p], fresh.opt.state.get(fresh.p, {})
    moments = set(b) == set(a) and all(torch.equal(b[k].to_local(), a[k].to_local()) for k in ("exp_avg", "exp_avg_sq")) \
        and float(b["step"]) == float(a["step"]) == 1.0 and type(b["exp_avg"]) is type(a["exp_avg"])
    print(json.dumps({"rank": rank, "equal": equal, "moments": moments, "step": fresh.step, "bytes": written}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
