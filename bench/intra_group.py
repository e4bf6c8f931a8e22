"""Averaging inside a replica group of several ranks: the design ``rallypoint.DistributedDataParallel``
uses, against the alternatives, measured in one run.

Two replica groups of two ranks each (four worker processes, gloo on CPU over loopback,
free ports only; each group's ranks share the default process group, rendezvoused in a
TCPStore this script hosts as torchrun's agent would). Every variant trains the same MLP
on different data per rank, in the same processes, in alternating blocks of steps:

- ``composed`` (what the wrapper does): torch's DDP over the group's own process group
  with a hook that sums each bucket inside the group (posted on the autograd thread),
  then averages it across groups through the manager, on a helper thread.
- ``cross_first``: the other two-level order: DDP over a dummy group; the hook posts the
  manager's cross-group average first and a helper thread then sums inside the group
  (a separate process group, so DDP's own collectives cannot interleave) and divides.
- ``helper``: a hand-written in-group average: the wrapper averages across groups only,
  then one flat ``all_reduce`` of every gradient inside the group after ``backward()``
  (no overlap with backward).
- ``plain_ddp``: torch's DDP over all four ranks (one gloo group spanning both replica
  groups, no manager, no fault tolerance): the floor.

Per variant: median and p90 ms/step on group 0's rank 0 (every rank waits for the same
collectives). Ratios: ``composed_vs_plain_ddp``, ``composed_vs_cross_first``,
``composed_vs_helper``. The table and one JSON line ``{"bench": "intra_group", ...}``.

    .venv/bin/python bench/intra_group.py            # ~1 minute on 2 cores
    .venv/bin/python bench/intra_group.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
VARIANTS = ("composed", "cross_first", "helper", "plain_ddp")


# ------------------------------------------------------------------------- the worker


def _gloo(store: Any, rank: int, size: int) -> Any:
    import torch
    import torch.distributed as dist

    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


class CrossFirst:
    """The ``cross_first`` hook: the manager's cross-group mean posted on the autograd
    thread; a helper thread then sums inside the group and divides."""

    def __init__(self, manager: Any, group: Any, world: int) -> None:
        self.manager, self.group, self.world = manager, group, world
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import torch.distributed as dist

        while True:
            work, buf, fut = self.q.get()
            work.wait()
            dist.all_reduce(buf, group=self.group)
            buf.div_(self.world)
            fut.set_result(buf)

    @staticmethod
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations

        import torch
        from torch.distributed import ReduceOp

        buf = bucket.buffer()
        fut: torch.futures.Future = torch.futures.Future()
        state.q.put((state.manager.allreduce(buf, reduce_op=ReduceOp.AVG), buf, fut))
        return fut


def worker(group: int, rank: int, lighthouse: str, global_port: int, steps: int, rounds: int) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from torch import nn

    import rallypoint
    from rallypoint.process_groups.wrappers import ProcessGroupDummy

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the group's own ranks (env://, the store hosted by the driver)
    world = dist.get_world_size()
    everyone = _gloo(dist.PrefixStore("all", dist.TCPStore("127.0.0.1", global_port, is_master=False)),
                     2 * group + rank, 4)
    cross_first_group = dist.new_group()

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))

    models = {v: mlp() for v in VARIANTS}
    pg = rallypoint.ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = rallypoint.Manager(
        pg=pg, min_replica_size=2, hostname="127.0.0.1", timeout=timedelta(seconds=30), lighthouse_addr=lighthouse,
        load_state_dict=lambda sd: [models[v].load_state_dict(sd[v]) for v in VARIANTS],
        state_dict=lambda: {v: models[v].state_dict() for v in VARIANTS},
    )
    wrapped: dict[str, nn.Module] = {
        "composed": rallypoint.DistributedDataParallel(manager, models["composed"]),
        "helper": rallypoint.DistributedDataParallel(manager, models["helper"], process_group=ProcessGroupDummy(0, 1)),
        "plain_ddp": nn.parallel.DistributedDataParallel(models["plain_ddp"], process_group=everyone),
    }
    cf = nn.parallel.DistributedDataParallel(models["cross_first"], process_group=ProcessGroupDummy(0, 1),
                                             find_unused_parameters=True)
    cross_first = CrossFirst(manager, cross_first_group, world)
    cf.register_comm_hook(cross_first, CrossFirst.hook)
    wrapped["cross_first"] = cf
    opts = {v: torch.optim.SGD(models[v].parameters(), lr=1e-3) for v in VARIANTS}
    gen = torch.Generator().manual_seed(100 * group + rank)

    def step(v: str) -> float:
        x, y = torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen)
        t0 = time.perf_counter()
        opts[v].zero_grad()
        if v != "plain_ddp":
            manager.start_quorum()
        nn.functional.mse_loss(wrapped[v](x), y).backward()
        if v == "helper":
            grads = [p.grad for p in models[v].parameters() if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if v == "plain_ddp" or manager.should_commit():
            opts[v].step()
        return time.perf_counter() - t0

    for v in VARIANTS:  # warm-up: the first quorum and init-sync heal, allocator, buckets
        for _ in range(3):
            step(v)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            for _ in range(steps):
                times[v].append(step(v))
    if group == 0 and rank == 0:
        print(json.dumps({"times": times}), flush=True)
    manager.shutdown()
    pg.shutdown()


# ------------------------------------------------------------------------- the driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (fewer steps)")
    args = ap.parse_args()
    steps, rounds = (3, 2) if args.quick else (10, 4)

    from torch.distributed import TCPStore

    from rallypoint.lighthouse.server import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(3)]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    procs = []
    logs = Path(tempfile.mkdtemp(prefix="intra_group."))
    try:
        for g in range(2):
            for r in range(2):
                env = dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(stores[g].port), TORCHELASTIC_USE_AGENT_STORE="True",
                           REPLICA_GROUP_ID=str(g), OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(
                    [sys.executable, str(HERE), "--worker", str(g), str(r), lh.address(), str(stores[2].port),
                     str(steps), str(rounds)], env=env, stdout=subprocess.PIPE, stderr=open(logs / f"g{g}.r{r}.log", "w"), text=True))
        out, _ = procs[0].communicate(timeout=600)
        for p in procs[1:]:
            if procs[0].returncode == 0:
                p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        lh.shutdown(timeout=10)
    line = next((ln for ln in out.splitlines() if ln.startswith("{")), None)
    if line is None or any(p.returncode for p in procs):
        print(f"a worker failed (rc {[p.returncode for p in procs]}); logs in {logs}", file=sys.stderr)
        return 1
    times = json.loads(line)["times"]
    results = {}
    for v in VARIANTS:
        ms = sorted(1000 * t for t in times[v])
        results[v] = {"median_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
                      "steps": len(ms)}
    med = {v: results[v]["median_ms"] for v in VARIANTS}
    ratios = {"composed_vs_plain_ddp": round(med["composed"] / med["plain_ddp"], 3),
              "composed_vs_cross_first": round(med["composed"] / med["cross_first"], 3),
              "composed_vs_helper": round(med["composed"] / med["helper"], 3)}
    print("2 replica groups x 2 ranks, gloo on CPU, MLP 256-1024-1024-256 (1.3 M parameters), batch 32 per rank")
    print(f"{'variant':<12} {'median ms/step':>15} {'p90 ms/step':>12} {'steps':>6}")
    for v in VARIANTS:
        r = results[v]
        print(f"{v:<12} {r['median_ms']:>15.2f} {r['p90_ms']:>12.2f} {r['steps']:>6}")
    print(json.dumps({"bench": "intra_group", "results": results, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        g_, r_, lh_, port_, steps_, rounds_ = sys.argv[2:8]
        worker(int(g_), int(r_), lh_, int(port_), int(steps_), int(rounds_))
        sys.exit(0)
    sys.exit(main())
