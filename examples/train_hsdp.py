"""Fault-tolerant HSDP: FSDP2 inside each replica group, the gradients averaged across
replica groups by rallypoint, on synthetic data.

Each replica group is one ``rallypoint run`` (or torchrun); its ranks shard the model with
FSDP2 over the group's own process group. Kill a group and start it again, and it heals
from a live one (model and optimizer shards, group rank g from group rank g)::

    rallypoint lighthouse --min-replicas 1 &
    export RALLYPOINT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    rallypoint run --nproc-per-node 2 --replica-group-id 0 examples/train_hsdp.py &
    rallypoint run --nproc-per-node 2 --replica-group-id 1 examples/train_hsdp.py &

Every group has the same number of ranks: group rank g holds the same shard in every group
and averages it with them. Environment as in ``train_ddp.py``. gloo on CPU, NCCL on GPU.

With ``--checkpoint-dir DIR --checkpoint-every N`` (or ``rallypoint run --checkpoint-dir DIR``)
the groups also write a durable checkpoint every N steps: every rank of every group writes
its own shards of its group's part, off the training thread; a job that lost every group
resumes from the newest complete one (model and optimizer shards, the data position).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rallypoint
from rallypoint.integrations.fsdp import fully_shard_replicated

Hook = Callable[..., bool]


def main(hook: Hook | None = None) -> None:
    """Train until ``--steps`` steps are committed. ``hook``: for the demo and the tests
    only (``examples/demo/instrumented.py``), as in ``train_ddp.py``."""
    ap = argparse.ArgumentParser(description="fault-tolerant HSDP (FSDP2 per replica group) on synthetic data")
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many committed steps (1000)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (16)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    ap.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a step commits with (1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective and heal timeout, seconds (10)")
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
    manager = rallypoint.Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=args.min_replicas,
                                 timeout=timeout, quorum_timeout=3 * timeout)
    # The group's own process group: FSDP shards over it (rallypoint run / torchrun host its store).
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=60))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=gen)
    y = torch.tanh(x @ torch.randn(32, 4, generator=gen)) + 0.05 * torch.randn(4096, 4, generator=gen)
    dataset = TensorDataset(x, y)
    sampler = rallypoint.DistributedSampler(dataset, replica_rank=group, num_replica_groups=num_groups,
                                            group_rank=rank, num_replicas=world_size, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    # Every Linear is its own FSDP unit. The helper adds the cross-group all-reduce hook and
    # registers the model and optimizer shards as what a healing group receives.
    fsdp = fully_shard_replicated(model, manager, lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                                  shard_submodules=(nn.Linear,))
    assert fsdp.optimizer is not None
    optimizer = rallypoint.Optimizer(manager, fsdp.optimizer)  # zero_grad starts the quorum
    if args.checkpoint_dir and not os.environ.get("RALLYPOINT_CHECKPOINT_DIR"):  # that one needs no code
        # Restored at the first round (before the first quorum), AdamW's moments included.
        rallypoint.DurableCheckpoint(manager, args.checkpoint_dir, every=args.checkpoint_every)
    state = {"manager": manager, "model": model, "optimizer": fsdp.optimizer}
    stop = bool(hook and hook("ready", **state))

    loss = torch.zeros(())
    try:
        while not stop and manager.current_step() < args.steps:
            for xb, yb in loader:
                if manager.current_step() >= args.steps:
                    break
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
                loss.backward()  # FSDP reduce-scatters in the group; the hook averages across groups
                committed = optimizer.step()  # heals (on this thread) and steps only on commit
                if hook and hook("step", loss=loss, committed=committed, **state):
                    stop = True
                    break
    finally:
        if hook:
            hook("exit", **state)
        manager.shutdown(wait=False)
        pg.shutdown()
        dist.destroy_process_group()
    if rank == 0:
        print(f"group {group}: stopped at step {manager.current_step()}, loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
