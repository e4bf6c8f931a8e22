"""The goodput ledger (rallypoint/lighthouse/ledger.py) and its lighthouse shell.

Why these: the ledger's promise is that every second of every group's wall time lands in
exactly one bucket (so "buckets add up to wall time x groups" holds by construction), that
each kind of round and event lands in the bucket the docs name, and that the figures survive
a lighthouse restart and reach /goodput, /metrics and ``rallypoint goodput``. The pure parts
are table tests with made-up times; one in-process lighthouse is fed real Quorum requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rallypoint.cli import format_goodput, main
from rallypoint.lighthouse import _ledger_store as store
from rallypoint.lighthouse import ledger as lg
from rallypoint.lighthouse import stragglers as sg
from rallypoint.lighthouse.http import create_app
from rallypoint.lighthouse.ledger import BUCKETS, UNREPORTED, Ledger, Series, group_of, modelled_goodput, round_parts
from rallypoint.lighthouse.metrics import LighthouseMetrics
from rallypoint.lighthouse.stragglers import StepStats

from conftest import ask_concurrently, assert_one_quorum

UUID = "0f8fad5b-d9cb-469f-a165-70867728950e"


def stats(outcome: str = "committed", step_s: float = 1.0, **kw: Any) -> StepStats:
    return StepStats(step=kw.pop("step", 1), outcome=outcome, compute_s=kw.pop("compute_s", 0.5), step_s=step_s, **kw)


def buckets_of(doc: dict, group: str) -> dict[str, float]:
    return next(g for g in doc["groups"] if g["group"] == group)["buckets"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus exposition -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def assert_adds_up(doc: dict) -> None:
    """Each group's buckets (unreported included) add up to its wall time, and so do the job's."""
    for g in doc["groups"]:
        assert sum(g["buckets"].values()) == pytest.approx(g["wall_s"], abs=0.01), g
        assert all(v >= 0 for v in g["buckets"].values()), g
    assert sum(doc["total"]["buckets"].values()) == pytest.approx(doc["total"]["wall_s"], abs=0.02)


# ------------------------------------------------------------------------------ pure parts
@pytest.mark.parametrize("rid, group", [
    ("a", "a"), (f"replica_1:{UUID}", "replica_1"), (f"job/g:0:{UUID}", "job/g:0"), ("host:1234", "host:1234"),
    (UUID, UUID), (f":{UUID}", f":{UUID}"),
])
def test_group_of(rid: str, group: str) -> None:
    assert group_of(rid) == group


@pytest.mark.parametrize("s, parts", [
    (stats(quorum_wait_s=0.2, configure_s=0.1, heal_s=0.05),
     {"reconfiguration": 0.1, "quorum_wait": 0.1, "healing": 0.05, "productive": 0.75}),
    # a configure overlapped with compute is lost only as far as the training thread waited
    (stats(quorum_wait_s=0.05, configure_s=0.3), {"reconfiguration": 0.05, "productive": 0.95}),
    # more lost than the round lasted (two threads' clocks): scaled down to the round
    (stats(step_s=1.0, quorum_wait_s=1.5, heal_s=0.5), {"quorum_wait": 0.75, "healing": 0.25}),
    (stats("failed", cause="comm"), {"failed:comm": 1.0}),
    (stats("failed", cause="peer_down"), {"detection": 1.0}),
    (stats("failed"), {"failed:unknown": 1.0}),
    (stats("failed", cause="cosmic"), {"failed:other": 1.0}),
    (stats("healing", heal_s=0.7), {"healing": 1.0}),
    (stats("spare"), {"spare": 1.0}),
    (stats(step_s=0.0), {}),
], ids=["committed", "configure-overlaps", "over-full", "failed", "peer-down", "no-cause", "odd-cause", "healing",
        "spare", "no-step"])
def test_round_parts(s: StepStats, parts: dict[str, float]) -> None:
    got = round_parts(s)
    assert got == pytest.approx(parts)
    assert sum(got.values()) == pytest.approx(s.step_s if parts else 0.0)


def test_step_stats_parser_accepts_cause_and_configure() -> None:
    raw = {"step": 3, "outcome": "failed", "compute_s": 0.1, "step_s": 2.0, "configure_s": 0.25, "cause": "vote"}
    s = sg.parse_step_stats(json.dumps({"step_stats": raw}))
    assert s is not None and (s.cause, s.configure_s) == ("vote", 0.25)
    assert sg.parse_step_stats(json.dumps({"step_stats": {**raw, "cause": "gremlins"}})).cause == "other"  # type: ignore[union-attr]
    assert sg.parse_step_stats(json.dumps({"step_stats": {**raw, "outcome": "committed"}})).cause is None  # type: ignore[union-attr]
    with pytest.raises(sg.BadStepStats, match="cause"):
        sg.parse_step_stats(json.dumps({"step_stats": {**raw, "cause": 7}}))
    with pytest.raises(sg.BadStepStats, match="configure_s"):
        sg.parse_step_stats(json.dumps({"step_stats": {**raw, "configure_s": -1}}))


# Scenarios: (events, now, {group: (wall_s, expected buckets)}). Events are
# (kind, replica id, time, argument); every group joins at 0 unless said otherwise.
C = stats(quorum_wait_s=0.1)  # 0.9 productive, 0.1 quorum wait
SCENARIOS: dict[str, tuple[list[tuple], float, dict[str, tuple[float, dict[str, float]]]]] = {
    "steady": (
        [("quorum", ["a", "b"], 0, None)] + [("round", g, t, C) for t in range(1, 11) for g in "ab"],
        10.0, {"a": (10.0, {"productive": 9.0, "quorum_wait": 1.0}), "b": (10.0, {"productive": 9.0, "quorum_wait": 1.0})},
    ),
    "round-in-progress-is-unreported": (
        [("round", "a", 1, C)], 3.5, {"a": (3.5, {"productive": 0.9, "quorum_wait": 0.1, UNREPORTED: 2.5})},
    ),
    "report-scaled-to-the-time-it-covers": (
        [("round", "a", 2, C)], 2.0, {"a": (2.0, {"productive": 1.8, "quorum_wait": 0.2})},
    ),
    "failed-healing-spare": (
        [("round", "a", 1, stats("failed", cause="comm")), ("round", "a", 2, stats("failed", cause="peer_down")),
         ("round", "a", 3, stats("healing")), ("round", "a", 4, stats("spare"))],
        4.0, {"a": (4.0, {"failed": 1.0, "detection": 1.0, "healing": 1.0, "spare": 1.0})},
    ),
    "death-and-rejoin": (
        [("quorum", ["a"], 0, None), ("round", "a", 1, C), ("down", "a", 1.5, False), ("join", f"a:{UUID}", 11.5, None),
         ("round", f"a:{UUID}", 12.5, stats("healing"))],
        13.0, {"a": (13.0, {"productive": 0.9, "quorum_wait": 0.1, "failed": 0.5, "down": 10.0, "healing": 1.0,
                            UNREPORTED: 0.5})},
    ),
    "still-down": (
        [("quorum", ["a"], 0, None), ("round", "a", 1, C), ("down", "a", 2, False)],
        7.0, {"a": (7.0, {"productive": 0.9, "quorum_wait": 0.1, "failed": 1.0, "down": 5.0})},
    ),
    "never-a-member-is-never-down": (
        [("round", "a", 1, C), ("down", "a", 2, False), ("join", "a", 9, None)],
        10.0, {"a": (3.0, {"productive": 0.9, "quorum_wait": 0.1, "failed": 1.0, UNREPORTED: 1.0})},
    ),
    "late-joiner-not-down-before-its-join": (
        [("quorum", ["a"], 0, None), ("join", "b", 6, None), ("round", "b", 7, C)],
        8.0, {"a": (8.0, {UNREPORTED: 8.0}), "b": (2.0, {"productive": 0.9, "quorum_wait": 0.1, UNREPORTED: 1.0})},
    ),
    "goodbye-then-rejoin": (
        [("quorum", ["a"], 0, None), ("round", "a", 1, C), ("down", "a", 1.5, True), ("join", "a", 4.5, None)],
        5.0, {"a": (5.0, {"productive": 1.35, "quorum_wait": 0.15, "down": 3.0, UNREPORTED: 0.5})},
    ),
    "goodbye-closes-the-window": (
        [("quorum", ["a"], 0, None), ("round", "a", 1, C), ("down", "a", 2, True)],
        50.0, {"a": (2.0, {"productive": 1.8, "quorum_wait": 0.2})},
    ),
    # Evicted at 1.5 with its round in progress; that round's report (at 2) covers 1.0-1.5
    # (the rest is excluded); the round after readmission (4) spans the wait: not counted twice.
    "eviction": (
        [("round", "a", 1, C), ("evicted", "a", 1.5, None), ("round", "a", 2, C), ("readmitted", "a", 4, None),
         ("round", "a", 5, stats(step_s=3.0, quorum_wait_s=2.5))],
        5.0, {"a": (5.0, {"productive": 1.9, "quorum_wait": 0.6, "excluded": 2.5})},
    ),
    "new-incarnation-replaces-a-silent-one": (
        [("quorum", [f"a:{UUID}"], 0, None), ("round", f"a:{UUID}", 1, C),
         ("join", "a:11111111-2222-3333-4444-555555555555", 3, None), ("down", f"a:{UUID}", 4, False)],
        4.0, {"a": (4.0, {"productive": 0.9, "quorum_wait": 0.1, "failed": 2.0, UNREPORTED: 1.0})},
    ),
}


def play(events: list[tuple], ledger: Ledger | None = None) -> Ledger:
    led = ledger or Ledger()
    joined: set[str] = set()
    for kind, who, t, arg in events:
        for rid in (who if isinstance(who, list) else [who]):
            if lg.group_of(rid) not in joined:
                joined.add(lg.group_of(rid))
                led.join(rid, 0.0 if kind != "join" else float(t))
        if kind == "quorum":
            led.quorum(who, float(t))
        elif kind == "round":
            led.round(who, arg, float(t))
        elif kind == "down":
            led.down(who, float(t), clean=arg)
        else:
            getattr(led, kind)(who, float(t))
    return led


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bucket_accounting(name: str) -> None:
    events, now, expected = SCENARIOS[name]
    doc = play(events).document(now)
    assert_adds_up(doc)
    for group, (wall, want) in expected.items():
        row = next(g for g in doc["groups"] if g["group"] == group)
        assert row["wall_s"] == pytest.approx(wall), row
        got = {k: v for k, v in row["buckets"].items() if v}
        assert got == pytest.approx({k: v for k, v in want.items() if v}, abs=1e-3), row
    assert doc["total"]["wall_s"] == pytest.approx(sum(w for w, _ in expected.values()))


def test_death_details_and_goodput() -> None:
    doc = play(SCENARIOS["death-and-rejoin"][0]).document(13.0)
    a = doc["groups"][0]
    assert a["failed_by_cause"] == {"died": 0.5} and a["failures"] == 1 and a["state"] == "alive"
    assert a["replica_id"] == f"a:{UUID}"
    settled = sum(a["buckets"][b] for b in BUCKETS)
    assert doc["goodput"] == pytest.approx(0.9 / settled, abs=1e-4)  # unreported time is not in the denominator


def test_down_time_stops_at_retirement() -> None:
    led = play([("quorum", ["a"], 0, None), ("down", "a", 1, False)], Ledger(retire_s=100.0))
    doc = led.document(1000.0)
    assert buckets_of(doc, "a")["down"] == pytest.approx(100.0)
    assert doc["groups"][0]["wall_s"] == pytest.approx(101.0)


@pytest.mark.parametrize("seed", range(40))
def test_random_histories_add_up(seed: int) -> None:
    """Whatever arrives in whatever order (late, duplicate, from dead incarnations), every
    group's buckets add up to its wall time and none is negative."""
    rng = random.Random(seed)
    led, t = Ledger(retire_s=rng.choice([5.0, 1800.0])), 0.0
    rids = [f"g{i}:{UUID[:-1]}{j}" for i in range(3) for j in range(3)]
    for _ in range(150):
        t += rng.choice([0.0, 0.1, 0.7, 3.0])
        rid, kind = rng.choice(rids), rng.choice(["join", "round", "round", "round", "down", "evicted", "readmitted",
                                                 "quorum", "reconcile"])
        if kind == "round":
            outcome = rng.choice(lg.OUTCOMES)
            led.round(rid, stats(outcome, step_s=rng.uniform(0, 3), quorum_wait_s=rng.uniform(0, 2),
                                 configure_s=rng.uniform(0, 1), heal_s=rng.uniform(0, 1),
                                 cause=rng.choice([None, "comm", "peer_down"]) if outcome == "failed" else None), t)
        elif kind == "down":
            led.down(rid, t, clean=rng.random() < 0.3)
        elif kind == "quorum":
            led.quorum(rng.sample(rids, 3), t)
        elif kind == "reconcile":
            led.reconcile(set(rng.sample(rids, 5)), t)
        else:
            getattr(led, kind)(rid, t)
        if rng.random() < 0.1:
            assert_adds_up(led.document(t, series=False))
    doc = led.document(t + 1.0)
    assert_adds_up(doc)
    assert sum(sum(c) for c in doc["series"]["buckets"].values()) == pytest.approx(
        sum(v for k, v in doc["total"]["buckets"].items()) - doc["total"]["buckets"][UNREPORTED]
        + sum(doc["series"]["buckets"][UNREPORTED]), abs=0.05)


def test_groups_are_bounded_and_folded_into_retired() -> None:
    led = Ledger(max_groups=3)
    for i in range(6):
        led.join(f"g{i}", float(i))
        led.round(f"g{i}", C, i + 1.0)
        led.down(f"g{i}", i + 1.0, clean=True)
    led.join("alive", 10.0)
    doc = led.document(12.0)
    assert len(doc["groups"]) <= 3
    assert doc["total"]["retired"]["wall_s"] > 0
    assert_adds_up(doc)
    assert doc["total"]["buckets"]["productive"] == pytest.approx(6 * 0.9, abs=1e-3)  # nothing lost by folding
    short = led.document(12.0, listed=1)  # what /status lists: open groups first
    assert [g["group"] for g in short["groups"]] == ["alive"] and short["total"] == {**doc["total"], "listed": 1}
    assert "(2 more group(s) not listed" in format_goodput(short)


# ------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("mtbf, detect, restart, load, tau, delta, want", [
    (math.inf, 5, 60, 30, 1.0, 0.0, 1.0),  # no failure: nothing lost
    (math.inf, 0, 0, 0, 1800.0, 30.0, 1 / (1 + 30 / 1800)),  # only the checkpoint cost
    (3600.0, 10, 60, 30, 2.0, 0.0, 1 - 101 / 3600),
    (10800.0, 60, 300, 120, 1800.0, 30.0, (1 - (60 + 300 + 120 + 900) / 10800) / (1 + 30 / 1800)),
    (100.0, 50, 100, 0, 1.0, 0.0, 0.0),  # more lost than there is: clamped
])
def test_modelled_goodput(mtbf: float, detect: float, restart: float, load: float, tau: float, delta: float,
                          want: float) -> None:
    assert modelled_goodput(mtbf, detect, restart, load, tau, delta) == pytest.approx(want)


def test_model_rejects_nonsense() -> None:
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tau"):
            modelled_goodput(100.0, 0, 0, 0, bad, 0.0)


def test_model_report_uses_measured_parameters() -> None:
    buckets = {"productive": 900.0, "detection": 2.0, "down": 60.0, "healing": 8.0, "quorum_wait": 30.0}
    rep = lg.model_report(buckets, failures=2, committed_rounds=900, committed_step_s=900.0)
    p = rep["parameters"]
    assert (p["mtbf_s"], p["t_detect_s"], p["t_restart_s"], p["t_load_s"], p["tau_s"], p["delta_s"]) == \
        (500.0, 1.0, 30.0, 4.0, 1.0, 0.0)
    assert rep["goodput"] == pytest.approx(1 - 35.5 / 500, abs=1e-4)
    assert rep["what_if"]["restart_halved"] == pytest.approx(1 - 20.5 / 500, abs=1e-4)
    assert rep["what_if"]["restart_halved"] > rep["goodput"] > rep["what_if"]["tau_doubled"]
    ckpt = lg.model_report(buckets, 2, 900, 900.0, tau_s=1800.0, delta_s=30.0)
    assert ckpt["parameters"]["tau_source"] == "given" and ckpt["goodput"] < rep["goodput"]
    none = lg.model_report({"quorum_wait": 5.0}, 0, 0, 0.0)
    assert none["goodput"] is None and none["parameters"]["mtbf_s"] is None


# ------------------------------------------------------------------------------ the series
def test_series_ring_is_bounded_and_spreads_intervals() -> None:
    s = Series(bin_s=10.0, max_bins=6)
    s.add(0.0, 30.0, {"down": 30.0})  # three bins, 10 s each
    assert {i: b["down"] for i, b in s.bins.items()} == pytest.approx({0: 10.0, 1: 10.0, 2: 10.0})
    s.add(35.0, 35.0, {"productive": 2.0, "failed:comm": 1.0})
    assert s.bins[3] == pytest.approx({"productive": 2.0, "failed": 1.0})
    for t in range(40, 2000, 5):
        s.add(t - 5.0, float(t), {"productive": 5.0})
    assert len(s.bins) == 6 and min(s.bins) == 199 - 5
    s.add(0.0, 5.0, {"down": 5.0})  # older than the ring: dropped
    assert len(s.bins) == 6
    doc = s.document()
    assert len(doc["t"]) == len(doc["goodput"]) == 6 and doc["goodput"][-1] == 1.0
    assert set(doc["buckets"]) == {*BUCKETS, UNREPORTED}


def test_ledger_series_is_bounded() -> None:
    led = Ledger(bin_s=1.0, series_bins=20)
    led.join("a", 0.0)
    for t in range(1, 500):
        led.round("a", C, float(t))
    assert 19 <= len(led.document(500.0)["series"]["t"]) <= 20


# ------------------------------------------------------------------------------ persistence
def test_state_round_trip() -> None:
    led = play(SCENARIOS["eviction"][0] + [("quorum", ["a"], 5, None), ("evicted", "a", 6, None)])
    text = json.dumps(store.to_state(led))
    again = store.from_state(json.loads(text))
    assert again.document(9.0) == led.document(9.0)
    for bad in ({}, {"version": 2}, {**json.loads(text), "groups": "x"},
                {**json.loads(text), "groups": [{"name": "a"}]}, {**json.loads(text), "retired": None}):
        with pytest.raises(ValueError):
            store.from_state(bad)


# ------------------------------------------------------------------------------ the lighthouse
def report(step: int, outcome: str = "committed", **kw: Any) -> str:
    s = {"step": step, "round": step, "outcome": outcome, "compute_s": 0.5, "step_s": 1.0, "quorum_wait_s": 0.2,
         "configure_s": 0.1, "heal_s": 0.0, "comm_s": 0.1, "commit_s": 0.01, **kw}
    return json.dumps({"step_stats": s})


def run_rounds(c: Any, ids: list[str], rounds: range) -> None:
    for step in rounds:
        answers = ask_concurrently(c, ids, timeout=10.0,
                                   kw_for=lambda rid: {"step": step, "data": report(step - 1) if step else ""})
        assert_one_quorum(answers, ids)


def test_live_lighthouse_goodput_metrics_and_cli(lighthouse, client, capsys) -> None:
    lh = lighthouse(min_replicas=2, http_bind="127.0.0.1:0")
    run_rounds(client(lh), ["a", "b"], range(6))
    http = lh.http_address()
    doc = httpx.get(f"{http}/goodput", timeout=5.0).json()
    assert [g["group"] for g in doc["groups"]] == ["a", "b"]
    assert doc["total"]["rounds"] == {"committed": 10}
    # Each report says 0.8 productive, 0.1 reconfiguration (configure inside the quorum wait),
    # 0.1 quorum wait, however long the lighthouse saw the rounds take.
    assert doc["goodput"] == pytest.approx(0.8, abs=2e-3)
    b = doc["total"]["buckets"]
    assert b["reconfiguration"] == pytest.approx(b["quorum_wait"], rel=0.02)
    assert_adds_up(doc)
    assert doc["model"]["parameters"]["tau_s"] == 1.0 and doc["model"]["goodput"] == 1.0
    assert len(doc["series"]["t"]) >= 1
    assert httpx.get(f"{http}/goodput", params={"tau": 1800, "delta": 30, "series": "false"},
                     timeout=5.0).json()["model"]["parameters"]["tau_s"] == 1800.0
    assert httpx.get(f"{http}/goodput", params={"tau": 0}, timeout=5.0).status_code == 422

    metrics = httpx.get(f"{http}/metrics", timeout=5.0).text
    got = samples(metrics)
    assert got[("rallypoint_goodput_ratio", ())] == pytest.approx(0.8, abs=2e-3)
    assert got[("rallypoint_goodput_seconds_total", (("bucket", "productive"), ("replica_id", "a")))] > 0
    assert "# TYPE rallypoint_goodput_seconds_total counter" in metrics or \
        "# TYPE rallypoint_goodput_seconds counter" in metrics

    assert main(["goodput", "--lighthouse", lh.local_address()]) == 0
    out = capsys.readouterr().out
    assert out.startswith("goodput 0.80") and "PRODUCTIVE" in out and "\na " in out and "\nTOTAL" in out
    assert main(["goodput", "--lighthouse", lh.local_address(), "--json", "--tau", "1800", "--delta", "30"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"]["parameters"]["tau_s"] == 1800.0 and "series" not in printed
    assert printed["model"]["goodput"] == pytest.approx(1 / (1 + 30 / 1800), abs=1e-4)


def test_ledger_survives_a_restart(lighthouse, client, tmp_path) -> None:
    state = str(tmp_path / "lh.db")
    first = lighthouse(min_replicas=2, state=state)
    run_rounds(client(first), ["a", "b"], range(4))
    before = first.status()["goodput"]
    first.shutdown()
    second = lighthouse(min_replicas=2, state=state, http_bind="127.0.0.1:0")
    after = httpx.get(f"{second.http_address()}/goodput", timeout=5.0).json()
    assert [g["group"] for g in after["groups"]] == ["a", "b"]
    assert after["total"]["rounds"] == before["total"]["rounds"] == {"committed": 6}
    assert after["total"]["buckets"]["productive"] == pytest.approx(before["total"]["buckets"]["productive"], abs=1e-3)
    assert after["total"]["wall_s"] >= before["total"]["wall_s"]
    assert_adds_up(after)


class _View:
    """The least a view needs for /goodput: a ``goodput`` callable (or nothing)."""

    def __init__(self, led: Ledger | None) -> None:
        self.metrics_obj = LighthouseMetrics()
        if led is not None:
            self.goodput = lambda **kw: led.document(10.0, **kw)

    def status(self) -> dict:
        return {}

    def metrics(self) -> bytes:
        return self.metrics_obj.render()


def _get(view: Any, url: str, token: str | None = None, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(view, token=token))
        async with httpx.AsyncClient(transport=transport, base_url="http://lh", timeout=5.0) as c:
            return await c.get(url, **kw)

    return asyncio.run(asyncio.wait_for(go(), 10.0))


def test_goodput_route_token_rule_and_absent_ledger() -> None:
    view = _View(play(SCENARIOS["steady"][0]))
    assert _get(view, "/goodput", token="s3cret").status_code == 401
    r = _get(view, "/goodput", token="s3cret", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["goodput"] == pytest.approx(0.9)
    assert _get(_View(None), "/goodput").status_code == 404


def test_format_goodput_and_metrics_from_a_document() -> None:
    doc = play(SCENARIOS["death-and-rejoin"][0] + [("join", "b", 0, None)]).document(13.0)
    text = format_goodput(doc)
    assert "failed rounds by cause: died 0.5s" in text and "T_restart 10.0s" in text
    m = LighthouseMetrics()
    m.set_goodput(doc)
    got = samples(m.render().decode())
    assert got[("rallypoint_goodput_seconds_total", (("bucket", "down"), ("replica_id", "a")))] == 10.0
    assert got[("rallypoint_goodput_failed_seconds_total", (("cause", "died"), ("replica_id", "a")))] == 0.5
    # the in-progress part of "unreported" is left out (a counter never goes down)
    assert got[("rallypoint_goodput_seconds_total", (("bucket", "unreported"), ("replica_id", "b")))] == 0.0
