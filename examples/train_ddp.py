"""Fault-tolerant DDP training of a small MLP on synthetic data: one replica group per launch.

Every rank of every replica group runs this script. A replica group is one torchrun
invocation (or one plain ``python`` process); groups may die and come back at any time,
and a returning group heals from a live peer instead of reading a checkpoint::

    rallypoint lighthouse --min-replicas 2 &
    export RALLYPOINT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node 1 --master-port 29600 examples/train_ddp.py &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node 1 --master-port 29601 examples/train_ddp.py &

Environment: ``REPLICA_GROUP_ID`` (this group's index, also its data shard),
``NUM_REPLICA_GROUPS``, ``RALLYPOINT_LIGHTHOUSE`` (or ``TORCHFT_LIGHTHOUSE``), and
torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (without torchrun:
rank 0 of a group of 1 on a free port). Every replica group must have the same number
of ranks. The gradients are averaged over every rank of every participating group, as
torch's DDP over all ranks would: inside the group over its own process group (the
wrapper initialises it in the group's store), across groups through the manager (group
rank ``g`` with group rank ``g``). gloo on CPU; NCCL when CUDA is available.

Only the public API is used: ``rallypoint.Manager`` with ``rallypoint.DistributedDataParallel``
(gradient buckets averaged over every rank of the live replica groups), ``rallypoint.Optimizer`` (``zero_grad``
starts the quorum, ``step`` steps only on commit) and ``rallypoint.DistributedSampler``
(disjoint shards; its position heals with the model).

``--progress FILE`` appends one JSON line per step (step, participants, committed,
sha256 of the parameters, batches_committed, heals) for a demo or a test to follow;
``--stop-file FILE`` holding a step number makes the script stop once it reaches it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rallypoint

if __package__:  # imported as examples.train_ddp
    from . import _common
else:  # run as a script (python or torchrun): this file's folder is on sys.path
    import _common

log = logging.getLogger("train_ddp")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class HealTimer(logging.Handler):
    """Times the state transfer of a heal from the manager's own log records
    ("healing to step ..." then "received the state of step ...")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.started: float | None = None
        self.received: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "healing to step" in msg:
            self.started, self.received = record.created, None
        elif "received the state of step" in msg:
            self.received = record.created


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fault-tolerant DDP training on synthetic data (one replica group)")
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many committed steps (1000)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (32)")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (0.05)")
    ap.add_argument("--sleep", type=float, default=0.0, help="simulated compute seconds per step (0)")
    ap.add_argument("--stop-file", default=None, help="stop once the step reaches the number in this file")
    ap.add_argument("--wait-file", default=None, help="stand by (torch imported, model built) until this file "
                    "exists, then join: a pre-warmed replacement for a replica that may die")
    _common.add_common_args(ap)  # --progress, --max-seconds, --min-replicas, --timeout, ...
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = _common.replica_env(args.hostname)  # torchrun's RANK/WORLD_SIZE/..., REPLICA_GROUP_ID, ...
    rank, world_size, group = env.rank, env.world_size, env.group

    _common.setup_logging(args.log_level, env)
    heal_timer = HealTimer()
    for handler in logging.getLogger().handlers:  # the console keeps --log-level ...
        handler.setLevel(args.log_level.upper())
    manager_log = logging.getLogger("rallypoint.manager")
    manager_log.addHandler(heal_timer)
    manager_log.setLevel(min(manager_log.getEffectiveLevel(), logging.INFO))  # ... the timer needs INFO

    device = _common.pick_device(rank)
    use_cuda = device.type == "cuda"
    timeout = timedelta(seconds=args.timeout)
    pg = rallypoint.ProcessGroupNCCL(timeout=timeout) if use_cuda else rallypoint.ProcessGroupGloo(timeout=timeout)

    # The same synthetic regression data on every rank (seeded); each rank reads its shard.
    dataset = TensorDataset(*_common.synthetic_regression(args.samples))
    sampler = rallypoint.DistributedSampler(dataset, replica_rank=group, num_replica_groups=env.num_groups,
                                            group_rank=rank, num_replicas=world_size, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)  # one init everywhere: group rank g heals from group rank g of the primary group
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    heals: list[dict[str, Any]] = []
    step_started = [0.0]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        now = time.time()
        transfer = (heal_timer.received - heal_timer.started
                    if heal_timer.started is not None and heal_timer.received is not None else None)
        heals.append({"t": now, "bytes": tensor_bytes(sd), "transfer_s": transfer,
                      "step_s": now - step_started[0]})

    progress = _common.Progress(args.progress, group=group, rank=rank, pid=os.getpid())
    if args.wait_file:
        progress.write(event="standby", step=0)
        standby = _common.Deadline(args.max_seconds)
        while not os.path.exists(args.wait_file):
            if standby.expired():
                return 3
            time.sleep(0.02)
    manager = rallypoint.Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=args.min_replicas,
        hostname=env.hostname, timeout=timeout, quorum_timeout=3 * timeout,
        connect_timeout=timedelta(seconds=args.connect_timeout),
        checkpoint_transport=_common.checkpoint_transport(env.hostname, timeout),
    )
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    # Averages over every rank of every participating group: inside this group over its own
    # process group (initialised by the wrapper in the group's store when there are several
    # ranks), across groups through the manager.
    ddp = rallypoint.DistributedDataParallel(manager, model)
    optimizer = rallypoint.Optimizer(manager, inner)
    progress.write(event="ready", step=manager.current_step(), replica_id=manager.replica_id)
    if rank == 0:
        print(f"group {group}: manager ready as {manager.replica_id} ({'nccl' if use_cuda else 'gloo'}, "
              f"{world_size} rank(s))", flush=True)

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
            step_started[0] = time.time()
            n_heals = len(heals)
            optimizer.zero_grad()  # starts this step's quorum
            if args.sleep:
                time.sleep(args.sleep)  # simulated compute; the quorum forms meanwhile
            loss = nn.functional.mse_loss(ddp(xb.to(device)), yb.to(device))
            loss.backward()  # averages the gradients over every rank of every participating group
            committed = optimizer.step()  # steps only if every replica's allreduce succeeded
            rec: dict[str, Any] = {
                "event": "step", "step": manager.current_step(), "committed": committed,
                "participants": manager.num_participants(), "batches_committed": manager.batches_committed(),
                "loss": round(float(loss.detach()), 5), "sha256": _common.tensors_sha256(model.parameters()),
                "heals": len(heals),
            }
            if len(heals) > n_heals:
                rec["heal"] = heals[-1]
            progress.write(**rec)
    except KeyboardInterrupt:
        rc = 130
    finally:
        progress.write(event="exit", step=manager.current_step(), sha256=_common.tensors_sha256(model.parameters()),
                       rc=rc, batches_committed=manager.batches_committed(), heals=len(heals))
        progress.close()
        ddp.shutdown()  # also ends the group's process group it initialised
        manager.shutdown(wait=False)
        pg.shutdown()
    if rank == 0:
        print(f"group {group}: stopped at step {manager.current_step()}, loss {float(loss.detach()):.4f}, "
              f"{len(heals)} heal(s)", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
