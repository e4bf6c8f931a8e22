"""One rank of one replica group for the FSDP2 tests (tests/test_fsdp.py), and the
test-side helper that starts, watches and kills the ranks.

A replica group is ``world`` processes (as torchrun would start them): each builds its
own ``Manager`` (group rank 0 hosts the group's store on ``port``), joins the group's
gloo default process group through that store, shards a small MLP with
``fully_shard_replicated`` and trains it with Adam. Data is a pure function of the step:
a global batch of ``groups * world * BATCH`` samples of which (group index, rank) takes
its slice, so a plain single-process run of the same steps is the reference.

After every step the rank writes its progress (step, hash of its local model and
optimizer shards, history, hook calls, heals, save threads) to a JSON file; on exit it
saves its local shards to ``<out>.pt``. It stops once its step reaches the number in the
stop file. Options (JSON): ``index`` (group index: its data slice), ``groups``,
``seed_offset`` (other initial weights),
``min_replica_size``, ``async`` (async quorum, default true), ``timeout``, ``delay``,
``fault``: ``{"at": "mid_backward", "step": N, "file": F}`` SIGKILLs the rank in the
first gradient all-reduce hook of the first step at or after N once file F exists (if
given); every rank of the group gets there in the same step, so the whole group dies
mid-backward. ``wait_file``: import everything, write ``<out>.ready``, then wait for
this file before joining (a pre-warmed replacement).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import zygote

HERE = Path(__file__).resolve()
LIMIT_S = 75.0  # a rank's own wall-clock limit
BATCH = 4  # samples per rank per step
IN, HIDDEN, OUT = 6, 10, 3
LR = 0.02


def make_model(seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def global_batch(step: int, n: int) -> tuple[Any, Any]:
    """The whole step's data (every group and rank): ``n`` samples, a function of ``step``."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(n, IN, generator=g)
    return x, torch.sin(x[:, :OUT]) + 0.1 * torch.randn(n, OUT, generator=g)


def reference(steps: int, groups: int, world: int, first_step_from: int | None = None
              ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Plain single-process training on the same global batches: (params, Adam state).

    Each step's gradient is the mean of the groups' gradients (a group's gradient: the
    mean over its ``world * BATCH`` samples). ``first_step_from``: at step 0 only that
    group contributes and the others count as zeros; that is what the manager does when
    the other groups heal from it at step 0 (``init_sync``: a healing replica contributes
    zeros, and the mean still divides by every group of the quorum, as in torchft)."""
    import torch

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    per = world * BATCH
    for s in range(steps):
        x, y = global_batch(s, groups * per)
        total = [torch.zeros_like(p) for p in model.parameters()]
        for gi in range(groups):
            if s == 0 and first_step_from is not None and gi != first_step_from:
                continue
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[gi * per:(gi + 1) * per]), y[gi * per:(gi + 1) * per]).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad / groups
        for t, p in zip(total, model.parameters()):
            p.grad = t
        opt.step()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()})


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def local_shards(model: Any, opt: Any) -> dict[str, Any]:
    """This rank's local shards: model parameters and the optimizer's per-parameter state."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim.{i}.{k}"] = local(v)
    return out


def shard_hash(shards: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(shards):
        h.update(k.encode())
        h.update(bytes(shards[k].contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def run_rank(lighthouse: str, name: str, rank: int, world: int, port: int, out: str, stop: str,
             opts: dict[str, Any]) -> int:
    import logging
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rallypoint.integrations.fsdp import fully_shard_replicated
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{name}/{rank}] %(name)s %(message)s")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    timeout = timedelta(seconds=float(opts.get("timeout", 10)))
    fault = opts.get("fault") or {}
    index, groups = int(opts.get("index", 0)), int(opts.get("groups", 2))
    if opts.get("wait_file"):
        # Stand by with everything imported, so a replacement joins as soon as it is let go.
        Path(out + ".ready").write_text("1")
        deadline = time.monotonic() + LIMIT_S
        while not os.path.exists(opts["wait_file"]):
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.02)
    pg = ProcessGroupGloo(timeout=timeout)
    m = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=int(opts.get("min_replica_size", 1)),
        rank=rank, world_size=world, store_addr="127.0.0.1", store_port=port, lighthouse_addr=lighthouse,
        replica_id=name, hostname="127.0.0.1", timeout=timeout, quorum_timeout=2 * timeout,
        connect_timeout=timedelta(seconds=20), use_async_quorum=bool(opts.get("async", True)),
    )
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp_test/intra", store), rank=rank,
                            world_size=world, timeout=timeout)
    model = make_model(int(opts.get("seed_offset", 0)))
    fsdp = fully_shard_replicated(
        model, m, lambda ps: torch.optim.Adam(ps, lr=LR), shard_submodules=(torch.nn.Linear,),
    )
    opt = fsdp.optimizer
    assert opt is not None and fsdp.state is not None
    hook_calls_per_step: list[int] = []
    inner_hook = fsdp.averager

    def hook(t: torch.Tensor) -> None:
        if fault.get("at") == "mid_backward" and m.current_step() >= int(fault.get("step", 0)) \
                and ("file" not in fault or os.path.exists(fault["file"])):
            _die()
        inner_hook(t)

    for sub in model.modules():
        if hasattr(sub, "set_all_reduce_hook"):
            sub.set_all_reduce_hook(hook)

    history: list[list[int]] = []
    t0 = time.monotonic()
    rc = 0
    delay = float(opts.get("delay", 0.02))
    try:
        while True:
            if os.path.exists(stop):
                target = int(Path(stop).read_text() or "1000000")
                if m.current_step() >= target:
                    break
            if time.monotonic() - t0 > LIMIT_S:
                rc = 3
                break
            opt.zero_grad()
            m.start_quorum()
            step = m.current_step()
            x, y = global_batch(step, groups * world * BATCH)
            lo = (index * world + rank) * BATCH
            calls0 = inner_hook.calls
            loss = torch.nn.functional.mse_loss(model(x[lo:lo + BATCH]), y[lo:lo + BATCH])
            loss.backward()
            hook_calls_per_step.append(inner_hook.calls - calls0)
            participants = m.num_participants()
            committed = m.should_commit()
            if committed:
                opt.step()
            history.append([m.current_step(), participants, int(committed)])
            shards = local_shards(model, opt)
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({
                "step": m.current_step(), "batches": m.batches_committed(), "hash": shard_hash(shards),
                "history": history, "hook_calls": hook_calls_per_step[-20:], "heals": fsdp.state.loads,
                "save_threads": sorted(set(fsdp.state.saves)), "main_thread": threading.current_thread().name,
                "replica_id": m.replica_id,
            }))
            os.replace(tmp, out)
            time.sleep(delay)  # paces the groups so they overlap; not a wait for an event
        torch.save(local_shards(model, opt), out + ".pt")
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
        dist.destroy_process_group()
    return rc


class Groups:
    """Starts replica groups (``world`` rank processes each), reads their progress and
    kills every process it started at teardown."""

    def __init__(self, tmp: Path, lighthouse: str, world: int = 2) -> None:
        self.tmp = tmp
        self.lighthouse = lighthouse
        self.world = world
        self.procs: dict[str, list[zygote.Proc]] = {}
        self.all: list[zygote.Proc] = []
        self.stop = tmp / "stop"
        self._launches = 0
        self.stores: list[Any] = []

    def out(self, name: str, rank: int) -> Path:
        return self.tmp / f"{name}-r{rank}.json"

    def start(self, name: str, **opts: Any) -> list[zygote.Proc]:
        import torch.distributed as dist

        # The group's store, hosted here as torchrun's agent would (bound to port 0, so
        # no other process can take the port between choosing and binding it); a new
        # one per launch, so a restarted group never reads its predecessor's keys.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        port = store.port
        self._launches += 1
        ps = []
        for r in range(self.world):
            self.out(name, r).unlink(missing_ok=True)
            Path(str(self.out(name, r)) + ".ready").unlink(missing_ok=True)
            log = open(self.tmp / f"{name}-r{r}.{self._launches}.log", "w")
            p = zygote.popen(
                [sys.executable, str(HERE), self.lighthouse, name, str(r), str(self.world), str(port),
                 str(self.out(name, r)), str(self.stop), json.dumps(opts)],
                stdout=log, stderr=subprocess.STDOUT,
            )
            log.close()
            ps.append(p)
            self.all.append(p)
        self.procs[name] = ps
        return ps

    def ready(self, name: str) -> bool:
        """Every rank of a standby group has imported everything."""
        return all(Path(str(self.out(name, r)) + ".ready").exists() for r in range(self.world))

    def progress(self, name: str, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.out(name, rank).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def step(self, name: str) -> int:
        """The group's step (the lowest of its ranks'; -1 before every rank reported)."""
        steps = [(p or {}).get("step", -1) for p in (self.progress(name, r) for r in range(self.world))]
        return min(steps)

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> float:
        """Poll ``cond`` (progress files have no event to await); seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() < t0 + timeout:
            if cond():
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; logs:\n{self.logs()}")

    def wait_dead(self, name: str, timeout: float) -> list[int]:
        rcs = []
        deadline = time.monotonic() + timeout
        for p in self.procs[name]:
            try:
                rcs.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} pid {p.pid} still running; logs:\n{self.logs()}") from None
        return rcs

    def finish(self, target: int, timeout: float = 40.0) -> None:
        self.stop.write_text(str(target))
        deadline = time.monotonic() + timeout
        for name, ps in self.procs.items():
            for p in ps:
                if p.poll() is None:
                    try:
                        rc = p.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        raise AssertionError(f"{name} pid {p.pid} did not stop; logs:\n{self.logs()}") from None
                    assert rc == 0, f"{name} pid {p.pid} exited {rc}; logs:\n{self.logs()}"

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"==== {f.name}\n{f.read_text()[-tail:]}" for f in sorted(self.tmp.glob("*.log")))

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)


if __name__ == "__main__":
    lh_, name_, rank_, world_, port_, out_, stop_, opts_ = sys.argv[1:9]
    sys.exit(run_rank(lh_, name_, int(rank_), int(world_), int(port_), out_, stop_, json.loads(opts_)))
