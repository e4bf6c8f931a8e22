"""A replica group (one rank, one process) that trains through the integrations: the
``Optimizer`` wrapper with a ``StepLR`` registered on it, and a ``DistributedSampler``
over a shared synthetic dataset whose position is part of the healed state.

After every step it writes its progress (step, parameter hash, current learning rate,
scheduler epoch, sampler position, history) to a JSON file, and it stops once its step
reaches the target written to the stop file (or after its own wall-clock limit), as
``tests/replica_worker.py`` does. ``OptimReplicas`` is that module's ``Replicas`` harness
pointed at this script.

Command line: ``LIGHTHOUSE NAME SEED OUT STOP OPTS_JSON``; OPTS: ``replica_rank`` and
``num_groups`` (the sampler's shard), ``delay`` (seconds between steps), ``timeout``,
``go``: a path; the worker imports everything, then waits (bounded) for that file to
exist before it joins, so a test can have a replacement ready before it kills a replica.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from replica_worker import Replicas, record_hash, round_row

HERE = Path(__file__).resolve()
LIMIT_S = 60.0  # a worker's own wall-clock limit, from joining
GO_LIMIT_S = 180.0  # how long a replacement waits for its go file
DATASET_SIZE = 40  # 20 samples per group per epoch, 5 batches of 4: a run crosses epochs
BATCH = 4


def run(lighthouse: str, name: str, seed: int, out: str, stop: str, opts: dict[str, Any]) -> int:
    from datetime import timedelta

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from rallypoint.integrations.data import DistributedSampler
    from rallypoint.integrations.optim import Optimizer
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)

    torch.manual_seed(seed)  # a restarted replica starts from other weights: only healing makes it equal
    model = nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Same data on every replica group; the sampler gives each group its own share.
    data = torch.randn(DATASET_SIZE, 4, generator=torch.Generator().manual_seed(7))
    dataset = TensorDataset(data)
    sampler = DistributedSampler(dataset, replica_rank=int(opts["replica_rank"]),
                                 num_replica_groups=int(opts.get("num_groups", 2)), seed=3)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=0)

    go = opts.get("go")
    if go:  # a replacement started early: imports done, join only when told to
        deadline = time.monotonic() + GO_LIMIT_S
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.02)

    timeout = timedelta(seconds=float(opts.get("timeout", 10)))
    pg = ProcessGroupGloo(timeout=timeout)

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    m = Manager(
        pg=pg, load_state_dict=load, state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1, store_addr="127.0.0.1", lighthouse_addr=lighthouse, replica_id=name,
        hostname="127.0.0.1", timeout=timeout, quorum_timeout=2 * timeout, connect_timeout=timedelta(seconds=10),
    )
    opt = Optimizer(m, inner)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    opt.register_scheduler(sched)  # healed with the rest, stepped only on commit
    m.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)

    def batches() -> Any:
        while True:  # one DataLoader pass per epoch; the sampler moves to the next epoch itself
            for (x,) in loader:
                yield x

    it = batches()
    history: list[list[Any]] = []
    rounds: list[list[Any]] = []  # round_row() of every round (Replicas.assert_identical)
    hashes: dict[str, str] = {}
    t0 = time.monotonic()
    rc = 0
    delay = float(opts.get("delay", 0.05))
    try:
        while True:
            if os.path.exists(stop):
                target = int(Path(stop).read_text() or "1000000")
                if m.current_step() >= target:
                    break
            if time.monotonic() - t0 > LIMIT_S:
                rc = 3
                break
            x = next(it)  # before zero_grad(): the position a peer serves is "after this batch"
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            works = [m.allreduce(p.grad) for p in model.parameters()]
            for w in works:
                w.wait()
            participants = m.num_participants()
            committed = opt.step()
            lr = opt.param_groups[0]["lr"]
            history.append([m.current_step(), participants, int(committed), lr])
            rounds.append(round_row(m))
            h = record_hash(hashes, m.current_step(), model)
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({
                "step": m.current_step(), "batches": m.batches_committed(), "hash": h, "lr": lr,
                "last_lr": sched.get_last_lr(), "sched_epoch": sched.last_epoch, "sampler": sampler.state_dict(),
                "history": history, "rounds": rounds, "hashes": hashes, "replica_id": m.replica_id,
            }))
            os.replace(tmp, out)
            time.sleep(delay)  # paces the replicas so they overlap; not a wait for an event
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
    return rc


class OptimReplicas(Replicas):
    """``replica_worker.Replicas`` (progress files, waits with deadlines, kill by pid)
    starting this script instead."""

    script = HERE


if __name__ == "__main__":
    lh_addr, name_, seed_s, out_s, stop_s, opts_s = sys.argv[1:7]
    sys.exit(run(lh_addr, name_, int(seed_s), out_s, stop_s, json.loads(opts_s)))
