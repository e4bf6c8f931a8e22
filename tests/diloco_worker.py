"""Helpers for the LocalSGD / DiLoCo tests: in-process replica threads with real
Managers, and a multi-process DiLoCo replica (``python diloco_worker.py ...``).

The worker trains a two-fragment model with DiLoCo (sync quorum, delay 1, Nesterov
outer SGD) on its own synthetic data. After every committed sync it writes its
progress JSON: manager step, a hash of the global parameters (the fragments'
backups), a hash of the outer optimizer state, a hash of the model parameters. It
stops when its step reaches the target in the stop file (or its wall-clock limit).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from replica_worker import Replicas  # noqa: E402

LIMIT_S = 60.0


def make_manager(lighthouse: str, name: str, min_replicas: int, timeout_s: float = 10.0, **kw: Any) -> tuple[Any, Any]:
    """A Manager (one-rank group) on 127.0.0.1 and its gloo process group."""
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    t = timedelta(seconds=timeout_s)
    pg = ProcessGroupGloo(timeout=t)
    kw.setdefault("use_async_quorum", False)
    m = Manager(pg, None, None, min_replica_size=min_replicas, rank=0, world_size=1, store_addr="127.0.0.1",
                lighthouse_addr=lighthouse, replica_id=name, hostname="127.0.0.1", timeout=t,
                quorum_timeout=timedelta(seconds=2 * timeout_s), connect_timeout=t, **kw)
    return m, pg


_together: threading.Barrier | None = None  # the replica threads of the current run_threads


def leave_together(timeout: float = 30.0) -> None:
    """Called by a replica thread before it shuts its manager down: wait (bounded) until
    every replica of the run got here. A replica that leaves while a peer is still in
    its last sync makes that sync fail (the lighthouse reports the leaver gone and the
    peer aborts), which a golden trajectory must not see."""
    b = _together
    if b is None:
        return
    try:
        b.wait(timeout)
    except threading.BrokenBarrierError:
        pass  # a peer failed or timed out: its error is what the test reports


def run_threads(bodies: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run each body in its own thread; their results (an exception is re-raised).
    Bodies call :func:`leave_together` before shutting their managers down."""
    global _together
    _together = threading.Barrier(len(bodies))
    results: list[Any] = [None] * len(bodies)
    errors: list[BaseException | None] = [None] * len(bodies)

    def main(i: int) -> None:
        try:
            results[i] = bodies[i]()
        except BaseException as e:  # noqa: BLE001
            errors[i] = e
            if _together is not None:
                _together.abort()  # nobody waits for a replica that failed

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"replica threads still running after {timeout}s (errors so far: {errors})")
    for e in errors:
        if e is not None:
            raise e
    return results


def tensor_hash(tensors: list[Any]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(repr(t.detach().double().flatten().tolist()).encode())
    return h.hexdigest()


def optim_hash(sd: dict[str, Any]) -> str:
    """Hash of an optimizer state dict's tensors (in key order) and its plain values."""
    import torch

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(repr(x.detach().double().flatten().tolist()).encode())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(sd)
    return h.hexdigest()


class DiLoCoReplicas(Replicas):
    script = HERE


def worker(lighthouse: str, name: str, seed: int, out: str, stop: str, opts: dict[str, Any]) -> int:
    import logging

    import torch
    from torch import nn

    from rallypoint.integrations.local_sgd import DiLoCo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    frags = [model[0], model[2]]
    # Inner momentum: its buffers change at every inner step, including the step a sender
    # takes during the sync delay while a healing peer fetches the state it served.
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in frags]
    m, pg = make_manager(lighthouse, name, int(opts.get("min_replicas", 1)), float(opts.get("timeout", 5)))
    m.register_state_dict_fn("inner_optim", inner.load_state_dict, inner.state_dict)
    data = torch.Generator().manual_seed(1000 + seed)
    delay = float(opts.get("delay", 0.02))
    t0 = time.monotonic()
    rc = 0
    state: dict[str, Any] = {"last": -1}
    diloco = DiLoCo(m, frags, inner, outers, sync_every=4, fragment_sync_delay=1,
                    use_bucketization=True, bucket_cap_mb=64 / 2**20)

    def report(*_: Any) -> None:
        if m.current_step() == state["last"]:
            return
        state["last"] = m.current_step()
        glob = [t for f in diloco._fragments for t in f.backup.values()]
        prog = {
            "step": m.current_step(), "batches": m.batches_committed(), "hash": tensor_hash(glob),
            "outer": optim_hash([o.state_dict() for o in outers]), "model": tensor_hash(list(model.parameters())),
            "participants": m.num_participants(), "history": [], "replica_id": m.replica_id,
        }
        Path(out + ".tmp").write_text(json.dumps(prog))
        os.replace(out + ".tmp", out)

    try:
        with diloco:
            report()
            hook = inner.register_step_post_hook(report)
            while True:
                if os.path.exists(stop):
                    target = int(Path(stop).read_text() or "1000000")
                    if m.current_step() >= target and diloco._local_step == 0:
                        break
                if time.monotonic() - t0 > LIMIT_S:
                    rc = 3
                    break
                x = torch.randn(8, 4, generator=data)
                y = torch.randn(8, 2, generator=data)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
                time.sleep(delay)  # paces the replicas so they overlap; not a wait for an event
            hook.remove()
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
    return rc


if __name__ == "__main__":
    lh_addr, name_, seed_s, out_s, stop_s, opts_s = sys.argv[1:7]
    sys.exit(worker(lh_addr, name_, int(seed_s), out_s, stop_s, json.loads(opts_s)))
