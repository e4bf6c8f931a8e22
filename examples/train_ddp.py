"""Fault-tolerant DDP: train a small MLP on synthetic data with rallypoint.

Every rank of every replica group runs this script. Start a lighthouse, then one
``rallypoint run`` (or torchrun) per replica group; kill a group and start it again, and
it heals from a live peer instead of reading a checkpoint::

    rallypoint lighthouse --min-replicas 1 &
    export RALLYPOINT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    rallypoint run --nproc-per-node 2 --replica-group-id 0 examples/train_ddp.py &
    rallypoint run --nproc-per-node 2 --replica-group-id 1 examples/train_ddp.py &

(or ``REPLICA_GROUP_ID=0 torchrun --nproc-per-node 2 --master-port 29600 examples/train_ddp.py``).
With ``--checkpoint-dir DIR --checkpoint-every N`` (or ``rallypoint run --checkpoint-dir DIR``)
the groups also write a durable checkpoint every N steps, and a job that lost every group
resumes from the newest complete one.
Environment: ``REPLICA_GROUP_ID`` (this group's index, also its data shard),
``NUM_REPLICA_GROUPS``, ``RALLYPOINT_LIGHTHOUSE``, and torchrun's ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` (plain ``python``: rank 0 of a group of one). Every group
has the same number of ranks. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rallypoint

Hook = Callable[..., bool]


def main(hook: Hook | None = None) -> None:
    """Train until ``--steps`` steps are committed.

    ``hook`` is for the demo and the tests (``examples/demo/instrumented.py``), not needed
    to train: it is called as ``hook("ready" | "step" | "exit", manager=..., model=...,
    optimizer=...)``, and training stops when it returns True."""
    ap = argparse.ArgumentParser(description="fault-tolerant DDP training on synthetic data")
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many committed steps (1000)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (32)")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (0.05)")
    ap.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a step commits with (1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective and heal timeout, seconds (10)")
    ap.add_argument("--sleep", type=float, default=0.0, help="simulated compute seconds per step (0)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="durable checkpoints, shared by every group (a folder or fsspec URL): written every "
                         "--checkpoint-every steps, the newest complete one restored when the job starts again")
    ap.add_argument("--checkpoint-every", type=int, default=100, help="committed steps between checkpoints (100)")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args()

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 1))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [group {group} rank {rank}] %(name)s: %(message)s")

    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)
    pg = rallypoint.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" \
        else rallypoint.ProcessGroupGloo(timeout=timeout)

    # The same seeded data on every rank; the sampler gives each group and rank its own shard.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=gen)
    y = torch.tanh(x @ torch.randn(32, 4, generator=gen)) + 0.05 * torch.randn(8192, 4, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = rallypoint.DistributedSampler(dataset, replica_rank=group, num_replica_groups=num_groups,
                                            group_rank=rank, num_replicas=world_size, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # What a returning group receives from a live peer when it heals.
    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = rallypoint.Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                                 min_replica_size=args.min_replicas, timeout=timeout, quorum_timeout=3 * timeout)
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    if args.checkpoint_dir and not os.environ.get("RALLYPOINT_CHECKPOINT_DIR"):  # that one needs no code
        # Every group writes a share every N steps, off the training thread; a job that lost
        # every group resumes from the newest complete one (docs/checkpoint.md).
        rallypoint.DurableCheckpoint(manager, args.checkpoint_dir, every=args.checkpoint_every)
    # Averages the gradients over every rank of every participating group, as torch's DDP would.
    ddp = rallypoint.DistributedDataParallel(manager, model)
    optimizer = rallypoint.Optimizer(manager, inner)  # zero_grad starts the quorum, step steps on commit
    state = {"manager": manager, "model": model, "optimizer": inner}
    stop = bool(hook and hook("ready", **state))

    loss = torch.zeros(())
    try:
        while not stop and manager.current_step() < args.steps:
            for xb, yb in loader:  # the batch before zero_grad(): its position heals with the model
                if manager.current_step() >= args.steps:
                    break
                optimizer.zero_grad()
                time.sleep(args.sleep)
                loss = nn.functional.mse_loss(ddp(xb.to(device)), yb.to(device))
                loss.backward()
                committed = optimizer.step()  # steps only if every replica group's allreduce succeeded
                if hook and hook("step", loss=loss, committed=committed, **state):
                    stop = True
                    break
    finally:
        if hook:
            hook("exit", **state)
        ddp.shutdown()
        manager.shutdown(wait=False)
        pg.shutdown()
    if rank == 0:
        print(f"group {group}: stopped at step {manager.current_step()}, loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
