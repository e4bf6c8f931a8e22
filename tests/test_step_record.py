"""The Manager's per-round record (``rallypoint.manager._record``): the time split as a
pure function of the stamps (table), and what a real Manager records for committed,
failed and collective-free rounds (one replica group in this process)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from rallypoint.manager._record import StepRecord


def _rec(**kw: Any) -> StepRecord:
    base: dict[str, Any] = dict(round=1, step=4, since=100.0, started=100.5, quorum_id=3, participants=("a", "b"),
                                participating_rank=0, participating_world_size=2)
    base.update(kw)
    return StepRecord(**base)


@pytest.mark.parametrize("kw, want", [
    # forward until the first collective at 102 (2 s after the previous round), nothing waited
    (dict(first_collective=102.0, last_collective_done=103.0, commit_started=103.1, ended=103.2),
     dict(step_s=3.2, compute_s=2.0, comm_s=1.0, commit_s=0.1, kind="committed")),
    # 0.5 s blocked on the quorum and 0.25 s healing before the first collective come off compute
    (dict(first_collective=102.0, last_collective_done=102.5, commit_started=102.6, ended=102.7,
          quorum_wait_s=0.5, heal_s=0.25, heal_before_s=0.25),
     dict(step_s=2.7, compute_s=1.25, comm_s=0.5, kind="committed")),
    # healing after the first collective (a training-thread heal in should_commit) does not
    (dict(first_collective=102.0, last_collective_done=102.5, commit_started=103.6, ended=103.7, heal_s=1.0),
     dict(compute_s=2.0, commit_s=0.1)),
    # no collective: compute runs to the commit vote
    (dict(commit_started=101.0, ended=101.5), dict(compute_s=1.0, comm_s=0.0, commit_s=0.5)),
    # a healing round, a spare round, a failed one, one without should_commit
    (dict(healing=True, participating_rank=None, ended=101.0), dict(kind="healing")),
    (dict(participating_rank=None, ended=101.0), dict(kind="spare")),
    (dict(participating_rank=None, ended=101.0, outcome="failed"), dict(kind="failed")),
    (dict(ended=101.0, outcome="abandoned"), dict(kind="failed")),
    # still open: nothing derived yet
    (dict(), dict(step_s=None, compute_s=None, commit_s=None)),
])
def test_time_split(kw: dict[str, Any], want: dict[str, Any]) -> None:
    rec = _rec(**{"outcome": "committed" if "ended" in kw else "pending", **kw})
    for key, value in want.items():
        got = getattr(rec, key)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), (key, got, rec)


def test_stats_are_what_the_lighthouse_gets_and_the_dict_is_json() -> None:
    import json

    assert _rec().stats() is None  # an open round reports nothing
    rec = _rec(first_collective=102.0, last_collective_done=103.0, commit_started=103.1, ended=103.2,
               outcome="committed")
    stats = rec.stats()
    assert stats is not None and set(stats) == {"step", "round", "outcome", "step_s", "compute_s", "quorum_wait_s",
                                                "comm_s", "heal_s", "commit_s", "configure_s"}
    assert stats["outcome"] == "committed" and stats["step"] == 4 and stats["compute_s"] == pytest.approx(2.0)
    d = json.loads(json.dumps(rec.as_dict()))
    assert d["participants"] == ["a", "b"] and d["kind"] == "committed" and "since" not in d


def test_a_manager_records_each_round(lighthouse, monkeypatch) -> None:
    """One replica group in this process: a committed round with a known forward time, a
    failed round (the error is in its record), and the stats sent with the next quorum."""
    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    lh = lighthouse(min_replicas=1, join_timeout_ms=100)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(k, raising=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    m = Manager(pg, lambda sd: None, lambda: {"w": torch.zeros(2)}, min_replica_size=1, hostname="127.0.0.1",
                store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id="rec",
                timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5),
                connect_timeout=timedelta(seconds=5))
    sent: list[Any] = []
    real = m._client._quorum
    m._client._quorum = lambda **kw: (sent.append(kw.get("step_stats")), real(**kw))[1]
    try:
        assert m.step_record() is None
        m.start_quorum()
        time.sleep(0.2)  # "forward": before the first collective
        m.allreduce(torch.ones(3)).wait()
        assert m.should_commit() is True
        first = m.step_record()
        assert first is not None and first.outcome == "committed" and first.round == 1 and first.step == 0
        assert first.participants == (m.replica_id,) and first.collectives == 1 and first.quorum_id is not None
        assert first.compute_s is not None and 0.2 <= first.compute_s < 5, first
        assert first.step_s is not None and first.step_s >= first.compute_s

        m.start_quorum()
        m.report_error(RuntimeError("injected: bad batch"))
        assert m.should_commit() is False
        second = m.step_record()
        assert second is not None and second.outcome == "failed" and "bad batch" in (second.error or "")
        assert second.cause == "error" and second.stats()["cause"] == "error"
        assert second.round == 2 and second.step == 1 and second.collectives == 0

        m.start_quorum()
        assert m.should_commit() is True
        assert [r.outcome for r in m.step_records()] == ["committed", "failed", "committed"]
        # Each quorum request carried the previous round's stats (none before the first).
        assert sent[0] is None and sent[1]["outcome"] == "committed" and sent[1]["round"] == 1
        assert sent[2]["outcome"] == "failed" and sent[2]["step"] == 1
    finally:
        m.shutdown()
        pg.shutdown()


def test_stats_of_every_kind_of_round_pass_the_servers_check() -> None:
    """Whatever a round looked like, the Manager never sends stats its own server refuses."""
    from rallypoint.manager.rules import check_step_stats

    for kw in (dict(ended=101.0, outcome="abandoned"), dict(ended=101.0, outcome="failed", healing=True),
               dict(ended=101.0, outcome="committed", participating_rank=None),
               dict(first_collective=102.0, last_collective_done=103.0, commit_started=103.1, ended=103.2,
                    outcome="committed")):
        stats = _rec(**kw).stats()
        assert stats is not None and check_step_stats(stats) == stats, kw


@pytest.mark.parametrize("error, cause", [
    (ConnectionError("peer replica b:1 went down (stream_broken: connection lost)"), "peer_down"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), "error"),
    (RuntimeError("Gloo allreduce failed: Connection reset"), "comm"),
    (TimeoutError("allreduce did not complete in time"), "comm"),
    (TimeoutError("quorum for group rank 0 at step 3 timed out"), "quorum"),
    (RuntimeError("injected fault: drop-collective"), "injected"),
    (RuntimeError("silent data corruption: replica 1's gradient norm is NaN"), "sdc"),
    (KeyError("received state has no 'model' entry"), "error"),
])
def test_cause_of(error: Exception, cause: str) -> None:
    from rallypoint.manager._record import cause_of

    assert cause_of(error) == cause


def test_stats_naming_many_long_groups_still_fit_the_servers_limit() -> None:
    import json

    from rallypoint.manager.rules import MAX_STEP_STATS_BYTES, check_step_stats

    names = [f"{'g' * 150}{i}:{'0' * 36}" for i in range(8)]  # 8 x 188 characters: over the limit
    rec = _rec(ended=101.0, outcome="failed", cause="sdc", extra={"sdc_failed": "grad", "sdc_bad": names})
    stats = rec.stats()
    assert stats is not None and 1 <= len(stats["sdc_bad"]) < 8 and stats["sdc"] == "grad"
    assert len(json.dumps(stats, separators=(",", ":"))) <= MAX_STEP_STATS_BYTES and check_step_stats(stats) == stats
