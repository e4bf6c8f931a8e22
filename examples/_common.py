"""Plumbing shared by the example training scripts (``train_ddp.py``, ``train_diloco.py``,
``train_hsdp.py``): nothing here is rallypoint-specific training logic.

Each example stays a complete, readable training script: its model, its Manager and
integration helper (DDP, DiLoCo, FSDP), its training loop and its ``should_commit`` /
``optimizer.step`` are written out in the example itself. What lives here is what every
one of them needs the same way: reading the launch environment (torchrun's variables
and rallypoint's replica-group variables), logging, the shared command-line flags, the
JSON progress file tests and demos follow, the parameter hash replicas are compared by,
and a small launcher that plays torchrun's part on one host. (Averaging inside a replica
group needs no code here: ``rallypoint.DistributedDataParallel`` does it, and a script that
needs the group's process group itself calls ``torch.distributed.init_process_group``.)

Why torch is imported inside the functions: ``train_hsdp.py --local-ranks N`` is a
launcher process that only starts N children; it must not pay for importing torch (and
rallypoint, which imports torch) just to spawn them.

The examples import this file as ``_common`` (a script's folder is on ``sys.path``), or
as ``examples._common`` when they are themselves imported as part of the ``examples``
package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LOOPBACK = ("127.0.0.1", "localhost", "::1")


_HOSTED_STORES: list[Any] = []  # stores this process hosts, kept alive as long as it runs


def host_store() -> int:
    """Host a replica group's TCPStore in this process, as torchrun's agent does, on a
    port the OS picks (so no other process can take it between choosing and binding),
    and return the port. Every rank, this one included, connects to it through
    ``MASTER_ADDR``/``MASTER_PORT``; it lives as long as this process."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _HOSTED_STORES.append(store)
    return int(store.port)


# --- the launch environment -------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaEnv:
    """Where this process stands: rank ``rank`` of ``world_size`` in replica group
    ``group`` of ``num_groups``, reachable by its peers at ``hostname``."""

    rank: int
    world_size: int
    group: int
    num_groups: int
    hostname: str


def replica_env(hostname: str | None = None) -> ReplicaEnv:
    """Read (and complete) the environment a rank is launched with.

    torchrun sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (and hosts the
    group's store there); without it this process is rank 0 of a group of one and hosts
    the store itself (:func:`host_store`). The defaults are written back to
    ``os.environ`` because the Manager reads them from there (every rank connects to
    the store at ``MASTER_ADDR:MASTER_PORT``), as it reads ``REPLICA_GROUP_ID`` and
    ``RALLYPOINT_LIGHTHOUSE``. Like torchrun's agent, a store hosted here comes with
    ``TORCHELASTIC_USE_AGENT_STORE=True``, so ``torch.distributed.init_process_group``
    (env://) joins it instead of hosting one on the same port. ``hostname`` (the ``--hostname`` flag) is the address peers
    reach this rank at; by default 127.0.0.1 when the group is on loopback, so a job on
    one machine never depends on the host's name resolving."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "MASTER_PORT" not in os.environ:
        if world_size != 1:
            raise SystemExit("MASTER_ADDR/MASTER_PORT must be set when WORLD_SIZE > 1 (torchrun sets them)")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(host_store())
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # init_process_group joins it, as under torchrun
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    os.environ.setdefault("REPLICA_GROUP_ID", str(group))
    loopback = os.environ["MASTER_ADDR"] in LOOPBACK
    hostname = hostname or ("127.0.0.1" if loopback else socket.gethostname())
    return ReplicaEnv(rank, world_size, group, num_groups, hostname)


def setup_logging(level: str, env: ReplicaEnv) -> None:
    """Log lines tagged with the replica group and rank (several ranks share a terminal)."""
    logging.basicConfig(level=level.upper(),
                        format=f"%(asctime)s %(levelname)s [group {env.group} rank {env.rank}] %(name)s: %(message)s")


def pick_device(rank: int) -> torch.device:
    """This rank's GPU (by ``LOCAL_RANK``, as torchrun sets it) when CUDA is available, else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def checkpoint_transport(hostname: str, timeout: timedelta) -> Any:
    """The heal transport for the Manager: on loopback, an HTTP transport bound to and
    advertising ``hostname`` (the default one advertises the host's name, which a
    sandboxed or offline machine may not resolve); elsewhere None, the Manager's default."""
    import rallypoint

    if hostname not in ("127.0.0.1", "localhost"):
        return None
    return rallypoint.HTTPTransport(timeout=timeout, bind=f"{hostname}:0", advertise_host=hostname)


# --- command line ---------------------------------------------------------------------


def add_common_args(ap: argparse.ArgumentParser, *, unit: str = "step", samples: int = 8192) -> None:
    """Add the flags every example takes (after the example's own, so ``--help`` lists those first).

    ``unit`` is what one progress line and one commit stand for ("step", or "sync" for
    DiLoCo); ``samples`` is the default size of the synthetic dataset."""
    ap.add_argument("--progress", default=None, help=f"append one JSON line per {unit} to this file; {{rank}}, "
                    "{group} and {restart} in its name are this rank's RANK, REPLICA_GROUP_ID and "
                    "TORCHELASTIC_RESTART_COUNT (one file per rank and restart under rallypoint run)")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="give up after this long (0: never); rc 3")
    ap.add_argument("--min-replicas", type=int, default=1, help=f"fewest replica groups a {unit} may commit with (1)")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective / transfer timeout, seconds (10)")
    ap.add_argument("--connect-timeout", type=float, default=60.0,
                    help="seconds to reach the lighthouse and the group's store (60; ranks may start far apart)")
    ap.add_argument("--hostname", default=None, help="address peers reach this rank at (default: 127.0.0.1 "
                    "when MASTER_ADDR is loopback, else this host's name)")
    ap.add_argument("--samples", type=int, default=samples, help=f"size of the synthetic dataset ({samples})")
    ap.add_argument("--log-level", default="WARNING")


# --- data, hashing, the group's own ranks ---------------------------------------------


def synthetic_regression(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same seeded regression data on every rank of every group: ``samples`` inputs of
    32 features and their 4 noisy targets. Each rank then reads only its own shard."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=gen)
    w_true = torch.randn(32, 4, generator=gen)
    return x, torch.tanh(x @ w_true) + 0.05 * torch.randn(samples, 4, generator=gen)


def forever(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches, pass after pass (a run is bounded by steps, not epochs)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the data loader yielded no batch (dataset smaller than a batch?)")


def tensors_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order: replicas holding identical values have
    identical hashes, which is how tests and demos check that replicas agree."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


# --- progress, stopping ---------------------------------------------------------------


PLACEHOLDERS = {"{rank}": ("RANK", "0"), "{group}": ("REPLICA_GROUP_ID", "0"),
                "{restart}": ("TORCHELASTIC_RESTART_COUNT", "0")}


def expand_placeholders(path: str, environ: Any = None) -> str:
    """``path`` with ``{rank}`` (``RANK``), ``{group}`` (``REPLICA_GROUP_ID``) and
    ``{restart}`` (``TORCHELASTIC_RESTART_COUNT``: the incarnation under ``rallypoint run``
    or torchrun) replaced from the environment, each ``0`` when unset: every rank of a
    launcher gets the same command line, so this is how each rank and each restart gets a
    file of its own. Other text, braces included, is kept as it is."""
    env = os.environ if environ is None else environ
    for key, (var, default) in PLACEHOLDERS.items():
        path = path.replace(key, env.get(var) or default)
    return path


class Progress:
    """One JSON line per event, appended and flushed (a test or demo tails the file).
    Without a path it writes nothing; ``{rank}``, ``{group}`` and ``{restart}`` in the path
    are filled in from the environment (:func:`expand_placeholders`)."""

    def __init__(self, path: str | None, **fixed: Any) -> None:
        self._f = open(expand_placeholders(path), "a", buffering=1) if path else None
        self._fixed = fixed

    def write(self, **rec: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"t": time.time(), **self._fixed, **rec}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class Deadline:
    """``--max-seconds`` from now (0: never expires)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._t0 = time.monotonic()

    def expired(self) -> bool:
        return bool(self.seconds) and time.monotonic() - self._t0 > self.seconds


def stop_requested(stop_file: str | None, step: int) -> bool:
    """Whether ``stop_file`` holds a step number that ``step`` has reached: a test or demo
    stops every replica at the same step by writing it."""
    if not stop_file or not os.path.exists(stop_file):
        return False
    with open(stop_file) as f:
        text = f.read().strip()
    return bool(text) and step >= int(text)


# --- torchrun's part, on one host -----------------------------------------------------


def launch_local(script: str, n: int, argv: list[str], max_seconds: float) -> int:
    """torchrun's job for one replica group on this host: start ``n`` ranks of ``script``
    (each with torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT``) and wait for them. If one fails the others are stopped: a group
    restarts as a whole, as under torchrun. The group's store is hosted here, as torchrun's
    agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``: ``init_process_group`` joins it)."""
    port = str(host_store())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script), *argv], env=env))
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
