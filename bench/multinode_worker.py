"""The training script of ``bench/multinode.py``: one rank of a replica group with a
Manager (a small linear model, the same data on every rank), run under ``rallypoint run``.
It records its state after each step (``state.g<G>.r<RANK>``) and its first committed step
of each start (``first.g<G>.r<RANK>``: the incarnation and the wall time) in the folder
given as its argument; the benchmark reads them."""

import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

import rallypoint

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
gid, rank = os.environ["REPLICA_GROUP_ID"], int(os.environ["RANK"])
inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = nn.Linear(8, 1)
manager = rallypoint.Manager(pg=rallypoint.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                             load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                             hostname=os.environ.get("NODE_ADDR", "127.0.0.1"), timeout=timedelta(seconds=20),
                             quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=20))
ddp = rallypoint.DistributedDataParallel(manager, model)
optimizer = rallypoint.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.01))


def save(name: str, **kw: object) -> None:
    path = os.path.join(out, f"{name}.g{gid}.r{rank}")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "inc": inc, "step": manager.current_step(), **kw}, f)
    os.replace(path + ".tmp", path)


first = True
while True:
    optimizer.zero_grad()
    ddp(torch.ones(4, 8)).sum().backward()
    committed = optimizer.step()
    if committed and first:
        save("first", t=time.time())
        first = False
    save("state")
    time.sleep(0.1)  # simulated compute
