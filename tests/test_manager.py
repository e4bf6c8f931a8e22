"""End-to-end tests of ``Manager``: a real lighthouse in this process, replica groups
(one rank each) as subprocesses running ``tests/replica_worker.py`` on 127.0.0.1, plus
in-process tests of a single replica group (one or two ranks).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from replica_worker import Replicas


@pytest.fixture
def lighthouse_factory(lighthouse):
    return lighthouse


def assert_identical(r: Replicas, names: list[str], target: int) -> None:
    r.assert_identical(names, target)


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
        assert all(p == 2 for _, p, _ in hist), hist  # both always participated
    assert r.progress("replica_0")["batches"] == 16


@pytest.mark.parametrize("use_async", [True, False], ids=["async_quorum", "sync_quorum"])
def test_late_replica_heals_from_peer(lighthouse_factory, replicas_factory, use_async: bool) -> None:
    """A replica joining at step 3 heals from its peer and both end identical. Both train
    with ``torch.optim.SGD`` with momentum: unless the heal copied the momentum buffers
    too, the late one's parameters would drift from the next step on."""
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=200)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.1, optimizer="torch", **{"async": use_async})
    r.wait_for("replica_0 at step 3", lambda: r.step("replica_0") >= 3, 30)
    r.start("replica_1", seed=2, delay=0.1, optimizer="torch", **{"async": use_async})  # different initial weights
    r.wait_for("replica_1 healed", lambda: r.step("replica_1") >= 4, 30)
    target = max(r.step("replica_0"), r.step("replica_1")) + 4
    r.finish(target, timeout=30)
    assert_identical(r, ["replica_0", "replica_1"], target)
    hist = r.progress("replica_1")["history"]
    assert hist[0][0] > 1, hist  # its first committed step came after the heal, not from 0


@pytest.mark.interop
@pytest.mark.parametrize("training_thread", [False, True], ids=["quorum_thread", "training_thread"])
def test_late_replica_heals_with_torchfts_own_http_transport(lighthouse_factory, replicas_factory,
                                                             training_thread: bool) -> None:
    """A torchft user passes torchft 0.2.0's ``HTTPTransport`` as ``checkpoint_transport``:
    our Manager serves and fetches with it (its methods only: no ``into=`` on the training
    thread, the default), the late replica heals, and both end identical (momentum buffers
    included)."""
    pytest.importorskip("torchft.checkpointing.http_transport")
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=200)
    r = replicas_factory(lh)
    opts = {"optimizer": "torch", "transport": "torchft_http", "training_thread": training_thread}
    r.start("replica_0", seed=1, delay=0.1, **opts)
    r.wait_for("replica_0 at step 3", lambda: r.step("replica_0") >= 3, 30)
    r.start("replica_1", seed=2, delay=0.1, **opts)
    r.wait_for("replica_1 healed", lambda: r.step("replica_1") >= 4, 30)
    target = max(r.step("replica_0"), r.step("replica_1")) + 4
    r.finish(target, timeout=30)
    assert_identical(r, ["replica_0", "replica_1"], target)
    assert r.progress("replica_1")["history"][0][0] > 1  # it started from the healed step, not 0
    healer = next(f for f in r.tmp.glob("replica_1.*.log")).read_text()
    assert "torchft.checkpointing.http_transport fetching checkpoint from" in healer, healer[-3000:]
    assert "received the state of step" in healer, healer[-3000:]


def test_late_replica_heals_striped_from_two_peers(lighthouse_factory, replicas_factory) -> None:
    """Two replicas train; a third joins late and heals from both at once (striped), and
    all three end identical. The weight is big enough (1.3 MB) to be served live."""
    lh = lighthouse_factory(min_replicas=2, join_timeout_ms=2000)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.1, width=80_000)
    r.start("replica_1", seed=2, delay=0.1, width=80_000)
    r.wait_for("two replicas at step 3", lambda: min(r.step("replica_0"), r.step("replica_1")) >= 3, 30)
    r.start("replica_2", seed=3, delay=0.1, width=80_000)
    r.wait_for("replica_2 healed", lambda: r.step("replica_2") >= 4, 30)
    target = max(r.step(n) for n in ("replica_0", "replica_1", "replica_2")) + 3
    r.finish(target, timeout=30)
    assert_identical(r, ["replica_0", "replica_1", "replica_2"], target)
    healer = next(f for f in r.tmp.glob("replica_2.*.log")).read_text()
    assert "striped with ranks" in healer, healer[-3000:]
    sources = "".join(f.read_text() for f in r.tmp.glob("replica_[01].*.log"))
    assert "bytes live" in sources and "changed while it was served" not in sources, sources[-3000:]


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
               lambda: any(p == 1 and s > killed_at for s, p, _ in r.progress("replica_0")["history"]), 15)
    recovery_s = time.monotonic() - t_kill
    assert recovery_s < 12, recovery_s
    r.start("replica_1", seed=3, delay=0.1)
    r.wait_for("restarted replica healed", lambda: r.step("replica_1") > killed_at, 30)
    target = max(r.step("replica_0"), r.step("replica_1")) + 4
    r.finish(target, timeout=30)
    assert_identical(r, ["replica_0", "replica_1"], target)


def test_a_taken_manager_port_falls_back_to_one_the_os_picks(lighthouse_factory, monkeypatch) -> None:
    """torchft's tests pass fixed manager ports (19530 + replica); one taken by anything
    else must not fail the job: nobody dials it by number (the store and the quorum carry
    the address), so the Manager serves on a port the OS picks and says so."""
    from datetime import timedelta

    import torch

    from conftest import reserved_port
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=100)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(k, raising=False)
    with reserved_port(listen=True) as taken:
        m = Manager(ProcessGroupGloo(timeout=timedelta(seconds=5)), lambda sd: None, dict, min_replica_size=1,
                    port=taken, hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                    replica_id="fixed", timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5),
                    connect_timeout=timedelta(seconds=5))
        try:
            assert not m._server.address().endswith(f":{taken}")
            m.start_quorum()
            m.allreduce(torch.tensor([1.0])).wait()
            assert m.should_commit() and m.current_step() == 1
        finally:
            m.shutdown()


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
    """Both ranks connect to the group's store, hosted by the caller (as torchrun's agent
    does); group rank 0 runs the ManagerServer and rank 1 finds it through the store;
    both ranks' votes make the commit."""
    import threading
    from datetime import timedelta

    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=100)
    from torch.distributed import TCPStore

    host_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the launcher's part
    store_port = host_store.port
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


def test_quantized_allreduce_across_two_replica_groups(lighthouse_factory) -> None:
    """``allreduce(t, should_quantize=True)``: both replicas end with bit-identical means
    that differ from the exact mean by no more than the int8 rounding bound (and do
    differ: the bytes really were quantized); ops other than SUM/AVG are refused; the
    older ``allreduce(t, ReduceOp.SUM)`` order still works."""
    import concurrent.futures as cf
    from datetime import timedelta

    import torch
    from torch.distributed import ReduceOp

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=2, join_timeout_ms=5000)
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    ms: list[Any] = []

    def make(i: int) -> Any:
        return Manager(pgs[i], lambda sd: None, dict, min_replica_size=2, rank=0, world_size=1,
                       hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                       replica_id=f"q{i}", timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10),
                       connect_timeout=timedelta(seconds=10), init_sync=False)

    def step(i: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        m = ms[i]
        m.start_quorum()
        q = inputs[i].clone()
        m.allreduce(q, should_quantize=True).wait()
        s = torch.full((3,), float(i + 1))
        m.allreduce(s, ReduceOp.SUM).wait()  # positional reduce_op: the pre-0.2-order call
        with pytest.raises(ValueError, match="quantized allreduce supports SUM and AVG"):
            m.allreduce(torch.ones(2), should_quantize=True, reduce_op=ReduceOp.MAX)
        return q, s, m.should_commit()

    try:
        with cf.ThreadPoolExecutor(2) as ex:
            ms.extend(ex.map(make, range(2)))
            (q0, s0, ok0), (q1, s1, ok1) = ex.map(step, range(2), timeout=60)
        assert ok0 and ok1
        assert torch.equal(q0, q1)  # bit-identical on both replicas
        exact = (inputs[0] + inputs[1]) / 2
        err = (q0 - exact).abs().max().item()
        bound = sum(x.abs().max().item() / 127 / 2 for x in inputs) / 2  # per-rank s/2, then the mean
        assert 0 < err <= bound * 1.001, (err, bound)
        assert s0.tolist() == s1.tolist() == [3.0, 3.0, 3.0]
    finally:
        for m in ms:
            m.shutdown()
        for pg in pgs:
            pg.shutdown()


@pytest.mark.parametrize("when", ["after_collectives", "before_collectives"])
def test_a_peer_leaving_fails_only_collectives_it_could_block(lighthouse_factory, when: str) -> None:
    """A quorum member shuts down (its goodbye reaches the others at once).
    ``after_collectives``: this step's allreduce already finished, so the survivor still
    commits the step (its data is complete; a replica ending its job must not fail its
    peers' last step). ``before_collectives``: the survivor's next allreduce of this
    quorum fails at once, naming the peer, instead of waiting out the timeout."""
    import concurrent.futures as cf
    from datetime import timedelta

    import torch

    from conftest import wait_until
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=30_000)
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=20)) for _ in range(2)]

    def make(i: int) -> Any:
        return Manager(pgs[i], lambda sd: None, dict, min_replica_size=1, rank=0, world_size=1,
                       hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(),
                       replica_id=f"leave{i}", timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=20),
                       connect_timeout=timedelta(seconds=10), init_sync=False)

    def first_half(m: Any) -> int:
        m.start_quorum()
        m.wait_quorum()
        if when == "after_collectives":
            t = torch.ones(3)
            m.allreduce(t).wait()
        return m.num_participants()

    with cf.ThreadPoolExecutor(2) as ex:
        m0, m1 = ex.map(make, range(2))
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            assert list(ex.map(first_half, (m0, m1), timeout=60)) == [2, 2]
        if when == "after_collectives":
            assert m1.should_commit() is True
        m1.shutdown()
        wait_until(lambda: m0._ff._lost_peer is not None, 10, what="the survivor told that leave1 is gone")
        if when == "after_collectives":
            assert m0.should_commit() is True and m0.current_step() == 1
        else:
            t0 = time.monotonic()
            m0.allreduce(torch.ones(3)).wait()
            assert time.monotonic() - t0 < 5  # not the 20 s collective timeout
            assert "leave1" in str(m0.errored())
            assert m0.should_commit() is False
        m0.start_quorum()  # the survivor goes on alone
        t = torch.full((2,), 5.0)
        m0.allreduce(t).wait()
        assert m0.num_participants() == 1 and t.tolist() == [5.0, 5.0]
        assert m0.should_commit() is True
    finally:
        m0.shutdown()
        m1.shutdown()
        for pg in pgs:
            pg.shutdown()


class _Cutter:
    """A TCP relay to ``target`` on 127.0.0.1 (port 0, read back) that can cut every
    connection and refuse new ones while ``down`` is set: a lighthouse outage without
    stopping the lighthouse (so the same address comes back)."""

    def __init__(self, target: tuple[str, int]) -> None:
        import socket
        import threading

        self.target = target
        self.down = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        _, self.port = self.sock.getsockname()
        self.conns: list[Any] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.down.is_set():
                c.close()
                continue
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            with self.lock:
                self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: Any, b: Any) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        import socket

        self.down.set()
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.cut()


def test_lighthouse_outage_backs_off_says_so_once_and_resumes(lighthouse_factory,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """While no lighthouse answers, a group fails steps about once a second (not ~40 a
    second), says so once, and commits again as soon as the lighthouse is back."""
    import logging
    from datetime import timedelta

    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=100)
    host, port = lh.address().split("://")[-1].rsplit(":", 1)
    relay = _Cutter((host, int(port)))
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    m = Manager(pg, lambda sd: None, dict, min_replica_size=1, hostname="127.0.0.1", store_addr="127.0.0.1",
                store_port=0, rank=0, world_size=1, lighthouse_addr=f"http://127.0.0.1:{relay.port}",
                replica_id="outage", timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5),
                connect_timeout=timedelta(seconds=5))

    def step() -> bool:
        m.start_quorum()
        m.allreduce(torch.ones(2)).wait()
        return m.should_commit()

    try:
        assert step()
        relay.cut()
        t0, failed = time.monotonic(), 0
        with caplog.at_level(logging.WARNING, logger="rallypoint.manager"):
            while time.monotonic() - t0 < 3.0:
                assert not step()
                failed += 1
        assert 2 <= failed <= 12, failed  # ~40 per second without the backoff
        said = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        relay.down.clear()
        deadline = time.monotonic() + 15
        while not step():
            assert time.monotonic() < deadline, "no commit after the lighthouse came back"
        assert "get through again" in caplog.text or any("get through again" in r.getMessage()
                                                          for r in caplog.records)
    finally:
        m.shutdown()
        pg.shutdown()
        relay.close()
