"""Fault-tolerant HSDP training on synthetic data: FSDP2 inside each replica group, the
gradients averaged across replica groups by the rallypoint Manager.

Each replica group is one torchrun job; its ranks shard the model with FSDP2 (over the
group's own gloo/NCCL process group). Groups may die and come back at any time; a
returning group heals from a live one (model and optimizer shards, rank g from rank g)::

    rallypoint lighthouse --min-replicas 1 &
    export RALLYPOINT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node 2 --master-port 29600 examples/train_hsdp.py &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node 2 --master-port 29601 examples/train_hsdp.py &

Without torchrun, ``--local-ranks N`` starts the group's N ranks itself (each a child
process with torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), on CPU::

    REPLICA_GROUP_ID=0 python examples/train_hsdp.py --local-ranks 2 &
    REPLICA_GROUP_ID=1 python examples/train_hsdp.py --local-ranks 2 &

Every group must have the same number of ranks: group rank ``g`` holds the same FSDP
shard in every group and averages it with them. Environment as in ``train_ddp.py``:
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``RALLYPOINT_LIGHTHOUSE``.

What it shows: ``fully_shard_replicated`` (FSDP2 + the cross-group all-reduce hook +
heal state that is read and loaded on the training thread), the
``rallypoint.Optimizer`` wrapper (``zero_grad`` starts the quorum, ``step`` steps only on
commit) and ``rallypoint.DistributedSampler`` (its position heals with the model).
``--progress FILE`` appends one JSON line per step (step, committed, participants, sha256
of this rank's local shards, heals); ``--stop-file FILE`` holding a step number stops
every rank once it reaches it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger("train_hsdp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(n: int, argv: list[str], max_seconds: float) -> int:
    """torchrun's job for one replica group on this host: start ``n`` ranks of this
    script and wait for them. If one fails the others are stopped (the group restarts
    as a whole, as torchrun would)."""
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    deadline = time.monotonic() + (max_seconds + 60 if max_seconds else 10**9)
    rc = 0
    try:
        while procs and time.monotonic() < deadline:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code != 0:
                    rc = rc or code
                    for q in procs:  # a dead rank leaves its group unusable
                        q.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        if procs:
            rc = rc or 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    return rc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fault-tolerant HSDP (FSDP2 per replica group) on synthetic data")
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many committed steps (1000)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (16)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    ap.add_argument("--local-ranks", type=int, default=0,
                    help="start this many ranks of the group here (without torchrun); 0: this process is one rank")
    ap.add_argument("--progress", default=None, help="append one JSON line per step to this file")
    ap.add_argument("--stop-file", default=None, help="stop once the step reaches the number in this file")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="give up after this long (0: never); rc 3")
    ap.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a step may commit with (1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective / transfer timeout, seconds (10)")
    ap.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to reach the lighthouse and store")
    ap.add_argument("--samples", type=int, default=4096, help="size of the synthetic dataset (4096)")
    ap.add_argument("--log-level", default="WARNING")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.local_ranks and "RANK" not in os.environ:
        return launch_local(args.local_ranks, raw, args.max_seconds)
    return train(args)


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import rallypoint
    from rallypoint.integrations.fsdp import fully_shard_replicated

    torch.set_num_threads(1)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "MASTER_PORT" not in os.environ:
        if world_size != 1:
            raise SystemExit("MASTER_ADDR/MASTER_PORT must be set when WORLD_SIZE > 1 (torchrun sets them)")
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    os.environ.setdefault("REPLICA_GROUP_ID", str(group))
    hostname = "127.0.0.1" if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost") else socket.gethostname()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [group {group} rank {rank}] %(name)s: %(message)s")

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()) \
        if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)
    connect = timedelta(seconds=args.connect_timeout)
    pg = rallypoint.ProcessGroupNCCL(timeout=timeout) if use_cuda else rallypoint.ProcessGroupGloo(timeout=timeout)
    manager = rallypoint.Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=args.min_replicas, hostname=hostname,
        timeout=timeout, quorum_timeout=3 * timeout, connect_timeout=connect,
        checkpoint_transport=rallypoint.HTTPTransport(timeout=timeout, bind=f"{hostname}:0", advertise_host=hostname)
        if hostname == "127.0.0.1" else None,
    )
    # The group's own process group (FSDP shards over it), rendezvousing in the group's
    # store (the manager's on rank 0, or torchrun's agent store) under its own prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=connect)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.PrefixStore("train_hsdp/intra", store),
                            rank=rank, world_size=world_size, timeout=connect)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 32, generator=gen)
    w_true = torch.randn(32, 4, generator=gen)
    dataset = TensorDataset(x, torch.tanh(x @ w_true) + 0.05 * torch.randn(args.samples, 4, generator=gen))
    sampler = rallypoint.DistributedSampler(dataset, replica_rank=group, num_replica_groups=num_groups,
                                            group_rank=rank, num_replicas=world_size, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    # Every Linear is its own FSDP unit; the root gathers the rest. The helper installs the
    # cross-group all-reduce hook and registers model + optimizer shards as heal state.
    fsdp = fully_shard_replicated(model, manager, lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                                  shard_submodules=(nn.Linear,))
    assert fsdp.optimizer is not None and fsdp.state is not None
    optimizer = rallypoint.Optimizer(manager, fsdp.optimizer)

    def shards_sha256() -> str:
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(bytes(p.detach().to_local().cpu().contiguous().flatten().view(torch.uint8).tolist()))
        return h.hexdigest()

    progress = open(args.progress, "a", buffering=1) if args.progress else None

    def write(**rec: Any) -> None:
        if progress is not None:
            progress.write(json.dumps({"t": time.time(), "group": group, "rank": rank, **rec}) + "\n")

    if rank == 0:
        print(f"group {group}: manager ready as {manager.replica_id} ({world_size} rank(s), "
              f"{'nccl' if use_cuda else 'gloo'})", flush=True)
    t0 = time.monotonic()
    batches = iter(loader)
    rc = 0
    loss = torch.zeros(())
    try:
        while manager.current_step() < args.steps:
            if args.stop_file and os.path.exists(args.stop_file):
                text = open(args.stop_file).read().strip()
                if text and manager.current_step() >= int(text):
                    break
            if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
                log.warning("giving up after %.0f s at step %d", args.max_seconds, manager.current_step())
                rc = 3
                break
            try:  # the batch before zero_grad(): see rallypoint.integrations.data
                xb, yb = next(batches)
            except StopIteration:
                batches = iter(loader)
                xb, yb = next(batches)
            optimizer.zero_grad()  # starts this step's quorum
            loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
            loss.backward()  # FSDP reduce-scatters in the group; the hook averages across groups
            committed = optimizer.step()  # heals (on this thread) and steps only on commit
            write(event="step", step=manager.current_step(), committed=committed,
                  participants=manager.num_participants(), loss=round(float(loss.detach()), 5),
                  sha256=shards_sha256(), heals=fsdp.state.loads)
    except KeyboardInterrupt:
        rc = 130
    finally:
        write(event="exit", step=manager.current_step(), sha256=shards_sha256(), heals=fsdp.state.loads, rc=rc)
        if progress is not None:
            progress.close()
        manager.shutdown(wait=False)
        pg.shutdown()
        dist.destroy_process_group()
    if rank == 0:
        print(f"group {group}: stopped at step {manager.current_step()}, loss {float(loss.detach()):.4f}, "
              f"{fsdp.state.loads} heal(s)", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
