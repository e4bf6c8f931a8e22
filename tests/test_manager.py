"""End-to-end tests of ``Manager``: a real lighthouse in this process, replica groups
(one rank each) as subprocesses running this file's ``worker`` on 127.0.0.1.

Each worker trains a tiny ``nn.Linear`` on its own synthetic data, averaging gradients
with ``Manager.allreduce`` and committing with ``should_commit``. It writes its progress
(step, participants, parameter hash) to a JSON file after every step and stops once its
step reaches the target written to a stop file (or after a wall-clock limit).
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

import pytest

HERE = Path(__file__).resolve()
LIMIT_S = 45.0  # a worker's own wall-clock limit


# ---------------------------------------------------------------------- worker side
def worker(lighthouse: str, replica: str, seed: int, out: str, stop: str, delay: float, use_async: bool = True) -> int:
    import logging
    from datetime import timedelta

    import torch
    from torch import nn

    from rallypoint.manager.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    m = Manager(
        pg=pg, load_state_dict=load, state_dict=save, min_replica_size=1,
        rank=0, world_size=1, store_addr="127.0.0.1", lighthouse_addr=lighthouse, replica_id=replica,
        hostname="127.0.0.1", timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10),
        connect_timeout=timedelta(seconds=10), use_async_quorum=use_async,
    )
    gen = torch.Generator().manual_seed(1000 + seed)
    history: list[list[int]] = []
    t0 = time.monotonic()
    rc = 0
    try:
        while True:
            if os.path.exists(stop):
                target = int(Path(stop).read_text() or "1000000")
                if m.current_step() >= target:
                    break
            if time.monotonic() - t0 > LIMIT_S:
                rc = 3
                break
            m.start_quorum()
            x = torch.randn(8, 4, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                m.allreduce(p.grad).wait()
            participants = m.num_participants()
            if m.should_commit():
                opt.step()
            history.append([m.current_step(), participants])
            h = hashlib.sha256(repr([p.detach().flatten().tolist() for p in model.parameters()]).encode()).hexdigest()
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({
                "step": m.current_step(), "batches": m.batches_committed(), "hash": h,
                "history": history, "replica_id": m.replica_id,
            }))
            os.replace(tmp, out)
            time.sleep(delay)
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
    return rc


# ---------------------------------------------------------------------- test side
class Replicas:
    def __init__(self, tmp: Path, lighthouse: str) -> None:
        self.tmp = tmp
        self.lighthouse = lighthouse
        self.procs: dict[str, subprocess.Popen] = {}
        self.stop = tmp / "stop"

    def start(self, name: str, seed: int, delay: float = 0.05, use_async: bool = True) -> subprocess.Popen:
        out = self.tmp / f"{name}.json"
        out.unlink(missing_ok=True)
        log = open(self.tmp / f"{name}.{len(self.procs)}.log", "w")
        p = subprocess.Popen(
            [sys.executable, str(HERE), self.lighthouse, name, str(seed), str(out), str(self.stop), str(delay), "async" if use_async else "sync"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        self.procs[f"{name}#{p.pid}"] = p
        return p

    def progress(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.tmp / f"{name}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; logs:\n{self.logs()}")

    def step(self, name: str) -> int:
        p = self.progress(name)
        return p["step"] if p else -1

    def finish(self, target: int, timeout: float = 30.0) -> None:
        self.stop.write_text(str(target))
        deadline = time.monotonic() + timeout
        for key, p in self.procs.items():
            if p.poll() is None and p.returncode is None:
                try:
                    rc = p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{key} did not stop; logs:\n{self.logs()}") from None
                assert rc == 0, f"{key} exited {rc}; logs:\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(f"==== {f.name}\n{f.read_text()[-4000:]}" for f in sorted(self.tmp.glob("*.log")))

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)


@pytest.fixture
def lighthouse_factory():
    from rallypoint.lighthouse.server import LighthouseServer

    made: list[Any] = []

    def make(**kw: Any) -> Any:
        lh = LighthouseServer(bind="127.0.0.1:0", **kw)
        made.append(lh)
        return lh

    yield make
    for lh in made:
        lh.shutdown()


@pytest.fixture
def replicas_factory(tmp_path: Path):
    made: list[Replicas] = []

    def make(lh: Any) -> Replicas:
        r = Replicas(tmp_path, lh.address())
        made.append(r)
        return r

    yield make
    for r in made:
        r.kill_all()


def assert_identical(r: Replicas, names: list[str], target: int) -> None:
    prog = [r.progress(n) for n in names]
    assert all(p is not None for p in prog), r.logs()
    assert [p["step"] for p in prog] == [target] * len(names), (prog, r.logs())
    assert len({p["hash"] for p in prog}) == 1, ([p["hash"] for p in prog], r.logs())
    assert len({p["batches"] for p in prog}) == 1, prog


def test_two_replicas_train_in_lockstep(lighthouse_factory, replicas_factory) -> None:
    lh = lighthouse_factory(min_replicas=2, join_timeout_ms=2000)
    r = replicas_factory(lh)
    r.stop.write_text("8")
    r.start("replica_0", seed=1)
    r.start("replica_1", seed=2)
    r.finish(8, timeout=40)
    assert_identical(r, ["replica_0", "replica_1"], 8)
    for n in ("replica_0", "replica_1"):
        hist = r.progress(n)["history"]
        assert all(p == 2 for _, p in hist), hist  # both always participated
    assert r.progress("replica_0")["batches"] == 16


@pytest.mark.parametrize("use_async", [True, False], ids=["async_quorum", "sync_quorum"])
def test_late_replica_heals_from_peer(lighthouse_factory, replicas_factory, use_async: bool) -> None:
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=200)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.1, use_async=use_async)
    r.wait_for("replica_0 at step 3", lambda: r.step("replica_0") >= 3, 30)
    r.start("replica_1", seed=2, delay=0.1, use_async=use_async)  # different initial weights
    r.wait_for("replica_1 healed", lambda: r.step("replica_1") >= 4, 30)
    target = max(r.step("replica_0"), r.step("replica_1")) + 4
    r.finish(target, timeout=30)
    assert_identical(r, ["replica_0", "replica_1"], target)
    hist = r.progress("replica_1")["history"]
    assert hist[0][0] > 1, hist  # its first committed step came after the heal, not from 0


def test_killed_replica_survivor_continues_and_restart_heals(lighthouse_factory, replicas_factory) -> None:
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.1)
    b = r.start("replica_1", seed=2, delay=0.1)
    r.wait_for("both replicas at step 3 together",
               lambda: min(r.step("replica_0"), r.step("replica_1")) >= 3
               and r.progress("replica_0")["history"][-1][1] == 2, 30)
    os.kill(b.pid, signal.SIGKILL)
    b.wait(5)
    killed_at = r.step("replica_0")
    t_kill = time.monotonic()
    r.wait_for("survivor committing alone",
               lambda: any(p == 1 and s > killed_at for s, p in r.progress("replica_0")["history"]), 15)
    recovery_s = time.monotonic() - t_kill
    assert recovery_s < 12, recovery_s
    r.start("replica_1", seed=3, delay=0.1)
    r.wait_for("restarted replica healed", lambda: r.step("replica_1") > killed_at, 30)
    target = max(r.step("replica_0"), r.step("replica_1")) + 4
    r.finish(target, timeout=30)
    assert_identical(r, ["replica_0", "replica_1"], target)


def test_single_replica_in_process_errors_retries_and_state(lighthouse_factory, monkeypatch) -> None:
    """One replica group in this process: env fallbacks, a reported error turns the
    step's commit false and allreduce into a no-op, max_retries raises, state round-trips."""
    from datetime import timedelta

    import torch

    from rallypoint.manager import Manager, WorldSizeMode
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=100)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RALLYPOINT_LIGHTHOUSE", lh.address())
    monkeypatch.setenv("REPLICA_GROUP_ID", "solo")
    loaded: list[Any] = []
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    m = Manager(pg, loaded.append, lambda: {"w": 1}, min_replica_size=1, hostname="127.0.0.1",
                store_addr="127.0.0.1", timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5),
                connect_timeout=timedelta(seconds=5), max_retries=1, world_size_mode=WorldSizeMode.DYNAMIC)
    try:
        assert m.replica_id.startswith("solo:")
        assert m.num_participants() == 0 and m.participating_rank() is None
        m.start_quorum()
        t = torch.tensor([2.0, 4.0])
        m.allreduce(t).wait()
        assert t.tolist() == [2.0, 4.0]  # mean over one participant
        assert m.is_participating() and m.participating_rank() == 0 and m.num_participants() == 1
        assert m.should_commit() is True
        assert (m.current_step(), m.batches_committed()) == (1, 1)

        m.start_quorum()
        m.report_error(RuntimeError("boom"))
        assert isinstance(m.errored(), RuntimeError)
        t = torch.tensor([3.0])
        w = m.allreduce(t)
        assert w.wait() is True and t.tolist() == [3.0]  # no-op once errored
        assert m.should_commit() is False
        assert m.current_step() == 1

        m.start_quorum()  # retry of step 1: the error is cleared
        assert m.errored() is None
        m.report_error(RuntimeError("and again"))
        with pytest.raises(RuntimeError, match="consecutive failed steps"):
            m.should_commit()  # 2nd consecutive failure > max_retries=1

        assert m.state_dict() == {"step": 1, "batches_committed": 1}
        m.load_state_dict({"step": 7, "batches_committed": 9})
        assert (m.current_step(), m.batches_committed()) == (7, 9)
        with pytest.raises(ValueError):
            m.register_state_dict_fn("default", loaded.append, dict)
    finally:
        m.shutdown()
        pg.shutdown()


def test_two_ranks_of_one_group_share_the_server(lighthouse_factory) -> None:
    """Group rank 0 owns the store and the ManagerServer; rank 1 finds it through the
    store (MASTER_ADDR/MASTER_PORT); both ranks' votes make the commit."""
    import socket
    import threading
    from datetime import timedelta

    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store_port = s.getsockname()[1]
    results: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
        m = None
        try:
            m = Manager(pg, lambda sd: None, dict, min_replica_size=1, rank=rank, world_size=2,
                        store_addr="127.0.0.1", store_port=store_port, lighthouse_addr=lh.address(),
                        replica_id="grp", hostname="127.0.0.1", timeout=timedelta(seconds=5),
                        quorum_timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5))
            got = []
            for _ in range(3):
                m.start_quorum()
                t = torch.tensor([float(rank + 1)])
                m.allreduce(t).wait()
                got.append((m.should_commit(), t.item()))
            results[rank] = (got, m.current_step(), m.replica_id)
        except Exception as e:  # noqa: BLE001
            results[rank] = e
        finally:
            if m is not None:
                m.shutdown()
            pg.shutdown()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), results
    for rank in (0, 1):
        got, step, rid = results[rank]
        assert got == [(True, float(rank + 1))] * 3 and step == 3, results
    assert results[0][2] == results[1][2] and results[0][2].startswith("grp:")


def test_step_commits_after_a_failed_attempt(lighthouse_factory) -> None:
    from datetime import timedelta

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=100)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    m = Manager(pg, lambda sd: None, dict, min_replica_size=1, rank=0, world_size=1, hostname="127.0.0.1",
                store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id="retry",
                timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5),
                connect_timeout=timedelta(seconds=5))
    try:
        m.start_quorum()
        m.report_error(RuntimeError("boom"))
        assert m.should_commit() is False
        m.start_quorum()
        assert m.should_commit() is True and m.current_step() == 1
    finally:
        m.shutdown()
        pg.shutdown()


if __name__ == "__main__":
    lh_addr, name, seed_s, out_s, stop_s, delay_s, mode = sys.argv[1:8]
    sys.exit(worker(lh_addr, name, int(seed_s), out_s, stop_s, float(delay_s), mode == "async"))
