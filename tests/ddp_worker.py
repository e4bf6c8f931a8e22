"""A replica group (one rank) training a DDP-wrapped MLP, for ``tests/test_ddp.py``, and
the test-side launcher for it.

The worker wraps an ``nn.Sequential`` MLP in ``rallypoint.integrations.
DistributedDataParallel`` with a tiny bucket cap, so each backward hands the manager
several gradient buckets, and runs the plain loop a user writes: ``start_quorum``,
forward, backward, ``should_commit``, ``optimizer.step``. After every step it writes
its progress (step, committed batches, parameter hash, history rows of
``[step, participants, committed]``) to a JSON file, and it stops once its step
reaches the target in the stop file (or after its own wall-clock limit, rc 3). A
forward or backward that raises is the bug under test: it is written to the progress
file and the worker exits with rc 5.

Options (a JSON object on the command line):

- ``fault``: ``{"step": N, "participants": P}`` — at the first step at or after N whose
  quorum has at least P up-to-date replicas (workers start seconds apart on a small
  machine), SIGKILL itself from inside the DDP communication hook when the second
  gradient bucket arrives: the first bucket's allreduce was posted, and the peers are
  left blocked in the second.
- ``standby``: import everything, then wait (at most ``LIMIT_S``) for a line on stdin
  before joining: the test starts the victim's replacement early, so its restart is
  not delayed by seconds of importing torch on a busy machine.
- ``sdc``/``sdc_every``: the manager's corruption checks (``sdc_check``/``sdc_check_every``).
- ``delay``: seconds between steps (paces replicas so they overlap); ``timeout``: the
  manager's collective timeout in seconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zygote

from replica_worker import Replicas, record_hash, round_row

HERE = Path(__file__).resolve()
LIMIT_S = 60.0  # a worker's own wall-clock limit


class DyingManager:
    """Stands in for the manager inside DDP's hook: delegates everything, and at the
    armed step SIGKILLs the process when the second bucket is handed over (after the
    first one was posted), so the death lands in the middle of the gradient
    allreduce of the peers."""

    def __init__(self, manager: Any, step: int, participants: int) -> None:
        self._m = manager
        self._step = step
        self._participants = participants
        self._calls = 0

    def allreduce(self, tensor: Any, reduce_op: Any = None) -> Any:
        if self._m.current_step() >= self._step and self._m.num_participants() >= self._participants:
            self._calls += 1
            if self._calls == 2:
                sys.stderr.write(f"SIGKILL in the comm hook at step {self._m.current_step()}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return self._m.allreduce(tensor) if reduce_op is None else self._m.allreduce(tensor, reduce_op=reduce_op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


def worker(lighthouse: str, name: str, seed: int, out: str, stop: str, opts: dict[str, Any]) -> int:
    """One replica group of one rank; returns the exit status (see the module docstring)."""
    import logging
    from datetime import timedelta

    import torch
    from torch import nn

    from rallypoint.integrations import DistributedDataParallel
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    if opts.get("standby"):
        import importlib

        for mod in ("rallypoint.manager.manager", "rallypoint.manager.server", "rallypoint.transports.http"):
            importlib.import_module(mod)  # what a Manager imports lazily
        ready, _, _ = select.select([sys.stdin], [], [], LIMIT_S)
        if not ready or not sys.stdin.readline().strip():
            return 3
    timeout = timedelta(seconds=float(opts.get("timeout", 10)))
    pg = ProcessGroupGloo(timeout=timeout)
    m = Manager(
        pg=pg, load_state_dict=load, state_dict=save, min_replica_size=1, rank=0, world_size=1,
        store_addr="127.0.0.1", lighthouse_addr=lighthouse, replica_id=name, hostname="127.0.0.1",
        timeout=timeout, quorum_timeout=2 * timeout, connect_timeout=timedelta(seconds=10),
        sdc_check=bool(opts.get("sdc", False)), sdc_check_every=int(opts.get("sdc_every", 0)),
    )
    fault = opts.get("fault")
    hook_manager: Any = DyingManager(m, int(fault["step"]), int(fault.get("participants", 1))) if fault else m
    # ~1 KiB buckets: the three layers' gradients travel in separate buckets.
    ddp = DistributedDataParallel(hook_manager, model, bucket_cap_mb=0.001)
    gen = torch.Generator().manual_seed(1000 + seed)
    history: list[list[int]] = []
    rounds: list[list[Any]] = []  # round_row() of every round (Replicas.assert_identical)
    rode: list[int] = []
    rides: list[int] = []
    t0 = time.monotonic()
    delay = float(opts.get("delay", 0.05))
    rc = 0
    try:
        while True:
            if os.path.exists(stop) and m.current_step() >= int(Path(stop).read_text() or "1000000"):
                break
            if time.monotonic() - t0 > LIMIT_S:
                rc = 3
                break
            early0 = m._guard.early_exchanges  # posted during backward, behind the last bucket
            riding0 = m._guard.riding_exchanges  # of those, in the last bucket's own collective
            m.start_quorum()
            x = torch.randn(8, 16, generator=gen)
            y = torch.randn(8, 4, generator=gen)
            opt.zero_grad()
            try:
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
            except Exception as e:  # noqa: BLE001 - the failure this test exists to catch
                logging.exception("forward/backward raised at step %d", m.current_step())
                _write(out, m, model, history, raised=repr(e))
                return 5
            participants = m.num_participants()
            committed = m.should_commit()
            if committed:
                opt.step()
            history.append([m.current_step(), participants, int(committed)])
            rounds.append(round_row(m))
            rode.append(m._guard.early_exchanges - early0)  # this round's exchange rode behind the gradients
            rides.append(m._guard.riding_exchanges - riding0)  # ... in the last bucket's collective itself
            _write(out, m, model, history, rounds=rounds, buckets=ddp.buckets_reduced,
                   early_exchanges=m._guard.early_exchanges,
                   late_exchanges=m._guard.late_exchanges, rode=rode, rides=rides)
            time.sleep(delay)  # paces the replicas so they overlap; not a wait for an event
    finally:
        ddp.shutdown()
        m.shutdown(wait=False)
        pg.shutdown()
    return rc


#: per progress file: the parameters' hash at each of the last steps (Replicas.assert_identical)
_HASHES: dict[str, dict[str, str]] = {}


def _write(out: str, m: Any, model: Any, history: list[list[int]], **extra: Any) -> None:
    """Atomically replace the progress file (the test polls it)."""
    hashes = _HASHES.setdefault(out, {})
    h = record_hash(hashes, m.current_step(), model)
    tmp = out + ".tmp"
    Path(tmp).write_text(json.dumps({
        "step": m.current_step(), "batches": m.batches_committed(), "hash": h,
        "history": history, "hashes": hashes, "replica_id": m.replica_id, **extra,
    }))
    os.replace(tmp, out)


class DDPReplicas(Replicas):
    """``replica_worker.Replicas`` (progress files, waits with deadlines, kill by pid)
    running this worker instead."""

    def start(self, name: str, seed: int, **opts: Any) -> zygote.Proc:
        """Start a worker; with ``standby=True`` it waits for :meth:`release` (and must
        not share ``name`` with a running worker's progress until then)."""
        out = self.tmp / f"{name}.json"
        if not opts.get("standby"):
            out.unlink(missing_ok=True)
        log = open(self.tmp / f"{name}.{len(self.procs)}.log", "w")
        p = zygote.popen(
            [sys.executable, str(HERE), self.lighthouse, name, str(seed), str(out), str(self.stop), json.dumps(opts)],
            stdin=subprocess.PIPE if opts.get("standby") else subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs[f"{name}#{p.pid}"] = p
        return p

    def release(self, p: zygote.Proc, name: str) -> None:
        """Let a standby worker join as ``name`` (its predecessor's progress is dropped)."""
        assert p.poll() is None and p.stdin is not None, f"standby {name} is gone; logs:\n{self.logs()}"
        (self.tmp / f"{name}.json").unlink(missing_ok=True)
        p.stdin.write(b"go\n")
        p.stdin.close()

    def kill_all(self) -> None:
        super().kill_all()
        for p in self.procs.values():
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()


if __name__ == "__main__":
    lh_addr, name_, seed_s, out_s, stop_s, opts_s = sys.argv[1:7]
    sys.exit(worker(lh_addr, name_, int(seed_s), out_s, stop_s, json.loads(opts_s)))
