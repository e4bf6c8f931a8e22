"""Fault-tolerant DiLoCo / Streaming DiLoCo with rallypoint, on synthetic data.

Each replica group trains on its own data shard with a local (inner) optimizer and only
exchanges pseudo-gradients (global - local parameters) every ``--sync-every`` inner
steps, fragment by fragment (Streaming DiLoCo) when ``--fragments > 1``; the exchange can
overlap ``--fragment-sync-delay`` inner steps and be int8-quantized (``--quantize``). A
group that dies and comes back heals from a live peer (global parameters and outer
optimizer state) at the next sync::

    rallypoint lighthouse --min-replicas 2 &
    export RALLYPOINT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    rallypoint run --nproc-per-node 1 --replica-group-id 0 examples/train_diloco.py --fragments 2 &
    rallypoint run --nproc-per-node 1 --replica-group-id 1 examples/train_diloco.py --fragments 2 &

Environment as in ``train_ddp.py``. The ranks of one group train one model with torch's
own DDP over the group's process group; group rank g exchanges pseudo-gradients with group
rank g of the other groups. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn

import rallypoint
from rallypoint.integrations.local_sgd import DiLoCo

Hook = Callable[..., bool]


def build_model(fragments: int) -> tuple[nn.Sequential, list[nn.Module]]:
    """An MLP of ``max(4, fragments)`` Linear layers cut into ``fragments`` fragments of
    whole layers (Streaming DiLoCo syncs one fragment at a time)."""
    layers = max(4, fragments)
    dims = [32] + [64] * (layers - 1) + [4]
    linears = [nn.Linear(dims[i], dims[i + 1]) for i in range(layers)]
    model = nn.Sequential(*[m for lin in linears for m in (lin, nn.ReLU())][:-1])
    per = [layers // fragments + (1 if i < layers % fragments else 0) for i in range(fragments)]
    starts = [sum(per[:i]) for i in range(fragments)]
    return model, [nn.ModuleList(linears[s:s + n]) for s, n in zip(starts, per)]


def main(hook: Hook | None = None) -> None:
    """Run ``--steps`` inner steps. ``hook``: for the demo and the tests only
    (``examples/demo/instrumented.py``), as in ``train_ddp.py``."""
    ap = argparse.ArgumentParser(description="fault-tolerant (Streaming) DiLoCo on synthetic data")
    ap.add_argument("--steps", type=int, default=400, help="inner steps to run (400)")
    ap.add_argument("--sync-every", type=int, default=20, help="inner steps for every fragment to sync once (20)")
    ap.add_argument("--fragments", type=int, default=1, help="model fragments; >1 is Streaming DiLoCo (1)")
    ap.add_argument("--fragment-sync-delay", type=int, default=0, help="inner steps a fragment's exchange overlaps")
    ap.add_argument("--alpha", type=float, default=0.0, help="weight of the local value when mixing after a sync")
    ap.add_argument("--quantize", action="store_true", help="int8 quantized pseudo-gradient exchange")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per inner step (32)")
    ap.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW inner learning rate (1e-3)")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="Nesterov SGD outer learning rate (0.7)")
    ap.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a sync commits with (1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective and heal timeout, seconds (10)")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args()
    if args.sync_every % args.fragments:
        ap.error("--sync-every must be a multiple of --fragments")

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

    # The same seeded data everywhere; each group and rank samples its own disjoint slice.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=gen)
    y = torch.tanh(x @ torch.randn(32, 4, generator=gen)) + 0.05 * torch.randn(8192, 4, generator=gen)
    shard = torch.arange(len(x))[group * world_size + rank::num_groups * world_size]
    data_gen = torch.Generator().manual_seed(1000 + group * world_size + rank)

    torch.manual_seed(group)  # each group starts apart: the first sync hands out the primary's parameters
    model, fragments = build_model(args.fragments)
    model.to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    outers = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True) for f in fragments]
    # use_async_quorum=False: a heal must land before a pseudo-gradient is computed.
    manager = rallypoint.Manager(pg=pg, load_state_dict=lambda sd: inner.load_state_dict(sd["inner_optim"]),
                                 state_dict=lambda: {"inner_optim": inner.state_dict()},
                                 min_replica_size=args.min_replicas, use_async_quorum=False,
                                 timeout=timeout, quorum_timeout=3 * timeout)
    forward: nn.Module = model
    if world_size > 1:  # torch's DDP averages the inner gradients over the group's ranks
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        forward = nn.parallel.DistributedDataParallel(model)
    diloco = DiLoCo(manager, fragments, inner, outers if len(outers) > 1 else outers[0], sync_every=args.sync_every,
                    should_quantize=args.quantize, fragment_sync_delay=args.fragment_sync_delay,
                    fragment_update_alpha=args.alpha)
    state = {"manager": manager, "model": model, "optimizer": inner}

    loss, inner_step = torch.zeros(()), 0
    try:
        with diloco:
            stop = bool(hook and hook("ready", **state))
            while not stop and inner_step < args.steps:
                idx = shard[torch.randint(len(shard), (args.batch_size,), generator=data_gen)]
                inner.zero_grad()
                loss = nn.functional.mse_loss(forward(x[idx].to(device)), y[idx].to(device))
                loss.backward()
                inner.step()  # DiLoCo's hook syncs a fragment when its turn comes
                inner_step += 1
                stop = bool(hook and hook("step", loss=loss, **state))
    finally:
        if hook:
            hook("exit", **state)
        manager.shutdown(wait=False)
        pg.shutdown()
        if world_size > 1:
            torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"group {group}: {inner_step} inner steps, manager step {manager.current_step()}, "
              f"loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
