"""Failures at every point of a step, spares, healing over the process group, quorum
timeouts and the peer-down relay: real lighthouse, replica groups as processes
(``tests/replica_worker.py``) or threads, gloo on 127.0.0.1.

What a user checks: survivors keep committing soon after a peer dies (well inside the
collective timeout, with a heartbeat timeout far longer than that), the dead replica
comes back by healing from a peer, and at the end every replica holds the same
parameters at the same step.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from typing import Any

import pytest

from replica_worker import Replicas

#: The heartbeat timeout: far longer than any bound below, so only the liveness stream
#: and aborts can explain a quick recovery.
HEARTBEAT_MS = 30_000
#: The workers' collective timeout (seconds); a survivor stuck in a collective would
#: stall at least this long.
COLLECTIVE_S = 10
#: How long survivors may take to commit again without the dead replica.
RECOVER_S = 6.0


def survivors_commit_without(r: Replicas, names: list[str], after: dict[str, int], members: int) -> bool:
    """Every survivor committed a step past ``after`` in a quorum of ``members``."""
    for n in names:
        prog = r.progress(n)
        if prog is None or not any(s > after[n] and p == members for s, p, _ in prog["history"]):
            return False
    return True


def run_kill_and_rejoin(lighthouse: Any, replicas_factory: Any, faults: list[dict[str, Any]], n: int = 3,
                        **opts: Any) -> Replicas:
    """``n`` replicas train; the last dies at ``faults[0]``, the survivors commit again
    without it soon, and it restarts; each restart carries the next fault (at a step past
    the survivors', so it heals first and dies in a later step), the last restart none:
    that one heals and trains on, and all end identical."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = replicas_factory(lh)
    names = [f"replica_{i}" for i in range(n)]
    victim, survivors = names[-1], names[:-1]
    procs = {name: r.start(name, seed=i + 1, delay=0.05, timeout=COLLECTIVE_S, **({"fault": faults[0]} if name == victim else {}), **opts)
             for i, name in enumerate(names)}
    for k, fault in enumerate(faults):
        rc = r.wait_dead(procs[victim], 40)
        assert rc == -9, f"{victim} exited {rc} instead of dying at {fault}; logs:\n{r.logs()}"
        after = {s: r.step(s) for s in survivors}
        took = r.wait_for(f"survivors committing without {victim} (fault {fault})",
                          lambda: survivors_commit_without(r, survivors, after, n - 1), 20)
        assert took < RECOVER_S, f"survivors took {took:.1f}s to commit again after {fault} (collective timeout {COLLECTIVE_S}s)"
        nxt = {"fault": {**faults[k + 1], "step": max(after.values()) + 2}} if k + 1 < len(faults) else {}
        procs[victim] = r.start(victim, seed=99 + k, delay=0.05, timeout=COLLECTIVE_S, **nxt, **opts)
    r.wait_for(f"{victim} healed and committing", lambda: r.step(victim) > max(after.values()), 30)
    target = max(r.step(x) for x in names) + 3
    r.finish(target, timeout=30)
    r.assert_identical(names, target)
    return r


def test_replica_dies_at_each_point_of_the_step(lighthouse, replicas_factory) -> None:
    """Three replicas (a ring allreduce); the last dies before the quorum of step 3, comes
    back and dies mid-allreduce, comes back and dies after the commit vote (before its
    optimizer stepped), and comes back for good."""
    run_kill_and_rejoin(lighthouse, replicas_factory,
                        [{"at": "before_quorum", "step": 3}, {"at": "mid_allreduce"}, {"at": "after_vote"}])


def test_healing_replica_dies_after_receiving(lighthouse, replicas_factory) -> None:
    """A late replica dies after the state arrived, before applying it; it comes back
    and heals again."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.05, timeout=COLLECTIVE_S)
    r.wait_for("replica_0 at step 3", lambda: r.step("replica_0") >= 3, 30)
    late = r.start("replica_1", seed=2, delay=0.05, timeout=COLLECTIVE_S, fault={"at": "receiving"})
    assert r.wait_dead(late, 30) == -9, r.logs()
    before = r.step("replica_0")
    r.wait_for("replica_0 still committing", lambda: r.step("replica_0") > before + 1, 15)
    r.start("replica_1", seed=3, delay=0.05, timeout=COLLECTIVE_S)
    r.wait_for("replica_1 healed", lambda: r.step("replica_1") >= 4, 30)
    target = max(r.step("replica_0"), r.step("replica_1")) + 3
    r.finish(target, timeout=30)
    r.assert_identical(["replica_0", "replica_1"], target)


def test_sender_dies_while_serving_a_heal(lighthouse, replicas_factory) -> None:
    """replica_0 is the first up-to-date member, so it serves the joiner, and dies
    while reading its state; the joiner heals from replica_1 instead."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = replicas_factory(lh)
    sender = r.start("replica_0", seed=1, delay=0.05, timeout=COLLECTIVE_S, fault={"at": "serving", "step": 3})
    r.start("replica_1", seed=2, delay=0.05, timeout=COLLECTIVE_S)
    r.wait_for("two replicas at step 3", lambda: min(r.step("replica_0"), r.step("replica_1")) >= 3, 30)
    r.start("replica_2", seed=3, delay=0.05, timeout=COLLECTIVE_S)
    assert r.wait_dead(sender, 30) == -9, r.logs()
    r.wait_for("replica_2 healed from replica_1", lambda: r.step("replica_2") >= r.step("replica_0") + 1, 30)
    r.start("replica_0", seed=4, delay=0.05, timeout=COLLECTIVE_S)
    r.wait_for("replica_0 back", lambda: r.step("replica_0") > 4 and r.progress("replica_0")["history"][0][0] > 1, 30)
    names = ["replica_0", "replica_1", "replica_2"]
    target = max(r.step(x) for x in names) + 3
    r.finish(target, timeout=30)
    r.assert_identical(names, target)


@pytest.mark.parametrize("transport", ["http", "pg"])
def test_heal_on_the_training_thread(lighthouse, replicas_factory, transport: str) -> None:
    """``heal_on_training_thread`` (what FSDP needs): a replica killed mid-allreduce comes
    back and heals, and every state callback of senders and receivers ran on the training
    thread, never on the quorum thread."""
    # http: a 1.3 MB weight, served live; the sender's optimizer steps right after its
    # vote while the healing peer may still be fetching (freeze_checkpoint copies it first).
    extra = {"width": 80_000} if transport == "http" else {}
    r = run_kill_and_rejoin(lighthouse, replicas_factory, [{"at": "mid_allreduce", "step": 3}], n=2,
                            training_thread=True, transport=transport, **extra)
    served_or_healed = 0
    for name in ("replica_0", "replica_1"):
        prog = r.progress(name)
        assert prog is not None
        assert set(prog["state_threads"]) <= {prog["train_thread"]}, (name, prog["state_threads"], r.logs())
        served_or_healed += bool(prog["state_threads"])
    assert served_or_healed == 2, r.logs()  # the restarted one received, the survivor served


def test_heal_over_the_process_group(lighthouse, replicas_factory) -> None:
    """``PGTransport`` on the cross-replica gloo group: a late replica (different initial
    weights) and a killed-and-restarted one both heal from a peer."""
    run_kill_and_rejoin(lighthouse, replicas_factory, [{"at": "mid_allreduce", "step": 3}], n=2, transport="pg")


def test_fixed_with_spares(lighthouse, replicas_factory) -> None:
    """FIXED_WITH_SPARES with min_replica_size=2 and three replicas: exactly two
    contribute to every step, the third is a spare that stays identical."""
    # The lighthouse waits for all three, so every step has a spare.
    lh = lighthouse(min_replicas=3, join_timeout_ms=2000, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = replicas_factory(lh)
    names = ["replica_0", "replica_1", "replica_2"]
    r.stop.write_text("6")
    for i, n in enumerate(names):
        r.start(n, seed=i + 1, mode="fixed", min_replica_size=2)
    r.finish(6, timeout=90)  # includes three cold starts (torch imports) on a loaded machine
    r.assert_identical(names, 6)
    rows = [row for n in names for row in r.progress(n)["history"]]
    assert all(p == 2 for _, p, _ in rows), rows  # never more than two contribute
    spare_rows = r.progress("replica_2")["history"]
    assert all(row[2] for row in spare_rows), spare_rows  # the last-ranked replica is the spare
    assert not any(row[2] for row in r.progress("replica_0")["history"])  # the primary
    # replica_1 contributes zeros only while it heals at step 0 (init_sync), then always counts
    assert not any(row[2] for row in r.progress("replica_1")["history"][1:]), r.progress("replica_1")["history"]
    assert r.progress("replica_0")["batches"] == 12  # two batches per committed step


def test_quorum_timeout_raises_a_clear_error(lighthouse) -> None:
    """min_replicas=2 and one replica: no quorum. The async path raises from
    should_commit, the sync path from start_quorum; the message names the replica and
    the lighthouse."""
    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse(min_replicas=2)
    for use_async in (True, False):
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
        m = Manager(pg, lambda sd: None, dict, min_replica_size=1, rank=0, world_size=1, hostname="127.0.0.1",
                    store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id="lonely",
                    timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=1),
                    connect_timeout=timedelta(seconds=5), use_async_quorum=use_async)
        try:
            if use_async:
                m.start_quorum()
                t = torch.ones(2)
                m.allreduce(t).wait()  # never raises mid-step
                with pytest.raises(TimeoutError, match=r"replica lonely:.*no quorum formed.*" + lh.address()):
                    m.should_commit()
            else:
                with pytest.raises(TimeoutError, match=r"replica lonely:.*no quorum formed"):
                    m.start_quorum()
            assert m.current_step() == 0
        finally:
            m.shutdown()
            pg.shutdown()


def test_peer_down_relay_reaches_every_group_rank() -> None:
    """Rank 0 publishes, ranks 1 and 2 hear it on their relay threads; close wakes a
    listener at once and a notice published before a listener started is not replayed."""
    from torch.distributed import TCPStore

    from rallypoint.manager._peer_relay import PeerDownRelay

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    heard: dict[int, list[tuple[str, str]]] = {1: [], 2: []}
    got = {1: threading.Event(), 2: threading.Event()}

    def on(rank: int):
        def cb(rid: str, reason: str) -> None:
            heard[rank].append((rid, reason))
            got[rank].set()
        return cb

    r0 = PeerDownRelay("127.0.0.1", store.port, 0, on(0), timedelta(seconds=5))
    r0.publish("old", "before anyone listened")
    listeners = [PeerDownRelay("127.0.0.1", store.port, k, on(k), timedelta(seconds=5)) for k in (1, 2)]
    for x in listeners:
        x.start()
    r0.publish("replica_b:1234", "stream broke")
    for k in (1, 2):
        assert got[k].wait(10), heard
        assert heard[k] == [("replica_b:1234", "stream broke")]
    for x in listeners:
        x.close(timeout=5)
        assert x._thread is not None and not x._thread.is_alive()
    r0.close()


def test_two_ranks_per_group_kill_and_rejoin(lighthouse, replicas_factory) -> None:
    """Two replica groups of two ranks each (threads of one process per group). Group b
    is SIGKILLed: both ranks of group a commit again without it soon (rank 1 learns of
    the death through rank 0's relay, or its own failed collective), then b restarts,
    each of its ranks heals from the same rank of a, and all four ranks end identical."""
    lh = lighthouse(min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=HEARTBEAT_MS)
    r = replicas_factory(lh)
    r.start("a", seed=1, delay=0.05, timeout=COLLECTIVE_S, ranks=2)
    b = r.start("b", seed=2, delay=0.05, timeout=COLLECTIVE_S, ranks=2)
    ranks = ["a", "a-r1", "b", "b-r1"]
    r.wait_for("both groups at step 3 together",
               lambda: min(r.step(n) for n in ranks) >= 3 and r.progress("a")["history"][-1][1] == 2, 40)
    os.kill(b.pid, signal.SIGKILL)
    r.wait_dead(b, 10)
    after = {n: r.step(n) for n in ("a", "a-r1")}
    took = r.wait_for("both ranks of a committing alone",
                      lambda: survivors_commit_without(r, ["a", "a-r1"], after, 1), 20)
    assert took < RECOVER_S, f"group a took {took:.1f}s to commit again"
    r.start("b", seed=3, delay=0.05, timeout=COLLECTIVE_S, ranks=2)
    r.wait_for("b healed", lambda: min(r.step("b"), r.step("b-r1")) > max(after.values()), 40)
    target = max(r.step(n) for n in ranks) + 3
    r.finish(target, timeout=40)
    r.assert_identical(ranks, target)


def test_groups_of_different_sizes_are_refused_clearly(lighthouse) -> None:
    """A one-rank group and a two-rank group in one quorum cannot train together (group
    rank 1 has no peer): every rank gets a ValueError naming both groups and sizes,
    instead of hanging in configure until a misleading quorum timeout."""
    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse(min_replicas=2, join_timeout_ms=5000)
    from torch.distributed import TCPStore

    host_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the launcher's part
    port = host_store.port
    outcome: dict[str, Any] = {}

    def run(name: str, rank: int, world: int, store_port: int | None) -> None:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
        m = None
        try:
            m = Manager(pg, lambda sd: None, lambda: {"w": torch.zeros(1)}, min_replica_size=1, rank=rank,
                        world_size=world, store_addr="127.0.0.1", store_port=store_port,
                        lighthouse_addr=lh.address(), replica_id=name, hostname="127.0.0.1",
                        timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=20),
                        connect_timeout=timedelta(seconds=10))
            m.start_quorum()
            m.allreduce(torch.ones(2)).wait()
            m.should_commit()
            outcome[f"{name}/{rank}"] = "committed"
        except Exception as e:  # noqa: BLE001 - the error is what the test checks
            outcome[f"{name}/{rank}"] = e
        finally:
            if m is not None:
                m.shutdown()
            pg.shutdown()

    threads = [threading.Thread(target=run, args=a, daemon=True)
               for a in (("solo", 0, 1, None), ("pair", 0, 2, port), ("pair", 1, 2, port))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), outcome
    for key, got in outcome.items():
        assert isinstance(got, ValueError), (key, got)
        assert "different sizes" in str(got) and "has 1 rank" in str(got) and "has 2 rank" in str(got), got


class _Work:
    def __init__(self) -> None:
        self.done = False

    def finished(self) -> bool:
        return self.done


def _failfast(grace: float):
    """A FailFast as the Manager leaves it mid-step: quorum 7 formed with peer "b" and
    set up, one collective in flight, a process group that records aborts."""
    import logging
    import threading
    from datetime import timedelta

    from rallypoint.manager._failfast import FailFast

    class PG:
        aborted = threading.Event()

        def abort(self) -> None:
            self.aborted.set()

    ff = FailFast(PG(), logging.LoggerAdapter(logging.getLogger("test"), {}), "a", timedelta(seconds=5))  # type: ignore[arg-type]
    ff.goodbye_grace_s = grace
    ff.new_round(1, 3)
    ff.quorum_id = 7
    ff.quorum_arrived(["a", "b"])
    ff.setup_done()
    work = ff.add_work(_Work)
    assert isinstance(work, _Work)
    return ff, work


def test_a_peer_that_crashes_mid_collective_aborts_at_once() -> None:
    ff, _ = _failfast(grace=30.0)
    ff.peer_down("b", "stream_broken: connection lost")
    assert ff.pg.aborted.is_set() and "went down" in str(ff.errored())


def test_a_goodbye_mid_collective_lets_the_collective_finish() -> None:
    """A peer ending its job a moment before us: our collective, whose data it has sent,
    finishes within the grace and the step is not failed."""
    ff, work = _failfast(grace=0.3)
    ff.peer_down("b", "goodbye: shutdown")
    work.done = True
    assert not ff.pg.aborted.wait(1.0) and ff.errored() is None


def test_a_goodbye_mid_collective_aborts_after_the_grace_if_it_does_not_finish() -> None:
    """A peer that left mid-step (shutdown from an exception handler): the collective that
    still waits for it is aborted after the grace, not after the full timeout."""
    ff, _ = _failfast(grace=0.2)
    ff.peer_down("b", "goodbye: shutdown")
    assert not ff.pg.aborted.is_set()
    assert ff.pg.aborted.wait(10.0) and "went down" in str(ff.errored())


def test_a_peer_down_while_the_quorum_forms_aborts_nothing() -> None:
    """The lighthouse leaves the dead peer out of the quorum being formed: nothing to abort."""
    ff, _ = _failfast(grace=30.0)
    ff.new_round(2, 4)  # the next round: its quorum has not arrived yet
    ff.peer_down("b", "stream_broken: connection lost")
    assert not ff.pg.aborted.is_set() and ff.errored() is None


def test_a_peer_down_after_the_collectives_fails_only_a_later_collective() -> None:
    """A peer that leaves after our collectives finished does not fail a complete step; a
    collective posted later in the same round fails at once instead of hanging, and the
    next round starts clean."""
    ff, work = _failfast(grace=30.0)
    work.done = True
    ff.peer_down("b", "stream_broken: connection lost")
    assert not ff.pg.aborted.is_set() and ff.errored() is None
    assert ff.add_work(_Work) is None  # refused: it could never finish
    assert ff.pg.aborted.is_set() and "went down" in str(ff.errored())
    ff.new_round(2, 4)
    assert ff.errored() is None and ff.works() == []


def test_a_peer_down_between_rounds_fails_the_next_round_of_the_same_quorum_at_once() -> None:
    """The notice lands after this round's collectives, and the next round is of the same
    quorum (a lease's next step, or a round handed out with the vote before the notice):
    that round still has the dead peer, so its first collective fails at once instead of
    waiting out the timeout. A new quorum without the peer runs normally."""
    ff, work = _failfast(grace=30.0)
    work.done = True
    ff.peer_down("b", "goodbye: manager server shutdown")
    assert not ff.pg.aborted.is_set() and ff.errored() is None
    ff.new_round(2, 4)  # the same lease: quorum 7, with "b"
    ff.quorum_arrived(["a", "b"])
    ff.setup_done()
    assert ff.add_work(_Work) is None
    assert ff.pg.aborted.is_set() and "went down" in str(ff.errored())
    ff.pg.aborted.clear()
    ff.new_round(3, 4)  # the retry gets a new quorum without "b"
    ff.quorum_id = 8
    ff.quorum_arrived(["a", "c"])
    ff.setup_done()
    assert isinstance(ff.add_work(_Work), _Work) and ff.errored() is None and not ff.pg.aborted.is_set()
