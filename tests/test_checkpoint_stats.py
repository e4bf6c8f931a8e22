"""A group's durable checkpointing as the lighthouse shows it: the ``ckpt`` object of the
step stats (checked on both sides: hostile values refused), summed over a group's ranks,
and a live job whose ``/status``, ``/metrics`` and dashboard data show the last complete
step once a checkpoint completes."""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rallypoint.lighthouse import checkpoints as lck
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.manager import rules
from rallypoint.manager._record import MAX_STATS_BYTES, StepRecord

GOOD = {"step": 60, "age_s": 12.5, "writes": 3, "bytes": 4096, "failures": 0, "skipped": 1, "stall_s": 0.02}

HOSTILE = [
    ("not an object", "must be a JSON object"),
    ([1, 2], "must be a JSON object"),
    ({"step": "60"}, "ckpt.step"),
    ({"step": 60.0}, "ckpt.step"),
    ({"step": True}, "ckpt.step"),
    ({"step": -1}, "ckpt.step"),
    ({"bytes": 10**30}, "ckpt.bytes"),
    ({"writes": 2**53 + 1}, "ckpt.writes"),
    ({"age_s": -0.5}, "ckpt.age_s"),
    ({"age_s": 1e300}, "ckpt.age_s"),
    ({"stall_s": 10**400}, "ckpt.stall_s"),
    ({"stall_s": "0.1"}, "ckpt.stall_s"),
    ({"stall_s": None}, "ckpt.stall_s"),
    ({"path": "/etc"}, "unknown key"),
    ({"step": {"nested": 1}}, "ckpt.step"),
]


# ----------------------------------------------------------------------------- the manager side
def test_good_ckpt_passes_both_checks() -> None:
    assert rules.check_ckpt(GOOD) == {**GOOD, "age_s": 12.5, "stall_s": 0.02}
    text = rules.encode_step_stats({"step": 61, "outcome": "committed", "ckpt": GOOD})
    assert rules.parse_step_stats(text)["ckpt"]["step"] == 60  # type: ignore[index]
    assert lck.check_ckpt(GOOD) == lck.CkptReport(**GOOD)


@pytest.mark.parametrize("bad,why", HOSTILE)
def test_hostile_ckpt_is_refused_by_the_manager_server(bad: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("ckpt.", r"ckpt\.")):
        rules.check_ckpt(bad)
    with pytest.raises(ValueError, match="ckpt"):
        rules.check_step_stats({"step": 1, "ckpt": bad})


def test_nan_and_infinity_are_refused() -> None:
    for text in ('{"step":1,"ckpt":{"age_s":NaN}}', '{"step":1,"ckpt":{"stall_s":Infinity}}'):
        with pytest.raises(ValueError, match="ckpt"):
            rules.parse_step_stats(text)
        with pytest.raises(lck.BadCkpt):
            lck.parse_ckpt('{"step_stats":' + text + "}")


@pytest.mark.parametrize("parts,merged", [
    ([None, None], None),
    ([{"writes": 1, "bytes": 10, "stall_s": 0.1}, {"writes": 1, "bytes": 30, "stall_s": 0.3}],
     {"writes": 2, "bytes": 40, "stall_s": 0.3}),
    # The committer knows of step 40 already, the other rank still of 20: the group's is 40.
    ([{"step": 40, "age_s": 1.0, "failures": 0}, {"step": 20, "age_s": 0.5, "failures": 2}, None],
     {"step": 40, "age_s": 1.0, "failures": 2}),
    ([{"step": 40, "age_s": 3.0}, {"step": 40, "age_s": 1.0}], {"step": 40, "age_s": 1.0}),
])
def test_merge_ckpt_over_a_groups_ranks(parts: list, merged: dict | None) -> None:
    assert rules.merge_ckpt(parts) == merged


def test_the_group_request_carries_every_ranks_checkpoint_figures() -> None:
    reqs = [rules.RankRequest(0, step_stats={"compute_s": 1.0, "ckpt": {"step": 20, "writes": 1, "bytes": 8}}),
            rules.RankRequest(1, step_stats={"compute_s": 2.0, "ckpt": {"writes": 1, "bytes": 16}})]
    data = rules.aggregate_requests(21, 2, reqs, 0.0, 0.0).data
    assert data["step_stats"]["rank"] == 1  # the slowest rank's timings ...
    assert data["step_stats"]["ckpt"] == {"step": 20, "writes": 2, "bytes": 24}  # ... the group's checkpoint


def test_the_record_sends_ckpt_within_the_size_limit() -> None:
    rec = StepRecord(round=3, step=3, since=0.0, started=0.0, ended=1.0, outcome="failed", cause="sdc")
    rec.extra.update(ckpt={**GOOD, "bytes": 2**53, "stall_s": 123456.789012}, sdc_failed="grad",
                     sdc_bad=["x" * 256] * 8)
    stats = rec.stats()
    assert stats is not None and stats["ckpt"]["bytes"] == 2**53
    text = rules.encode_step_stats(stats)
    assert len(text) <= MAX_STATS_BYTES and rules.parse_step_stats(text) is not None


# ----------------------------------------------------------------------------- the lighthouse side
@pytest.mark.parametrize("bad,why", HOSTILE)
def test_hostile_ckpt_is_refused_by_the_lighthouse(bad: Any, why: str) -> None:
    with pytest.raises(lck.BadCkpt, match=why.replace("ckpt.", r"ckpt\.")):
        lck.parse_ckpt(json.dumps({"step_stats": {"step": 1, "outcome": "committed", "ckpt": bad}}))


def test_lighthouse_parse_ignores_what_carries_no_ckpt() -> None:
    assert lck.parse_ckpt("") is None
    assert lck.parse_ckpt('{"step_stats": {"outcome": "committed"}}') is None
    assert lck.parse_ckpt('["ckpt"]') is None
    with pytest.raises(lck.BadCkpt, match="not valid JSON"):
        lck.parse_ckpt('{"ckpt": ')


def test_the_book_ages_on_the_lighthouse_clock_and_forgets() -> None:
    book = lck.CheckpointBook()
    book.observe("a", lck.CkptReport(step=60, age_s=2.0, writes=3), now=100.0)
    book.observe("b", lck.CkptReport(writes=0), now=100.0)
    assert book.status("a", 110.5) == {"last_complete_step": 60, "age_s": 12.5, "writes": 3, "bytes": 0,
                                       "stall_s": 0.0, "failures": 0, "skipped": 0}
    assert book.status("b", 110.0)["last_complete_step"] is None  # type: ignore[index]
    assert book.status("c", 110.0) is None
    book.keep_only({"b"})
    assert set(book.rows(111.0)) == {"b"}
    for i in range(lck.MAX_GROUPS + 5):
        book.observe(f"g{i}", lck.CkptReport(), now=0.0)
    assert len(book.rows(0.0)) == lck.MAX_GROUPS  # bounded


def test_metrics_show_each_groups_series() -> None:
    m = LighthouseMetrics()
    book = lck.CheckpointBook()
    book.observe("a", lck.CkptReport(step=60, age_s=5.0, writes=3, bytes=4096, failures=1, stall_s=0.25), now=10.0)
    book.observe("b", lck.CkptReport(writes=1), now=10.0)
    m.set_checkpoints(book.rows(12.0))
    text = m.render().decode()
    for line in ('rallypoint_checkpoint_last_complete_step{replica_id="a"} 60.0',
                 'rallypoint_checkpoint_age_seconds{replica_id="a"} 7.0',
                 'rallypoint_checkpoint_writes_total{replica_id="a"} 3.0',
                 'rallypoint_checkpoint_bytes_total{replica_id="a"} 4096.0',
                 'rallypoint_checkpoint_stall_seconds_total{replica_id="a"} 0.25',
                 'rallypoint_checkpoint_failures_total{replica_id="a"} 1.0',
                 'rallypoint_checkpoint_writes_total{replica_id="b"} 1.0'):
        assert line in text, text
    assert 'rallypoint_checkpoint_last_complete_step{replica_id="b"}' not in text  # none yet: no sample
    m.set_checkpoints({})
    assert 'replica_id="a"' not in m.render().decode().split("rallypoint_checkpoint_")[-1]


# ----------------------------------------------------------------------------- live
def test_status_and_metrics_show_the_step_after_a_checkpoint_completes(lighthouse, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint import Manager, ProcessGroupGloo
    from rallypoint.checkpoint import DurableCheckpoint

    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "RALLYPOINT_TOKEN",
              "RALLYPOINT_CHECKPOINT_DIR"):
        monkeypatch.delenv(k, raising=False)
    lh = lighthouse(min_replicas=1, http_bind="127.0.0.1:0")
    t = timedelta(seconds=10)
    w = {"w": torch.arange(4.0)}
    m = Manager(ProcessGroupGloo(timeout=t), lambda sd: w.update(sd), lambda: dict(w), min_replica_size=1, rank=0,
                world_size=1, replica_id="ckgroup", lighthouse_addr=lh.address(), hostname="127.0.0.1",
                timeout=t, quorum_timeout=t, connect_timeout=t)
    try:
        ck = DurableCheckpoint(m, str(tmp_path / "ckpt"), every=3)
        http = lh.http_address()
        row: dict | None = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m.start_quorum()
            w["w"] += 1
            assert m.should_commit()
            ck.wait(10)
            rows = [r for r in httpx.get(f"{http}/status", timeout=5.0).json()["replicas"]
                    if r["replica_id"].startswith("ckgroup")]
            row = rows[0]["checkpoint"] if rows else None
            if row is not None and row["last_complete_step"] == 3:
                break
        assert row is not None and row["last_complete_step"] == 3, row
        assert row["writes"] >= 1 and row["bytes"] > 0 and row["failures"] == 0
        assert row["age_s"] is not None and 0 <= row["age_s"] < 60
        assert (tmp_path / "ckpt" / "step_00000003" / ".rallypoint-complete").exists()
        text = httpx.get(f"{http}/metrics", timeout=5.0).text
        series = [ln for ln in text.splitlines() if ln.startswith("rallypoint_checkpoint_last_complete_step{")]
        assert len(series) == 1 and 'replica_id="ckgroup' in series[0] and series[0].endswith(" 3.0"), text
        age = [ln for ln in text.splitlines() if ln.startswith("rallypoint_checkpoint_age_seconds{")]
        assert len(age) == 1 and math.isfinite(float(age[0].rsplit(" ", 1)[1])), age
        assert any(ln.startswith("rallypoint_checkpoint_bytes_total{") and not ln.endswith(" 0.0")
                   for ln in text.splitlines()), text
    finally:
        m.shutdown(wait=False)


def test_a_hostile_ckpt_is_ignored_and_the_quorum_still_served(lighthouse, client) -> None:
    from test_ledger import ask_concurrently, assert_one_quorum, report

    lh = lighthouse(min_replicas=2, http_bind="127.0.0.1:0")
    c = client(lh)
    ckpt: dict[str, Any] = {"good": {"step": 20, "age_s": 1.0, "writes": 1}, "evil": {"bytes": 10**30, "step": 99}}
    for step in range(3):
        answers = ask_concurrently(c, list(ckpt), timeout=10.0, kw_for=lambda rid: {
            "step": step, "data": report(step - 1, ckpt=ckpt[rid]) if step else ""})
        assert_one_quorum(answers, list(ckpt))  # served regardless
    rows = {r["replica_id"]: r for r in httpx.get(f"{lh.http_address()}/status", timeout=5.0).json()["replicas"]}
    assert rows["good"]["checkpoint"]["last_complete_step"] == 20
    assert rows["evil"]["checkpoint"] is None  # nothing of it kept
    assert rows["evil"]["step"] == 2
    text = httpx.get(f"{lh.http_address()}/metrics", timeout=5.0).text
    assert 'rallypoint_checkpoint_last_complete_step{replica_id="good"} 20.0' in text
    assert 'replica_id="evil"' not in "".join(ln for ln in text.splitlines() if ln.startswith("rallypoint_checkpoint"))
