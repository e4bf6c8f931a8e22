"""Helpers for the process-group tests (no tests here).

``WorkerPool`` keeps N spawned worker processes alive across tests (importing torch
costs seconds on a 2-core machine, so we pay it once per module). A test sends a
module-level function to each worker and collects the results with a deadline;
workers keep state between calls in ``STATE`` (e.g. the group under test), so one
test can configure, kill a peer, and reconfigure the survivors. Teardown kills every
worker by pid. Results cross the pipe as plain Python values (tensors are turned
into ``(dtype, shape, values)``) so nothing is moved through shared memory.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

STATE: dict[str, Any] = {}
_CONN: Connection | None = None


def report(value: Any) -> None:
    """From inside a worker function: send a progress message to the test."""
    assert _CONN is not None
    _CONN.send(("progress", value))


def _worker_main(conn: Connection, idx: int) -> None:
    global _CONN
    _CONN = conn
    logging.basicConfig(level=os.environ.get("RALLYPOINT_TEST_LOG", "WARNING"))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args, kwargs = msg
        try:
            res = fn(*args, **kwargs)
            conn.send(("ok", res))
        except BaseException:  # noqa: BLE001 - report everything to the test
            conn.send(("err", traceback.format_exc()))


class WorkerError(AssertionError):
    pass


class WorkerPool:
    """N spawned workers; every call has a deadline; close() kills by pid."""

    def __init__(self, n: int) -> None:
        self._ctx = mp.get_context("spawn")
        self.procs: list[Any] = [None] * n
        self.conns: list[Connection | None] = [None] * n
        for i in range(n):
            self.spawn(i)

    def spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker_main, args=(child, i), daemon=False, name=f"pg-test-worker-{i}")
        p.start()
        child.close()
        self.procs[i], self.conns[i] = p, parent

    def pid(self, i: int) -> int:
        return self.procs[i].pid

    def submit(self, i: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        conn = self.conns[i]
        assert conn is not None, f"worker {i} is dead"
        conn.send((fn, args, kwargs))

    def _recv(self, i: int, timeout: float) -> tuple[str, Any]:
        conn = self.conns[i]
        assert conn is not None, f"worker {i} is dead"
        if not conn.poll(timeout):
            raise WorkerError(f"worker {i} gave no answer within {timeout:.1f}s")
        try:
            return conn.recv()
        except EOFError:
            raise WorkerError(f"worker {i} died") from None

    def result(self, i: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            kind, value = self._recv(i, max(deadline - time.monotonic(), 0.0))
            if kind == "ok":
                return value
            if kind == "err":
                raise WorkerError(f"worker {i} failed:\n{value}")

    def progress(self, i: int, timeout: float) -> Any:
        kind, value = self._recv(i, timeout)
        if kind == "err":
            raise WorkerError(f"worker {i} failed:\n{value}")
        assert kind == "progress", (kind, value)
        return value

    def run(self, ranks: list[int], fn: Callable[..., Any], args: Callable[[int], tuple], timeout: float) -> list[Any]:
        for i in ranks:
            self.submit(i, fn, *args(i))
        deadline = time.monotonic() + timeout
        return [self.result(i, max(deadline - time.monotonic(), 0.0)) for i in ranks]

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        conn = self.conns[i]
        if conn is not None:
            conn.close()
        self.conns[i] = None

    def close(self) -> None:
        for i, conn in enumerate(self.conns):
            if conn is not None:
                try:
                    conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 10
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
            if self.conns[i] is not None:
                self.conns[i].close()


def new_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------- worker side


def plain(x: Any) -> Any:
    """Tensors -> (dtype, shape, values); containers recursively."""
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        return (str(t.dtype), tuple(t.shape), t.reshape(-1).tolist())
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


def make_pg(kind: str, timeout_s: float) -> Any:
    from rallypoint import process_groups as pgs

    t = datetime.timedelta(seconds=timeout_s)
    if kind == "gloo":
        return pgs.ProcessGroupGloo(timeout=t)
    if kind == "babygloo":
        return pgs.ProcessGroupBabyGloo(timeout=t)
    raise ValueError(kind)


def w_configure(kind: str, store_addr: str, rank: int, world: int, quorum_id: int, timeout_s: float = 10.0, key: str = "pg") -> tuple[int, int]:
    pg = STATE.get(key)
    if pg is None or getattr(pg, "_kind", None) != kind:
        if pg is not None:
            pg.shutdown()
        pg = make_pg(kind, timeout_s)
        pg._kind = kind
        STATE[key] = pg
    pg.set_timeout(datetime.timedelta(seconds=timeout_s))
    pg.configure(store_addr, f"replica_{rank}", rank, world, quorum_id=quorum_id, group_rank=0, group_world_size=1)
    return pg.rank(), pg.size()


def w_shutdown(key: str = "pg") -> None:
    pg = STATE.pop(key, None)
    if pg is not None:
        pg.shutdown()


def w_allreduce(values: list[float], op: str = "SUM", key: str = "pg", timeout_s: float = 10.0) -> list[float]:
    import torch
    from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

    pg = STATE[key]
    t = torch.tensor(values, dtype=torch.float32)
    o = AllreduceOptions()
    o.reduceOp = getattr(ReduceOp, op)
    pg.allreduce([t], o).wait(datetime.timedelta(seconds=timeout_s))
    return t.tolist()


def w_errored(key: str = "pg") -> str | None:
    e = STATE[key].errored()
    return None if e is None else f"{type(e).__name__}: {e}"


def w_allreduce_then_abort(abort_after_s: float, key: str = "pg") -> dict[str, Any]:
    """Post an allreduce that cannot finish (a peer never joins), abort the group from
    another thread after ``abort_after_s``; report how long the wait took and its error."""
    import torch

    pg = STATE[key]
    t = torch.ones(8)
    work = pg.allreduce([t])
    threading.Timer(abort_after_s, pg.abort).start()
    start = time.monotonic()
    try:
        work.wait()
        raised = None
    except Exception as e:  # noqa: BLE001 - the failure is what the test checks
        raised = f"{type(e).__name__}: {e}"
    return {"raised": raised, "wait_s": time.monotonic() - start, "errored": w_errored(key)}


def w_join_threads(prefix: str, timeout_s: float) -> int:
    """Join this worker's threads whose name starts with ``prefix``; how many are left."""
    deadline = time.monotonic() + timeout_s
    for t in [t for t in threading.enumerate() if t.name.startswith(prefix)]:
        while True:
            try:
                t.join(max(0.0, deadline - time.monotonic()))
                break
            except RuntimeError:  # listed while still starting: join() refuses it until it runs
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)  # thread start has no event to wait on
    return len([t for t in threading.enumerate() if t.name.startswith(prefix)])


def w_allreduce_loop(numel: int, max_iters: int, key: str = "pg") -> dict[str, Any]:
    """Allreduce in a loop until an op fails; report progress after the first op."""
    import torch

    pg = STATE[key]
    t = torch.ones(numel)
    it = 0
    while it < max_iters:
        start = time.monotonic()
        try:
            pg.allreduce([t]).wait()
        except Exception as e:  # noqa: BLE001 - the failure is what the test checks
            return {
                "iters": it,
                "raised": f"{type(e).__name__}: {e}",
                "wait_s": time.monotonic() - start,
                "errored": w_errored(key),
                "is_pg_error": type(e).__name__ in ("ProcessGroupError", "ProcessGroupTimeout", "ProcessGroupAborted"),
            }
        it += 1
        t.fill_(1.0)
        if it == 3:
            report("looping")
    return {"iters": it, "raised": None, "wait_s": 0.0, "errored": w_errored(key), "is_pg_error": False}


def resources() -> dict[str, set[str]]:
    """What must not be left behind, by identity (not by count, so that something an
    earlier test left, which goes away during a measurement, cannot hide or fake a
    leak): open fds (number and target), Python threads, native threads, child
    processes, this process's shm segments, mapped memfd segments."""
    import multiprocessing as _mp

    shm = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    children: list[str] = []
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            children = f.read().split()
    except OSError:
        pass
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # closed meanwhile (the listing's own fd, say)
            pass
    return {
        "fds": fds,
        "py_threads": {f"{th.ident}:{th.name}" for th in threading.enumerate()},
        "native_threads": set(os.listdir("/proc/self/task")),
        "children": set(children),
        "mp_children": {str(c.pid) for c in _mp.active_children()},
        "shm_mine": {s for s in shm if str(os.getpid()) in s},
        "memfd_maps": _memfd_maps(),
    }


def _memfd_maps() -> set[str]:
    """Distinct shared-memory (memfd) segments mapped by this process, by inode."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:" in line or "(deleted)" in line and "/dev/shm" in line:
                names.add(line.split()[4])  # inode
    return names


def w_reconfigure_loop(kind: str, store_addr: str, rank: int, world: int, times: int, q0: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Configure + one checked allreduce, ``times`` times, on one group instance.

    Taken with no group alive on both sides (after a warm-up group was shut down, and
    after the looped group was shut down), so anything a configure left behind shows
    up, while what a live group holds does not. ``leaked``: what exists after and did
    not before, per kind (empty when nothing leaked); ``gone``: what existed before and
    not after (an earlier test's leftovers that finished meanwhile: not a leak).
    """
    w_configure(kind, store_addr, rank, world, q0, timeout_s)
    w_allreduce([1.0])
    w_shutdown()
    before = _settled(lambda now, last: now == last)
    t0 = time.monotonic()
    per = []
    for i in range(times):
        c0 = time.monotonic()
        w_configure(kind, store_addr, rank, world, q0 + 1 + i, timeout_s)
        per.append(round(time.monotonic() - c0, 3))
        got = w_allreduce([float(rank + 1)])
        assert got == [float(world * (world + 1) / 2)], got
    elapsed = time.monotonic() - t0
    w_shutdown()
    # threads of a dropped backend need a moment to exit: wait (5 s at most) for nothing new
    after = _settled(lambda now, _: all(now[k] <= before[k] for k in now))
    return {
        "leaked": {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]},
        "gone": {k: sorted(before[k] - after[k]) for k in after if before[k] - after[k]},
        "elapsed": elapsed, "per": per,
    }


def _settled(done: Callable[[dict[str, set[str]], dict[str, set[str]] | None], bool]) -> dict[str, set[str]]:
    """:func:`resources` once ``done(now, last sample)`` holds, or after 5 s."""
    import gc

    deadline = time.monotonic() + 5
    last = None
    while True:
        gc.collect()
        now = resources()
        if done(now, last) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.05)


# --------------------------------------------------------------------- shared pool

_POOL: WorkerPool | None = None
POOL_SIZE = 3


def shared_pool(config: Any) -> WorkerPool:
    """One pool for the whole session (spawning torch workers costs seconds each).

    Dead workers (a test SIGKILLed one) are respawned; the pool is closed -- every
    worker stopped, then killed by pid -- when pytest unconfigures.
    """
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool(POOL_SIZE)

        def close() -> None:
            global _POOL
            if _POOL is not None:
                _POOL.close()
                _POOL = None

        config.add_cleanup(close)
    for i in range(POOL_SIZE):
        p = _POOL.procs[i]
        if _POOL.conns[i] is None or p is None or not p.is_alive():
            _POOL.kill(i)
            _POOL.spawn(i)
    return _POOL


def master_store() -> Any:
    """A TCPStore server on a free port (port 0), in the test process."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def w_register_and_use(key: str = "pg") -> dict[str, Any]:
    """Register the configured group as a torch backend, build a DeviceMesh from it,
    and run functional collectives through the mesh and by group name."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh

    pg = STATE[key]
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    registered = pg.register("cross_replica")
    try:
        mesh = DeviceMesh.from_group(pg, "cpu")
        t = torch.full((4,), float(pg.rank() + 1))
        by_group = funcol.all_reduce(t, "sum", pg).wait()
        by_mesh = funcol.all_reduce(t, "sum", mesh).wait()
        by_name = funcol.all_reduce(t, "sum", pg.group_name).wait()
        return {
            "same_object": registered is pg,
            "mesh_group_is_pg": mesh.get_group() is pg,
            "backend": pg.group_name,
            "by_group": by_group.tolist(),
            "by_mesh": by_mesh.tolist(),
            "by_name": by_name.tolist(),
        }
    finally:
        pg.unregister()


def w_kill_own_child(pending_op: bool, key: str = "pg") -> dict[str, Any]:
    """SIGKILL this rank's baby child; how long until the parent noticed."""
    import torch

    pg = STATE[key]
    pid = pg.child_pid()
    work = pg.allreduce([torch.ones(4)]) if pending_op else None
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    raised = None
    if work is not None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            raised = f"{type(e).__name__}: {e}"
    while pg.errored() is None and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    return {"raised": raised, "errored": w_errored(key), "detect_s": time.monotonic() - t0}


def w_tiny_tensors(n: int, gate: bool = False, key: str = "pg") -> dict[str, Any]:
    """``n`` one-element allreduces issued back to back, then waited.

    With ``gate``, a first allreduce is issued before them and ``report("issued")``
    is sent once all are issued: the test starts the peer only then, so this rank's
    child is busy with the first op while the tiny ones queue up (batching is then
    deterministic: they must leave in a couple of messages, not one each).
    """
    import torch

    pg = STATE[key]
    rank = pg.rank()
    sent0 = getattr(pg, "batches_sent", 0)
    first = torch.tensor([1.0])
    works = [pg.allreduce([first])] if gate else []
    ts = [torch.tensor([float(rank + i)]) for i in range(n)]
    t0 = time.monotonic()
    works += [pg.allreduce([t]) for t in ts]
    issued = time.monotonic() - t0
    if gate:
        report("issued")
    for w in works:
        w.wait()
    elapsed = time.monotonic() - t0
    world = pg.size()
    ok = all(t.item() == sum(r + i for r in range(world)) for i, t in enumerate(ts))
    ok = ok and (not gate or first.item() == world)
    return {"ok": ok, "elapsed": elapsed, "issue_s": issued, "batches": getattr(pg, "batches_sent", 0) - sent0}


def w_unmatched_op_times_out(key: str = "pg") -> dict[str, Any]:
    """Only this rank issues an op: its wait must time out and the child be killed."""
    import torch

    pg = STATE[key]
    pid = pg.child_pid()
    t0 = time.monotonic()
    raised = None
    try:
        pg.allreduce([torch.ones(2)]).wait()
    except Exception as e:  # noqa: BLE001
        raised = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    deadline = time.monotonic() + 5
    alive = True
    while alive and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        time.sleep(0.02)
    return {"raised": raised, "elapsed": elapsed, "child_alive": alive, "errored": w_errored(key)}


def w_large_tensors(n_tensors: int, rounds: int, max_storages: int, key: str = "pg") -> dict[str, Any]:
    """Allreduce ``n_tensors`` 1 MiB tensors ``rounds`` times (zero-copy path, LRU
    eviction in the child when n_tensors > max_storages); all results checked."""
    import torch

    pg = STATE[key]
    pg.max_shared_storages = max_storages
    rank, world = pg.rank(), pg.size()
    ts = [torch.full((1 << 18,), float(rank + i)) for i in range(n_tensors)]
    ok = True
    for rd in range(rounds):
        works = [pg.allreduce([t]) for t in ts]
        for w in works:
            w.wait()
        for i, t in enumerate(ts):
            expect = sum(r + i for r in range(world)) * world**rd
            ok = ok and float(t.min()) == float(t.max()) == float(expect)
    return {"ok": ok, "shared": all(t.is_shared() for t in ts), "cached": len(pg._storages)}
