"""One replica group (one rank) for the durable-checkpoint tests: a torchft-style loop
with no checkpoint code at all; ``RALLYPOINT_CHECKPOINT_DIR`` (set by the test) makes
the Manager checkpoint and restore by itself.

Usage: ``checkpoint_worker.py LIGHTHOUSE NAME OUT PAUSE_AT STOP_AT``. It appends one JSON
line per event to ``OUT``: ``{"resume": step, "hash": h}`` after its first
``start_quorum`` (a restore happens there), then ``{"step": s, "hash": h}`` after each
committed step (the parameters' hash: what the test compares with a restore). At
``PAUSE_AT`` it stops training and waits (at most 120 s) to be killed; at ``STOP_AT`` it
shuts down cleanly. With ``CHECKPOINT_TEST_GO=FILE`` it creates ``OUT.ready`` once its
Manager is up, and starts training when ``FILE`` exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def main(lighthouse: str, name: str, out: str, pause_at: int, stop_at: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    from torch import nn

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def save() -> dict:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    def digest() -> str:
        return hashlib.sha256(repr([p.detach().flatten().tolist() for p in model.parameters()]).encode()).hexdigest()[:16]

    def record(**kw: object) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(kw) + "\n")

    timeout = timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)
    m = Manager(pg=pg, load_state_dict=load, state_dict=save, min_replica_size=1, replica_id=name,
                lighthouse_addr=lighthouse, hostname="127.0.0.1", store_addr="127.0.0.1", rank=0, world_size=1,
                timeout=timeout, quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10))
    gen = torch.Generator().manual_seed(7)
    first = True
    t_end = time.monotonic() + 120
    go = os.environ.get("CHECKPOINT_TEST_GO")  # wait for every group to be up (the test creates it)
    if go:
        Path(out + ".ready").touch()
        while not os.path.exists(go) and time.monotonic() < t_end:
            time.sleep(0.05)
    try:
        while m.current_step() < stop_at and time.monotonic() < t_end:
            if m.current_step() >= pause_at:
                time.sleep(0.05)  # waiting for the test's SIGKILL, bounded by t_end
                continue
            m.start_quorum()
            if first:
                record(resume=m.current_step(), hash=digest())
                first = False
            x = torch.randn(16, 8, generator=gen)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                m.allreduce(p.grad).wait()
            if m.should_commit():
                opt.step()
                record(step=m.current_step(), hash=digest())
            time.sleep(0.02)
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
    return 0 if m.current_step() >= stop_at else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
