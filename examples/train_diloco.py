"""Fault-tolerant DiLoCo / Streaming DiLoCo training on synthetic data: one replica group per launch.

Each replica group trains on its own data shard with a local (inner) optimizer and only
exchanges pseudo-gradients (global - local parameters) every ``--sync-every`` inner
steps, fragment by fragment (Streaming DiLoCo) when ``--fragments > 1``; the exchange
can overlap ``--fragment-sync-delay`` inner steps and be int8-quantized (``--quantize``).
A group that dies and comes back heals from a live peer (global parameters and outer
optimizer state) at the next sync::

    rallypoint lighthouse --min-replicas 2 &
    export RALLYPOINT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node 1 --master-port 29600 examples/train_diloco.py --fragments 2 &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node 1 --master-port 29601 examples/train_diloco.py --fragments 2 &

Without torchrun, ``python examples/train_diloco.py`` runs rank 0 of a one-rank group on
a free port. Environment as ``examples/train_ddp.py``: ``REPLICA_GROUP_ID`` (this
group's index and data shard), ``NUM_REPLICA_GROUPS``, ``RALLYPOINT_LIGHTHOUSE`` (or
``TORCHFT_LIGHTHOUSE``), torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``.
Ranks of one group train one model with torch's own DDP over the group's process group
(``torch.distributed.init_process_group``, in the store ``rallypoint run`` or torchrun
hosts), so their inner gradients are averaged every step; group rank ``g`` exchanges
pseudo-gradients with group rank ``g`` of the other groups.
gloo on CPU; NCCL when CUDA is available.

Only the public API is used: ``rallypoint.Manager`` (``use_async_quorum=False``: a heal
must land before a pseudo-gradient is computed) and
``rallypoint.integrations.local_sgd.DiLoCo`` (same constructor as torchft 0.2.0's).

``--progress FILE`` appends one JSON line per committed sync (manager step, inner step,
sha256 of the *global* parameters -- the state a healing replica would receive -- and of
the model's current local parameters) and an ``exit`` line, so a test can check that
every replica group agrees on the global parameters.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

import rallypoint
from rallypoint.integrations.local_sgd import DiLoCo

if __package__:  # imported as examples.train_diloco
    from . import _common
else:  # run as a script (python or torchrun): this file's folder is on sys.path
    import _common

log = logging.getLogger("train_diloco")

FRAGMENT_KEY = "StreamingDiLoCoFragment_"  # the state_dict keys DiLoCo registers (torchft's names)


class Manager(rallypoint.Manager):
    """The Manager, remembering the state functions registered with it.

    DiLoCo registers each fragment's global parameters and outer optimizer state
    (``StreamingDiLoCoFragment_<i>``): exactly what a healing replica receives. Keeping
    the save functions lets this script report those global parameters, the value all
    replica groups must agree on, without reaching into DiLoCo's internals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.registered: dict[str, Callable[[], Any]] = {}
        super().__init__(*args, **kwargs)

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None],
                               state_dict: Callable[[], Any]) -> None:
        self.registered[key] = state_dict
        super().register_state_dict_fn(key, load_state_dict, state_dict)

    def global_parameters(self) -> list[torch.Tensor]:
        """Every fragment's global parameters, fragment by fragment, in name order."""
        out: list[torch.Tensor] = []
        for key in sorted((k for k in self.registered if k.startswith(FRAGMENT_KEY)),
                          key=lambda k: int(k[len(FRAGMENT_KEY):])):
            params = self.registered[key]()["original_parameters"]
            out += [params[name] for name in sorted(params)]
        return out


def build_model(fragments: int) -> tuple[nn.Sequential, list[nn.Module]]:
    """An MLP of ``max(4, fragments)`` Linear layers, cut into ``fragments`` contiguous
    fragments of whole layers (Streaming DiLoCo syncs one fragment at a time)."""
    layers = max(4, fragments)
    dims = [32] + [64] * (layers - 1) + [4]
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    per = [layers // fragments + (1 if i < layers % fragments else 0) for i in range(fragments)]
    frags: list[nn.Module] = []
    start = 0
    for n in per:
        frags.append(nn.ModuleList(linears[start:start + n]))
        start += n
    return model, frags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fault-tolerant (Streaming) DiLoCo on synthetic data (one replica group)")
    ap.add_argument("--steps", type=int, default=400, help="inner steps to run (400)")
    ap.add_argument("--sync-every", type=int, default=20, help="inner steps for every fragment to sync once (20)")
    ap.add_argument("--fragments", type=int, default=1, help="model fragments; >1 is Streaming DiLoCo (1)")
    ap.add_argument("--fragment-sync-delay", type=int, default=0,
                    help="inner steps a fragment's exchange overlaps (0; < sync-every / fragments)")
    ap.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha: weight of the local value "
                    "when mixing after a sync (0)")
    ap.add_argument("--quantize", action="store_true", help="int8 row-wise quantized pseudo-gradient exchange")
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucketize the exchange into flat buffers of "
                    "this many MiB (default: one allreduce per parameter)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per inner step (32)")
    ap.add_argument("--inner-lr", type=float, default=1e-3, help="AdamW inner learning rate (1e-3)")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="Nesterov SGD outer learning rate (0.7)")
    ap.add_argument("--sleep", type=float, default=0.0, help="simulated compute seconds per inner step (0)")
    _common.add_common_args(ap, unit="sync")  # --progress, --max-seconds, --min-replicas, --timeout, ...
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fragments < 1 or args.sync_every % args.fragments:
        raise SystemExit(f"--sync-every ({args.sync_every}) must be a multiple of --fragments ({args.fragments})")
    env = _common.replica_env(args.hostname)  # torchrun's RANK/WORLD_SIZE/..., REPLICA_GROUP_ID, ...
    rank, world_size, group = env.rank, env.world_size, env.group
    _common.setup_logging(args.log_level, env)
    torch.set_num_threads(1)

    device = _common.pick_device(rank)
    use_cuda = device.type == "cuda"
    timeout = timedelta(seconds=args.timeout)
    pg = rallypoint.ProcessGroupNCCL(timeout=timeout) if use_cuda else rallypoint.ProcessGroupGloo(timeout=timeout)

    # The same synthetic regression data everywhere (seeded); each group and rank reads
    # its own disjoint slice, so replica groups really train on different data.
    x, y = _common.synthetic_regression(args.samples)
    global_rank, global_size = group * world_size + rank, env.num_groups * world_size
    shard = torch.arange(args.samples)[global_rank::global_size]
    data_gen = torch.Generator().manual_seed(1000 + global_rank)

    # Each group starts from its own initialisation: DiLoCo's first round gives every
    # replica the primary's global parameters (init_sync).
    torch.manual_seed(group)
    model, fragments = build_model(args.fragments)
    model.to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.0)
    outers: list[torch.optim.Optimizer] = [
        torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True) for f in fragments
    ]

    manager = Manager(
        pg=pg, load_state_dict=lambda sd: inner.load_state_dict(sd["inner_optim"]),
        state_dict=lambda: {"inner_optim": inner.state_dict()},
        min_replica_size=args.min_replicas, use_async_quorum=False,
        hostname=env.hostname, timeout=timeout, quorum_timeout=3 * timeout,
        connect_timeout=timedelta(seconds=args.connect_timeout),
        checkpoint_transport=_common.checkpoint_transport(env.hostname, timeout),
    )
    # The ranks of a group train one model: torch's own DDP over the group's process group
    # (rallypoint run / torchrun host its store) averages their inner gradients every step;
    # DiLoCo exchanges pseudo-gradients across groups, group rank g with group rank g.
    intra = world_size > 1
    forward: nn.Module = model
    if intra:
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo",
                                             timeout=timedelta(seconds=args.connect_timeout))
        forward = nn.parallel.DistributedDataParallel(model)
    progress = _common.Progress(args.progress, group=group, rank=rank, pid=os.getpid())
    diloco = DiLoCo(manager, fragments, inner, outers if len(outers) > 1 else outers[0], sync_every=args.sync_every,
                    should_quantize=args.quantize, fragment_sync_delay=args.fragment_sync_delay,
                    fragment_update_alpha=args.alpha, use_bucketization=args.bucket_mb is not None,
                    bucket_cap_mb=args.bucket_mb)
    if rank == 0:
        print(f"group {group}: manager ready as {manager.replica_id} ({'nccl' if use_cuda else 'gloo'}, "
              f"{world_size} rank(s), {args.fragments} fragment(s), sync every {args.sync_every})", flush=True)

    deadline = _common.Deadline(args.max_seconds)
    rc, inner_step, syncs = 0, 0, 0
    loss = torch.zeros(())
    last_step = [-1]

    def record(**extra: Any) -> None:
        progress.write(step=manager.current_step(), inner_step=inner_step,
                       global_sha256=_common.tensors_sha256(manager.global_parameters()),
                       local_sha256=_common.tensors_sha256(model.parameters()),
                       participants=manager.num_participants(), loss=round(float(loss.detach()), 5), **extra)

    try:
        with diloco:
            last_step[0] = manager.current_step()
            record(event="start")
            while inner_step < args.steps:
                if deadline.expired():
                    log.warning("giving up after %.0f s at inner step %d", args.max_seconds, inner_step)
                    rc = 3
                    break
                idx = shard[torch.randint(len(shard), (args.batch_size,), generator=data_gen)]
                inner.zero_grad()
                if args.sleep:
                    time.sleep(args.sleep)  # simulated compute
                loss = nn.functional.mse_loss(forward(x[idx].to(device)), y[idx].to(device))
                loss.backward()  # with several ranks: averaged over the group's ranks by torch's DDP
                inner.step()  # DiLoCo's hook syncs a fragment when its turn comes
                inner_step += 1
                if manager.current_step() != last_step[0]:  # a sync committed
                    last_step[0] = manager.current_step()
                    syncs += 1
                    record(event="sync")
    except KeyboardInterrupt:
        rc = 130
    finally:
        record(event="exit", rc=rc, syncs=syncs)
        progress.close()
        manager.shutdown(wait=False)
        pg.shutdown()
        if intra:
            torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"group {group}: {inner_step} inner steps, {syncs} committed syncs, manager step "
              f"{manager.current_step()}, loss {float(loss.detach()):.4f}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
