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
of ranks: group rank ``g`` averages its gradients with group rank ``g`` of the others.
gloo on CPU; NCCL when CUDA is available.

Only the public API is used: ``rallypoint.Manager`` with ``rallypoint.DistributedDataParallel``
(gradient buckets averaged over the live replicas), ``rallypoint.Optimizer`` (``zero_grad``
starts the quorum, ``step`` steps only on commit) and ``rallypoint.DistributedSampler``
(disjoint shards; its position heals with the model).

``--progress FILE`` appends one JSON line per step (step, participants, committed,
sha256 of the parameters, batches_committed, heals) for a demo or a test to follow;
``--stop-file FILE`` holding a step number makes the script stop once it reaches it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rallypoint

log = logging.getLogger("train_ddp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def params_sha256(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in order (identical replicas, identical hash)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().cpu().contiguous().flatten().view(torch.uint8).tolist()))
    return h.hexdigest()


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


class Progress:
    """One JSON line per event, appended and flushed (a reader tails the file)."""

    def __init__(self, path: str | None, **fixed: Any) -> None:
        self._f = open(path, "a", buffering=1) if path else None
        self._fixed = fixed

    def write(self, **rec: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"t": time.time(), **self._fixed, **rec}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def intra_group(rank: int, world_size: int, timeout: timedelta, backend: str) -> bool | None:
    """The plain torch process group of this replica group's own ranks (None for one rank).

    It rendezvouses in the group's TCPStore at MASTER_ADDR:MASTER_PORT (the manager's on
    group rank 0, or torchrun's agent store), under its own prefix."""
    if world_size == 1:
        return None
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=timeout)
    torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("train_ddp/intra", store),
                                         rank=rank, world_size=world_size, timeout=timeout)
    return True


def average_in_group(model: nn.Module, _intra: bool) -> None:
    """Mean of the (already cross-replica averaged) gradients over the group's ranks.

    Every group has the same number of ranks, so this is the mean over all ranks of all
    live groups. A failure here means a rank of this group died: the group exits and
    restarts as a whole (torchrun's job), so it is raised."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= torch.distributed.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fault-tolerant DDP training on synthetic data (one replica group)")
    ap.add_argument("--steps", type=int, default=1000, help="stop after this many committed steps (1000)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (32)")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (0.05)")
    ap.add_argument("--sleep", type=float, default=0.0, help="simulated compute seconds per step (0)")
    ap.add_argument("--progress", default=None, help="append one JSON line per step to this file")
    ap.add_argument("--stop-file", default=None, help="stop once the step reaches the number in this file")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="give up after this long (0: never); rc 3")
    ap.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a step may commit with (1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective / transfer timeout, seconds (10)")
    ap.add_argument("--connect-timeout", type=float, default=60.0,
                    help="seconds to reach the lighthouse and the group's store (60; ranks may start far apart)")
    ap.add_argument("--hostname", default=None, help="address peers reach this rank at (default: 127.0.0.1 "
                    "when MASTER_ADDR is loopback, else this host's name)")
    ap.add_argument("--samples", type=int, default=8192, help="size of the synthetic dataset (8192)")
    ap.add_argument("--wait-file", default=None, help="stand by (torch imported, model built) until this file "
                    "exists, then join: a pre-warmed replacement for a replica that may die")
    ap.add_argument("--log-level", default="WARNING")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    loopback = os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost", "::1")
    hostname = args.hostname or ("127.0.0.1" if loopback else socket.gethostname())

    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [group {group} rank {rank}] %(name)s: %(message)s")
    heal_timer = HealTimer()
    for handler in logging.getLogger().handlers:  # the console keeps --log-level ...
        handler.setLevel(args.log_level.upper())
    manager_log = logging.getLogger("rallypoint.manager")
    manager_log.addHandler(heal_timer)
    manager_log.setLevel(min(manager_log.getEffectiveLevel(), logging.INFO))  # ... the timer needs INFO

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=args.timeout)
    pg = rallypoint.ProcessGroupNCCL(timeout=timeout) if use_cuda else rallypoint.ProcessGroupGloo(timeout=timeout)

    # The same synthetic regression data on every rank (seeded); each rank reads its shard.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 32, generator=gen)
    w_true = torch.randn(32, 4, generator=gen)
    dataset = TensorDataset(x, torch.tanh(x @ w_true) + 0.05 * torch.randn(args.samples, 4, generator=gen))
    sampler = rallypoint.DistributedSampler(dataset, replica_rank=group, num_replica_groups=num_groups,
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

    progress = Progress(args.progress, group=group, rank=rank, pid=os.getpid())
    if args.wait_file:
        progress.write(event="standby", step=0)
        t_wait = time.monotonic()
        while not os.path.exists(args.wait_file):
            if args.max_seconds and time.monotonic() - t_wait > args.max_seconds:
                return 3
            time.sleep(0.02)
    manager = rallypoint.Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=args.min_replicas,
        hostname=hostname, timeout=timeout, quorum_timeout=3 * timeout,
        connect_timeout=timedelta(seconds=args.connect_timeout),
        checkpoint_transport=rallypoint.HTTPTransport(timeout=timeout, bind=f"{hostname}:0", advertise_host=hostname)
        if hostname in ("127.0.0.1", "localhost") else None,
    )
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    intra = intra_group(rank, world_size, timedelta(seconds=args.connect_timeout), "nccl" if use_cuda else "gloo")
    ddp = rallypoint.DistributedDataParallel(manager, model)
    optimizer = rallypoint.Optimizer(manager, inner)
    progress.write(event="ready", step=manager.current_step(), replica_id=manager.replica_id)
    if rank == 0:
        print(f"group {group}: manager ready as {manager.replica_id} ({'nccl' if use_cuda else 'gloo'}, "
              f"{world_size} rank(s))", flush=True)

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
            step_started[0] = time.time()
            n_heals = len(heals)
            optimizer.zero_grad()  # starts this step's quorum
            if args.sleep:
                time.sleep(args.sleep)  # simulated compute; the quorum forms meanwhile
            loss = nn.functional.mse_loss(ddp(xb.to(device)), yb.to(device))
            loss.backward()
            if intra is not None:  # ranks of a group read different shards: average inside the group too
                average_in_group(model, intra)
            committed = optimizer.step()  # steps only if every replica's allreduce succeeded
            rec: dict[str, Any] = {
                "event": "step", "step": manager.current_step(), "committed": committed,
                "participants": manager.num_participants(), "batches_committed": manager.batches_committed(),
                "loss": round(float(loss.detach()), 5), "sha256": params_sha256(model), "heals": len(heals),
            }
            if len(heals) > n_heals:
                rec["heal"] = heals[-1]
            progress.write(**rec)
    except KeyboardInterrupt:
        rc = 130
    finally:
        progress.write(event="exit", step=manager.current_step(), sha256=params_sha256(model), rc=rc,
                       batches_committed=manager.batches_committed(), heals=len(heals))
        progress.close()
        ddp.shutdown()
        manager.shutdown(wait=False)
        pg.shutdown()
        if intra is not None:
            torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"group {group}: stopped at step {manager.current_step()}, loss {float(loss.detach()):.4f}, "
              f"{len(heals)} heal(s)", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
