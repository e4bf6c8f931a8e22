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
import logging
import os
import sys
from datetime import timedelta

# _common imports torch only where it is used: the --local-ranks launcher stays light.
if __package__:  # imported as examples.train_hsdp
    from . import _common
else:  # run as a script (python or torchrun): this file's folder is on sys.path
    import _common

log = logging.getLogger("train_hsdp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fault-tolerant HSDP (FSDP2 per replica group) on synthetic data")
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many committed steps (1000)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (16)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    ap.add_argument("--local-ranks", type=int, default=0,
                    help="start this many ranks of the group here (without torchrun); 0: this process is one rank")
    ap.add_argument("--stop-file", default=None, help="stop once the step reaches the number in this file")
    _common.add_common_args(ap, samples=4096)  # --progress, --max-seconds, --min-replicas, --timeout, ...
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.local_ranks and "RANK" not in os.environ:
        return _common.launch_local(__file__, args.local_ranks, raw, args.max_seconds)
    return train(args)


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import rallypoint
    from rallypoint.integrations.fsdp import fully_shard_replicated

    torch.set_num_threads(1)
    env = _common.replica_env(args.hostname)  # torchrun's RANK/WORLD_SIZE/..., REPLICA_GROUP_ID, ...
    rank, world_size, group = env.rank, env.world_size, env.group
    _common.setup_logging(args.log_level, env)

    device = _common.pick_device(rank)
    use_cuda = device.type == "cuda"
    timeout = timedelta(seconds=args.timeout)
    connect = timedelta(seconds=args.connect_timeout)
    pg = rallypoint.ProcessGroupNCCL(timeout=timeout) if use_cuda else rallypoint.ProcessGroupGloo(timeout=timeout)
    manager = rallypoint.Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=args.min_replicas, hostname=env.hostname,
        timeout=timeout, quorum_timeout=3 * timeout, connect_timeout=connect,
        checkpoint_transport=_common.checkpoint_transport(env.hostname, timeout),
    )
    # The group's own process group (FSDP shards over it, and its reduce-scatter averages the
    # gradients over the group's ranks), even for a group of one rank; env:// joins the store
    # torchrun / rallypoint run (or --local-ranks) hosts at MASTER_ADDR:MASTER_PORT.
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=connect)

    dataset = TensorDataset(*_common.synthetic_regression(args.samples))
    sampler = rallypoint.DistributedSampler(dataset, replica_rank=group, num_replica_groups=env.num_groups,
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

    def shards_sha256() -> str:  # this rank's local shards of the parameters
        return _common.tensors_sha256(p.to_local() for p in model.parameters())

    progress = _common.Progress(args.progress, group=group, rank=rank)
    if rank == 0:
        print(f"group {group}: manager ready as {manager.replica_id} ({world_size} rank(s), "
              f"{'nccl' if use_cuda else 'gloo'})", flush=True)
    deadline = _common.Deadline(args.max_seconds)
    batches = _common.forever(loader)
    rc = 0
    loss = torch.zeros(())
    try:
        while manager.current_step() < args.steps:
            if _common.stop_requested(args.stop_file, manager.current_step()):
                break
            if deadline.expired():
                log.warning("giving up after %.0f s at step %d", args.max_seconds, manager.current_step())
                rc = 3
                break
            xb, yb = next(batches)  # the batch before zero_grad(): see rallypoint.integrations.data
            optimizer.zero_grad()  # starts this step's quorum
            loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
            loss.backward()  # FSDP reduce-scatters in the group; the hook averages across groups
            committed = optimizer.step()  # heals (on this thread) and steps only on commit
            progress.write(event="step", step=manager.current_step(), committed=committed,
                           participants=manager.num_participants(), loss=round(float(loss.detach()), 5),
                           sha256=shards_sha256(), heals=fsdp.state.loads)
    except KeyboardInterrupt:
        rc = 130
    finally:
        progress.write(event="exit", step=manager.current_step(), sha256=shards_sha256(), heals=fsdp.state.loads,
                       rc=rc)
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
