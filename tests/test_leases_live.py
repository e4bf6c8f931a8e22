"""Quorum leases with real replica groups (subprocesses running ``tests/replica_worker.py``
on 127.0.0.1): the lighthouse off the step path, and the races of LEASES.md -- a joiner
arriving every step, a member leaving the lease while its peers are mid-allreduce, one
member's stream breaking while the others keep theirs, the lighthouse SIGKILLed mid-run."""

from __future__ import annotations

import signal
from typing import Any

import httpx

from test_manager import _Cutter


def _requests(lh: Any) -> float:
    """The lighthouse's Quorum requests so far (its own counter)."""
    for line in lh.core.metrics.render().decode().splitlines():
        if line.startswith("rallypoint_lighthouse_quorum_requests_total "):
            return float(line.split()[1])
    raise AssertionError("no quorum request counter")


def test_steady_steps_skip_the_lighthouse_and_a_joiner_revokes_and_heals(lighthouse, replicas_factory) -> None:
    lh = lighthouse(min_replicas=2, join_timeout_ms=2000)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.02)
    r.start("replica_1", seed=2, delay=0.02)
    r.wait_for("a lease", lambda: lh.status()["lease"]["quorum_id"] is not None and r.step("replica_0") >= 3, 30)
    before, step0 = _requests(lh), r.step("replica_0")
    r.wait_for("8 more steps", lambda: r.step("replica_0") >= step0 + 8, 30)
    assert _requests(lh) == before, "steps on a lease asked the lighthouse"
    assert lh.status()["lease"]["members"] and lh.core.metrics.render().count(b"rallypoint_step_reports_total") >= 1
    # A joiner revokes the lease, is taken in and heals (more joiners: the HA test, torchft's
    # upscale tests and test_manager's late replicas all run with leases on).
    r.start("replica_2", seed=10, delay=0.02)
    r.wait_for("replica_2 in", lambda: r.step("replica_2") >= 1, 30)
    target = max(r.step(f"replica_{i}") for i in range(3)) + 3
    r.finish(target, timeout=40)
    r.assert_identical([f"replica_{i}" for i in range(3)], target)
    for n in ("replica_0", "replica_1"):
        assert len(r.progress(n)["failed"]) <= 3, r.progress(n)["failed"]  # joiners cost no stream of failures
    why = [e.detail.get("why") for e in lh.core.store.events(limit=500) if e.kind == "lease_revoked"]
    assert why.count("joiner") >= 1, why
    assert lh.status()["lease"]["granted_total"] >= 2


def test_a_member_leaving_the_lease_fails_its_peers_round_now_not_at_the_timeout(lighthouse, replicas_factory) -> None:
    """replica_1 alone fails step 6 (a local error after the collectives) and asks the
    lighthouse; its peers committed 6 and are already in step 7's allreduce on the lease,
    which replica_1 will never join. The revoke names it (after step 5: it retries step 6,
    so every round of the lease from step 6 on may lack it): their round fails at once, and
    everyone goes on -- long before the 60 s collective timeout."""
    # min_replicas 3: the first quorum waits for all three, so replica_1 is in the lease by
    # step 6 (with 2, on a loaded machine its late start let the others train past step 6
    # without it, and it never failed that step).
    lh = lighthouse(min_replicas=3, join_timeout_ms=2000)
    r = replicas_factory(lh)
    opts = {"delay": 0.02, "timeout": 60}
    r.start("replica_0", seed=1, **opts)
    r.start("replica_1", seed=2, fault={"at": "local_error", "step": 6}, **opts)
    r.start("replica_2", seed=3, **opts)
    r.wait_for("past the failure", lambda: all(r.step(f"replica_{i}") >= 9 for i in range(3)), 30)
    # A target ahead of every replica (a fixed 12 could already be passed on a loaded machine).
    target = max(r.step(f"replica_{i}") for i in range(3)) + 3
    r.finish(target, timeout=30)
    r.assert_identical(["replica_0", "replica_1", "replica_2"], target)
    assert 6 in r.progress("replica_1")["failed"]  # (a joiner's split round may have failed one before)
    events = [e for e in lh.core.store.events(limit=500) if e.kind == "lease_revoked"]
    asked = [e for e in events if e.detail.get("why") == "member_asked"]
    assert any("replica_1" in (e.replica_id or "") and e.detail.get("after_step") == 5 for e in asked), \
        [(e.replica_id, e.detail) for e in events]


def test_one_member_losing_its_stream_is_dropped_and_heals_back_in(lighthouse, replicas_factory, tmp_path) -> None:
    from replica_worker import Replicas

    lh = lighthouse(min_replicas=2, join_timeout_ms=1000)
    host, port = lh.address().split("://")[-1].rsplit(":", 1)
    relay = _Cutter((host, int(port)))
    try:
        r = replicas_factory(lh)
        cut = Replicas(tmp_path, f"http://127.0.0.1:{relay.port}")  # replica_2 reaches the lighthouse through the relay
        for name, seed in (("replica_0", 1), ("replica_1", 2)):
            r.start(name, seed=seed, delay=0.02)
        cut.start("replica_2", seed=3, delay=0.02)
        r.wait_for("a lease of three", lambda: len(lh.status()["lease"]["members"]) == 3 and r.step("replica_0") >= 3, 30)
        relay.cut()  # replica_2's stream (and every call of its) breaks; 0 and 1 keep theirs

        def gone() -> bool:
            return any(e.kind == "lease_revoked" and e.detail.get("why") == "member_gone"
                       for e in lh.core.store.events(limit=1000))

        # replica_2 goes on stepping on the lease until the lighthouse sees its stream break.
        r.wait_for("the lease revoked for replica_2", gone, 30)
        s0 = r.step("replica_0")
        r.wait_for("0 and 1 go on without 2", lambda: r.step("replica_0") >= s0 + 5 and r.step("replica_1") >= s0 + 5, 30)
        assert r.step("replica_2") < r.step("replica_0")
        relay.down.clear()
        # Back in means a lease of three again, with replica_2 caught up: a replica_2 merely
        # stepping (it failed rounds while cut off) could still be outside the quorum.
        r.wait_for("replica_2 back in a lease of three",
                   lambda: len(lh.status()["lease"]["members"] or []) == 3
                   and r.step("replica_2") >= r.step("replica_0") - 1 >= s0 + 5, 40)
        target = max(r.step(n) for n in ("replica_0", "replica_1", "replica_2")) + 4
        r.finish(target, timeout=40)
        cut.finish(target, timeout=20)
        r.assert_identical(["replica_0", "replica_1", "replica_2"], target)
        why = [e.detail.get("why") for e in lh.core.store.events(limit=1000) if e.kind == "lease_revoked"]
        assert "member_gone" in why, why
    finally:
        relay.close()


def test_a_sigkilled_lighthouse_costs_leased_groups_no_step(cli_lighthouse, tmp_path) -> None:
    from replica_worker import Replicas

    lh = cli_lighthouse(min_replicas=2, extra=["--join-timeout-ms", "2000"], http=True)
    r = Replicas(tmp_path, lh.address)
    try:
        r.start("replica_0", seed=1, delay=0.02)
        r.start("replica_1", seed=2, delay=0.02)
        r.wait_for("a lease", lambda: r.step("replica_0") >= 3 and r.step("replica_1") >= 3
                   and httpx.get(f"{lh.http}/status", timeout=5).json()["lease"]["quorum_id"] is not None, 30)
        lh.proc.kill(signal.SIGKILL)
        assert lh.proc.wait(10.0) == -signal.SIGKILL
        s = max(r.step("replica_0"), r.step("replica_1"))
        r.wait_for("8 steps without a lighthouse", lambda: min(r.step("replica_0"), r.step("replica_1")) >= s + 8, 30)
        r.finish(s + 10, timeout=30)
        r.assert_identical(["replica_0", "replica_1"], s + 10)
        for n in ("replica_0", "replica_1"):
            assert r.progress(n)["failed"] == [], r.progress(n)["failed"]
    finally:
        r.kill_all()
