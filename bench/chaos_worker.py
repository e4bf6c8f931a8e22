"""The training worker of ``bench/chaos.py`` and ``bench/chaos_run.py``: one rank of one
replica group training a small MLP with the framework's DDP wrapper, a simulated compute of
``compute_ms`` per step, and one JSON line per step on stdout.

Two ways to run it:

- ``chaos.py --worker PLAN`` (raw, one process per replica group, an outside supervisor):
  the group id is ``plan["gid"]``; a ``"standby"`` process imports first and waits for a
  line on stdin; ``{"stop_at": N}`` on stdin ends training at step N; EOF on stdin exits.
- ``python -m rallypoint run ... bench/chaos_worker.py PLAN`` (``plan["supervised"]``):
  the group id, rank, group size, store and lighthouse come from the environment
  ``rallypoint run`` sets; stdin is /dev/null, so the stop comes through a file
  (``plan["stop_file"]``: ``{"stop_at": N}``, later ``{"exit": true}``).

Records: ``{"s": step, "c": committed, "p": participating, "n": participants, "t0": step
start, "t1": after should_commit, "pid": ...}``; ``{"ready": true, ...}`` once the Manager
exists; one ``{"timing": {...}}`` after the process's first participating commit (wall-clock
marks: ``proc`` process creation, ``go`` the script starts (after a standby's go),
``torch`` imported, ``model`` built, ``mgr`` Manager constructed, ``ddp``; ``quorum`` /
``configure`` / ``heal``: [start, end] of the first calls on the quorum thread; ``steps``:
[t0, t1, committed, participating] of the first steps); ``{"done": step, "hash": sha256}``
at the stop step.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

T_GO = time.time()  # the script starts (a warm standby: just after its go)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402


def out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def proc_start_time(pid: str = "self") -> float | None:
    """Wall-clock creation time of a process (/proc, 10 ms resolution), None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class _Timed:
    """Wraps one method of an object (or a proxy for objects without a ``__dict__``, such
    as torchft's Rust ManagerClient): records [start, end] of its first few calls."""

    def __init__(self, marks: dict[str, list], key: str, fn: Any) -> None:
        self.marks, self.key, self.fn = marks, key, fn

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t = time.time()
        try:
            return self.fn(*a, **kw)
        finally:
            lst = self.marks.setdefault(self.key, [])
            if len(lst) < 3:
                lst.append([t, time.time()])


class _ClientProxy:
    def __init__(self, inner: Any, marks: dict[str, list]) -> None:
        self._inner = inner
        self._quorum = _Timed(marks, "quorum", inner._quorum)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def instrument(manager: Any, marks: dict[str, list]) -> None:
    """Time the quorum, the process group's configure and the heal fetch (private
    attributes of both Managers; best effort, a bench-only probe)."""
    try:
        manager._client = _ClientProxy(manager._client, marks)
    except Exception:  # noqa: BLE001
        pass
    try:
        manager._pg.configure = _Timed(marks, "configure", manager._pg.configure)
    except Exception:  # noqa: BLE001
        pass
    for owner, name in (("_healer", "fetch"), ("_checkpoint_transport", "recv_checkpoint")):
        obj = getattr(manager, owner, None)
        if obj is not None and hasattr(obj, name):
            try:
                setattr(obj, name, _Timed(marks, "heal", getattr(obj, name)))
            except Exception:  # noqa: BLE001
                pass


def worker(plan: dict[str, Any]) -> None:
    import hashlib
    import logging

    _util.exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch
    from torch import nn

    marks: dict[str, Any] = {"proc": proc_start_time(), "go": T_GO, "torch": time.time()}
    torch.set_num_threads(1)
    fw, supervised = plan["framework"], bool(plan.get("supervised"))
    gid = int(os.environ["REPLICA_GROUP_ID"]) if supervised else plan["gid"]
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if supervised else (0, 1)
    if not supervised:
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
    torch.manual_seed(gid)  # different initial weights: init_sync must make them agree
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    marks["model"] = time.time()

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    if plan.get("standby"):
        import importlib

        mods = (("rallypoint.manager.manager", "rallypoint.manager.server", "rallypoint.transports.http",
                 "rallypoint.integrations.ddp", "rallypoint.process_groups") if fw == "ours"
                else ("torchft", "torchft.manager", "torchft.ddp", "torchft.checkpointing"))
        for mod in mods:
            importlib.import_module(mod)  # what a fresh process spends its first seconds on
        out({"standby": True})
        if not sys.stdin.readline().strip():  # "go" (EOF: the parent is done with us)
            os._exit(0)
        marks["go"] = time.time()
    timeout = timedelta(seconds=plan["op_timeout_s"])
    common = dict(
        load_state_dict=load, state_dict=save, min_replica_size=1, use_async_quorum=True,
        replica_id=f"g{gid}", hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
    )
    if not supervised:
        common.update(rank=0, world_size=1, lighthouse_addr=plan["lighthouse"])
    if fw == "ours":
        import rallypoint

        # supervised: the store (MASTER_ADDR/PORT), rank and lighthouse from rallypoint run's environment
        manager: Any = rallypoint.Manager(pg=rallypoint.ProcessGroupGloo(timeout=timeout),
                                          **({} if supervised else {"store_addr": "127.0.0.1"}), **common)
        marks["mgr"] = time.time()
        ddp = rallypoint.DistributedDataParallel(manager, model, bucket_cap_mb=0.1)
    else:
        from torch.distributed import TCPStore
        from torchft import DistributedDataParallel as TFDDP
        from torchft import Manager as TFManager
        from torchft import ProcessGroupGloo as TFGloo

        # torchft's Manager needs its replica group's TCPStore to exist already
        tf_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        manager = TFManager(pg=TFGloo(timeout=timeout), store_addr="127.0.0.1", store_port=tf_store.port, **common)
        marks["mgr"] = time.time()
        ddp = TFDDP(manager, model, bucket_cap_mb=0.1)
    marks["ddp"] = time.time()
    instrument(manager, marks)

    stop_at: list[int | None] = [None]

    def read_stdin() -> None:
        for line in sys.stdin:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "stop_at" in msg:
                stop_at[0] = int(msg["stop_at"])
        os._exit(0)  # EOF: the parent is done with us

    def read_stop_file(path: str) -> None:
        while True:
            time.sleep(0.02)
            try:
                msg = json.loads(Path(path).read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                continue
            if msg.get("exit"):
                os._exit(0)
            if "stop_at" in msg:
                stop_at[0] = int(msg["stop_at"])

    if supervised:
        threading.Thread(target=read_stop_file, args=(plan["stop_file"],), name="stop", daemon=True).start()
    else:
        threading.Thread(target=read_stdin, name="stdin", daemon=True).start()
    pid = os.getpid()
    out({"ready": True, "pid": pid, "gid": gid, "rank": rank, "world": world, "t": time.time(),
         "inc": os.environ.get("TORCHELASTIC_RESTART_COUNT")})
    compute_s = plan["compute_ms"] / 1000.0
    loss_fn = nn.MSELoss()
    steps: list[list[Any]] = []
    timing_sent = False
    while True:
        s = stop_at[0]
        if s is not None and manager.current_step() >= s:
            break
        t_step = time.time()
        manager.start_quorum()
        time.sleep(compute_s)  # the simulated compute of a step (the async quorum overlaps it)
        step = manager.current_step()
        gen = torch.Generator().manual_seed(step * 1000 + gid)
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 10, generator=gen)
        opt.zero_grad()
        try:
            loss_fn(ddp(x), y).backward()
        except Exception as e:  # noqa: BLE001 - the measured breakage: a user's loop dies here
            logging.exception("forward/backward raised at step %d", step)
            out({"error": repr(e)[:300], "step": step})
            os._exit(5)
        participating = bool(manager.is_participating())
        committed = bool(manager.should_commit())
        t1 = time.time()
        if committed:
            opt.step()
        out({"s": step, "c": int(committed), "p": int(participating), "n": int(manager.num_participants()),
             "t0": t_step, "t1": t1, "pid": pid})
        if not timing_sent:
            steps.append([t_step, t1, int(committed), int(participating)])
            if (committed and participating) or len(steps) >= 20:
                timing_sent = True
                out({"timing": dict(marks, steps=steps), "pid": pid})
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(repr(p.detach().flatten().tolist()).encode())
    out({"done": manager.current_step(), "hash": h.hexdigest(), "pid": pid})
    # Wait for the parent's word (EOF / the exit flag), so a peer still finishing its last
    # step is never left without us mid-collective; bounded: the parent ends us long before.
    threading.Event().wait(plan["op_timeout_s"] * (6 if supervised else 1))
    os._exit(0)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
