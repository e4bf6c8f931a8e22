"""ProcessGroupBabyGloo (backend in a child process) on 3 real processes: results
equal plain torch gloo; a SIGKILLed peer or a SIGKILLed child is seen by the parent
within the timeout and a reconfigure recovers; an unmatched op times out and kills
the child; tiny tensors are batched; repeated reconfigures leak nothing (fds,
threads, processes, shared memory)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from test_process_groups_cases import w_collectives
from test_process_groups_util import (
    WorkerPool,
    master_store,
    new_prefix,
    shared_pool,
    w_allreduce,
    w_allreduce_loop,
    w_configure,
    w_errored,
    w_kill_own_child,
    w_large_tensors,
    w_reconfigure_loop,
    w_shutdown,
    w_tiny_tensors,
    w_unmatched_op_times_out,
)

KIND = "babygloo"


@pytest.fixture(scope="module")
def store() -> Any:
    return master_store()


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> WorkerPool:
    p = shared_pool(request.config)
    yield p
    alive = [i for i in range(3) if p.conns[i] is not None]
    p.run(alive, w_shutdown, lambda r: (), 30)


def addr(store: Any) -> str:
    return f"127.0.0.1:{store.port}/{new_prefix()}"


def test_every_collective_matches_torch_gloo_on_3_ranks(pool: WorkerPool, store: Any) -> None:
    a = addr(store)
    assert pool.run([0, 1, 2], w_configure, lambda r: (KIND, a, r, 3, 7), 120) == [(0, 3), (1, 3), (2, 3)]
    ref = new_prefix()
    results = pool.run([0, 1, 2], w_collectives, lambda r: ("127.0.0.1", store.port, ref, r, 3), 60)
    for r, res in enumerate(results):
        assert len(res) >= 20
        for name, (ours, theirs) in res.items():
            assert ours == theirs, f"rank {r} {name}: ours {ours} != torch gloo {theirs}"


def test_4k_tiny_tensors_are_batched_and_correct(pool: WorkerPool, store: Any) -> None:
    a = addr(store)
    pool.run([0, 1], w_configure, lambda r: (KIND, a, r, 2, 1, 30.0), 120)
    # rank 0 issues everything while its child waits for rank 1 in the first op
    pool.submit(0, w_tiny_tensors, 4096, True)
    assert pool.progress(0, 60) == "issued"
    pool.submit(1, w_tiny_tensors, 4096, True)
    r0, r1 = pool.result(0, 60), pool.result(1, 60)
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["batches"] <= 3, r0  # 4097 ops in at most 3 messages, not one each


def test_large_tensors_are_shared_in_place_with_lru_eviction(pool: WorkerPool, store: Any) -> None:
    a = addr(store)
    pool.run([0, 1], w_configure, lambda r: (KIND, a, r, 2, 1), 120)
    res = pool.run([0, 1], w_large_tensors, lambda r: (6, 3, 4), 60)
    for r in res:
        assert r["ok"] and r["shared"], r
        assert r["cached"] == 4, r


def test_sigkilled_peer_fails_survivors_within_timeout_then_they_recover(pool: WorkerPool, store: Any) -> None:
    timeout_s = 3.0
    a = addr(store)
    pool.run([0, 1, 2], w_configure, lambda r: (KIND, a, r, 3, 1, timeout_s), 120)
    for r in range(3):
        pool.submit(r, w_allreduce_loop, 256 * 1024, 100000)
    for r in range(3):
        assert pool.progress(r, 30) == "looping"
    killed_at = time.monotonic()
    os.kill(pool.pid(2), signal.SIGKILL)  # the whole rank (its child then sees EOF and exits)
    outcomes = [pool.result(r, timeout_s + 10) for r in (0, 1)]
    assert time.monotonic() - killed_at <= timeout_s + 3.0
    pool.kill(2)
    for o in outcomes:
        assert o["raised"] and o["is_pg_error"] and o["errored"], o
        assert "allreduce among 3 peers in quorum 1" in o["raised"], o["raised"]
        assert o["wait_s"] <= timeout_s + 1.0, o
    a2 = addr(store)
    assert pool.run([0, 1], w_configure, lambda r: (KIND, a2, r, 2, 2, timeout_s), 120) == [(0, 2), (1, 2)]
    assert pool.run([0, 1], w_errored, lambda r: (), 10) == [None, None]
    assert pool.run([0, 1], w_allreduce, lambda r: ([float(r + 1), 2.0],), 30) == [[3.0, 4.0], [3.0, 4.0]]


def test_sigkilled_child_is_seen_by_the_parent_and_reconfigure_recovers(pool: WorkerPool, store: Any) -> None:
    timeout_s = 3.0
    a = addr(store)
    pool.run([0, 1, 2], w_configure, lambda r: (KIND, a, r, 3, 1, timeout_s), 120)
    # rank 0: child killed while an op is pending; rank 1: while idle
    pool.submit(0, w_kill_own_child, True)
    pool.submit(1, w_kill_own_child, False)
    busy, idle = pool.result(0, 20), pool.result(1, 20)
    assert busy["raised"] and "died" in busy["raised"], busy
    assert busy["detect_s"] < 2.0 and idle["detect_s"] < 2.0, (busy, idle)
    assert "died" in idle["errored"], idle
    # every rank reconfigures under a new quorum (rank 2's child is fine but its peers changed)
    a2 = addr(store)
    pool.run([0, 1, 2], w_configure, lambda r: (KIND, a2, r, 3, 2, timeout_s), 120)
    assert pool.run([0, 1, 2], w_allreduce, lambda r: ([float(r)],), 30) == [[3.0]] * 3


def test_unmatched_op_times_out_and_kills_the_child(pool: WorkerPool, store: Any) -> None:
    a = addr(store)
    pool.run([0, 1], w_configure, lambda r: (KIND, a, r, 2, 1, 1.0), 120)
    res = pool.run([0], w_unmatched_op_times_out, lambda r: (), 30)[0]
    assert res["raised"] and "ProcessGroupTimeout" in res["raised"], res
    assert "allreduce among 2 peers in quorum 1" in res["raised"]
    assert res["elapsed"] < 3.0, res
    assert not res["child_alive"], res
    assert res["errored"] is not None


@pytest.mark.slow
def test_repeated_reconfigures_leak_nothing(pool: WorkerPool, store: Any) -> None:
    a = addr(store)
    res = pool.run([0, 1], w_reconfigure_loop, lambda r: (KIND, a, r, 2, 5, 100), 120)
    for r in res:
        assert r["leaked"] == {}, json.dumps(r)
