"""Fault injection (``rallypoint inject``): the request checks (tables), the manager-side
faults on plain tensors, the lighthouse's authenticated API (CLI and HTTP), and real
replica groups carrying out ``kill`` and ``slow`` (a straggler scored and evicted), and a
lighthouse restarting itself."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rallypoint._net.inject import Injection, check_injection, encode_injections, parse_injections
from rallypoint.lighthouse.injections import InjectionDesk, UnknownReplica, check_request, resolve
from rallypoint.manager._inject import Injector, first_float_tensor, first_nonzero, flip_bit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _injection_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection is off unless turned on: these tests turn it on for their lighthouses
    (``RALLYPOINT_ALLOW_INJECT`` is what ``LighthouseServer`` reads by default) and for the
    replica processes they start (which inherit the environment)."""
    monkeypatch.setenv("RALLYPOINT_ALLOW_INJECT", "1")


# ------------------------------------------------------------------ requests (pure)
@pytest.mark.parametrize("body, error", [
    (b'{"kind": "meteor", "replica": "a"}', "unknown injection kind 'meteor'"),
    (b'{"kind": "slow"}', "needs the replica"),
    (b'{"kind": "slow", "replica": "a", "factor": 0.5}', "factor must be a number in 1..1000"),
    (b'{"kind": "hang", "replica": "a", "for_s": -1}', "for_s must be a number"),
    (b'{"kind": "kill", "replica": "a", "at_step": "3"}', "at_step must be an integer"),
    (b'{"kind": "bitflip-grad", "replica": "a", "bit": 64}', "bit must be an integer in 0..63"),
    (b'{"kind": "kill", "replica": "a", "sudo": true}', "unknown injection field"),
    (b'[1, 2]', "must be a JSON object"),
    (b'not json', "must be JSON"),
    (b'{"kind": "kill", "replica": "' + b"a" * 3000 + b'"}', "the limit is 2048"),
])
def test_bad_requests_are_refused_with_the_reason(body: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        check_request(body)


def test_good_requests_get_an_id_and_the_lighthouse_kind_needs_no_replica() -> None:
    name, inj = check_request(b'{"kind": "slow", "replica": "replica_1", "factor": 3, "for_s": 5, "at_step": 7}')
    assert name == "replica_1" and inj.kind == "slow" and inj.factor == 3.0 and inj.for_s == 5.0 and inj.at_step == 7
    assert re.fullmatch(r"[0-9a-f]{8}", inj.id)
    assert check_request(b'{"kind": "lighthouse-restart"}')[0] == ""


@pytest.mark.parametrize("name, known, want, error", [
    ("replica_1:ab12", {"replica_1:ab12", "replica_2:cd34"}, "replica_1:ab12", None),
    ("replica_1", {"replica_1:ab12", "replica_2:cd34"}, "replica_1:ab12", None),
    ("replica_1", {"replica_1"}, "replica_1", None),
    ("replica", {"replica_1:ab12", "replica_2:cd34"}, None, "unknown replica 'replica'"),
    ("r", {"r:1", "r:2"}, None, "matches 2 replicas"),
    ("ghost", set(), None, "known replicas: none"),
])
def test_resolve_names_one_replica_or_says_which_exist(name: str, known: set[str], want: str | None,
                                                       error: str | None) -> None:
    if error is None:
        assert resolve(name, known) == want
    else:
        with pytest.raises(UnknownReplica, match=re.escape(error)):
            resolve(name, known)


def test_wire_round_trip_and_limits() -> None:
    injs = [Injection("a1", "nan-grad", at_step=3), Injection("b2", "slow", for_s=2.5, factor=4.0)]
    assert parse_injections(encode_injections(injs)) == injs
    for raw, error in [(b"{}", "JSON list"), (b"[" + b'{"kind":"kill"},' * 9 + b'{"kind":"kill"}]', "at most 8"),
                       (b"x" * 5000, "the limit is 4096"), (b"\xff", "not JSON")]:
        with pytest.raises(ValueError, match=re.escape(error)):
            parse_injections(raw)
    desk = InjectionDesk()
    for i in range(8):
        desk.add("r", check_injection({"id": str(i), "kind": "kill"}))
    with pytest.raises(ValueError, match="already has 8 injections"):
        desk.add("r", check_injection({"id": "9", "kind": "kill"}))
    assert len(desk.take("r")) == 8 and desk.take("r") == []


# ------------------------------------------------------------------ manager-side faults
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_flip_bit_changes_exactly_one_bit(dtype: torch.dtype) -> None:
    t = torch.full((4,), 0.01, dtype=dtype)
    before = t.clone()
    bits = t.element_size() * 8
    flip_bit(t, bits - 2)  # the top exponent bit
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
    diff = (t.view(ints) ^ before.view(ints))[0].item()
    assert bin(diff & ((1 << bits) - 1)).count("1") == 1 and torch.equal(t[1:], before[1:])
    assert abs(t[0].item()) > 1e3 * abs(before[0].item())


def test_a_gradient_bitflip_strikes_a_nonzero_element_so_a_check_can_see_it() -> None:
    # A ReLU's dead units have exactly zero gradient; a flipped bit of a zero is at most 2.0.
    g = torch.tensor([0.0, 0.0, 0.01, 0.02])
    inj = Injector("r", lambda: {}, threading.Event(), allowed=True)
    inj.add([Injection("1", "bitflip-grad", bit=30)])
    inj.at_step_start(0, None)
    assert inj.on_collective(g) is None
    assert g[0] == 0 and g[1] == 0 and g[2].abs() > 1e30 and g[3] == torch.tensor(0.02)
    assert first_nonzero(torch.zeros(3)) == 0 and first_nonzero(torch.zeros(0)) == 0
    assert first_nonzero(torch.tensor([[0.0, 0.0], [0.0, -1.0]])) == 3


def test_injector_arms_one_gradient_fault_per_round_and_honours_at_step() -> None:
    closing = threading.Event()
    model = torch.nn.Linear(3, 2)
    inj = Injector("r", lambda: {"model": model.state_dict()}, closing, allowed=True)
    inj.add([Injection("1", "nan-grad", at_step=5), Injection("2", "bitflip-param")])
    w0 = model.weight.detach().clone()
    assert inj.at_step_start(4, None) == {"injected": ["bitflip-param"]}  # nan-grad waits for step 5
    assert not torch.equal(model.weight.detach(), w0)
    g = torch.ones(4)
    assert inj.on_collective(g) is None and torch.equal(g, torch.ones(4))
    assert inj.at_step_start(5, None) == {"injected": ["nan-grad"]}
    assert inj.on_collective(g) is None and torch.isnan(g[0]) and torch.equal(g[1:], torch.ones(3))
    g2 = torch.ones(4)
    assert inj.on_collective(g2) is None and torch.equal(g2, torch.ones(4))  # once per round
    inj.add([Injection("1", "nan-grad")])  # an id seen before is ignored
    inj.add([Injection("3", "drop-collective")])
    inj.at_step_start(6, None)
    assert inj.on_collective(torch.ones(2)) == "drop"
    assert first_float_tensor({"a": torch.zeros(0), "b": [torch.ones(2, dtype=torch.int64), model.bias]}) is model.bias


def test_injected_slowness_stretches_by_the_factor_and_ends() -> None:
    now = [100.0]
    inj = Injector("r", dict, threading.Event(), clock=lambda: now[0], allowed=True)
    inj.add([Injection("s", "slow", factor=3.0, for_s=5.0)])
    done = inj.at_step_start(1, base_compute_s=0.01)
    assert done["injected"] == ["slow"] and done["injected_sleep_s"] == pytest.approx(0.02)
    now[0] = 104.9
    assert inj.at_step_start(2, 0.5)["injected_sleep_s"] == pytest.approx(0.02)  # the base is kept
    now[0] = 105.0
    assert "injected_sleep_s" not in inj.at_step_start(3, 0.01)  # over after for_s


# ------------------------------------------------------------------ the lighthouse's API
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def test_inject_needs_the_token_and_names_unknown_replicas(lighthouse) -> None:
    from rallypoint.lighthouse.client import LighthouseClient

    lh = lighthouse(token="s3cret", http_bind="127.0.0.1:0")
    with LighthouseClient(lh.address(), token="s3cret") as c:
        c.heartbeat("replica_1:ab12")
    no_token = {k: v for k, v in os.environ.items() if k != "RALLYPOINT_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "rallypoint", "inject", "kill", "--replica", "replica_1",
                        "--lighthouse", lh.address()], capture_output=True, text=True, timeout=60, env=no_token, cwd=ROOT)
    assert r.returncode == 1 and "token" in r.stderr.lower(), r.stderr
    http = f"http://{lh.http_address()}" if "://" not in str(lh.http_address()) else lh.http_address()
    refused = httpx.post(f"{http}/inject", json={"kind": "kill", "replica": "replica_1"}, timeout=10)
    assert refused.status_code == 401
    events = httpx.get(f"{http}/events", headers={"Authorization": "Bearer s3cret"}, timeout=10).json()
    assert not [e for e in events if e["kind"] == "inject"], events  # the refused calls changed nothing

    r = _cli("inject", "slow", "--replica", "ghost", "--lighthouse", lh.address(), env={"RALLYPOINT_TOKEN": "s3cret"})
    assert r.returncode == 1 and "unknown replica 'ghost'" in r.stderr and "replica_1:ab12" in r.stderr, r.stderr
    r = _cli("inject", "slow", "--replica", "replica_1", "--factor", "3", "--for", "30",
             "--lighthouse", lh.address(), env={"RALLYPOINT_TOKEN": "s3cret"})
    assert r.returncode == 0 and "slow into replica replica_1:ab12" in r.stdout, (r.stdout, r.stderr)
    ok = httpx.post(f"{http}/inject", json={"kind": "nan-grad", "replica": "replica_1", "at_step": 9},
                    headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["replica_id"] == "replica_1:ab12", ok.text
    bad = httpx.post(f"{http}/inject", json={"kind": "nan-grad"}, headers={"Authorization": "Bearer s3cret"},
                     timeout=10)
    assert bad.status_code == 422 and "needs the replica" in bad.text
    huge = httpx.post(f"{http}/inject", content=b"x" * (8 << 20), headers={"Authorization": "Bearer s3cret"},
                      timeout=30)
    assert huge.status_code == 413, huge.text  # refused while reading: never buffered whole
    streamed = httpx.post(f"{http}/inject", content=iter([b"{" * 4096] * 64), headers={"Authorization": "Bearer s3cret"},
                          timeout=30)
    assert streamed.status_code == 413, streamed.text  # no Content-Length: refused once over the limit
    restart = httpx.post(f"{http}/inject", json={"kind": "lighthouse-restart"},
                         headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert restart.status_code == 409 and "cannot restart itself" in restart.text  # embedded: refused
    events = httpx.get(f"{http}/events", headers={"Authorization": "Bearer s3cret"}, timeout=10).json()
    injected = [(e["replica_id"], e["detail"]["injected"]) for e in events if e["kind"] == "inject"]
    assert injected == [("replica_1:ab12", "slow"), ("replica_1:ab12", "nan-grad")], events


# ------------------------------------------------------------------ real replica groups
def _events(lh: Any, kind: str) -> list[dict[str, Any]]:
    addr = lh.http_address()
    http = addr if "://" in addr else f"http://{addr}"
    return [e for e in httpx.get(f"{http}/events", params={"limit": 1000}, timeout=10).json() if e["kind"] == kind]


def _inject(lh: Any, **request: Any) -> str:
    from rallypoint.lighthouse.client import LighthouseClient

    with LighthouseClient(lh.address()) as c:
        return c.inject(request)[1]


def test_kill_injection_ends_the_replica_and_the_survivor_goes_on(lighthouse, replicas_factory) -> None:
    lh = lighthouse(min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000)
    r = replicas_factory(lh)
    r.start("replica_0", seed=1, delay=0.05)
    victim = r.start("replica_1", seed=1, delay=0.05)
    r.wait_for("both at step 2", lambda: min(r.step("replica_0"), r.step("replica_1")) >= 2, 30)
    assert _inject(lh, kind="kill", replica="replica_1").startswith("replica_1")
    assert r.wait_dead(victim, 30) == -signal.SIGKILL
    at = r.step("replica_0")
    r.wait_for("the survivor commits alone", lambda: any(p == 1 and s > at for s, p, _ in
                                                         r.progress("replica_0")["history"]), 30)
    assert "carrying out injection" in "".join(f.read_text() for f in r.tmp.glob("replica_1.*.log"))


def test_slow_injection_is_scored_a_straggler_evicted_and_readmitted_healed(lighthouse, replicas_factory) -> None:
    """A group made 3x slower is flagged within 10 steps of the slowdown (never on one
    step), left out of the quorum while the others go on, readmitted after the cool-down,
    healed, and in the end all three hold the same model."""
    from rallypoint.lighthouse.stragglers import Policy

    lh = lighthouse(min_replicas=2, join_timeout_ms=2000, http_bind="127.0.0.1:0",
                    stragglers=Policy(mode="evict", cooldown_s=1.0))
    r = replicas_factory(lh)
    for i in range(3):
        r.start(f"replica_{i}", seed=1, delay=0.05)
    r.wait_for("three replicas at step 3 together",
               lambda: min(r.step(f"replica_{i}") for i in range(3)) >= 3
               and r.progress("replica_0")["history"][-1][1] == 3, 60)
    assert not _events(lh, "straggler")  # equal groups: nobody flagged
    _inject(lh, kind="slow", replica="replica_2", factor=4.0, for_s=4.0)
    r.wait_for("replica_2 evicted", lambda: _events(lh, "evicted"), 60)
    log2 = "".join(f.read_text() for f in r.tmp.glob("replica_2.*.log"))
    slow_from = int(re.search(r"carrying out injection \w+ \(slow\) at step (\d+)", log2).group(1))
    flagged = _events(lh, "straggler")
    assert flagged and all(e["replica_id"].startswith("replica_2") for e in flagged + _events(lh, "evicted"))
    assert flagged[0]["detail"]["step"] - slow_from <= 10, (flagged[0], slow_from)
    at = r.step("replica_0")
    r.wait_for("the others commit without it",
               lambda: any(p == 2 and s > at for s, p, _ in r.progress("replica_0")["history"]), 30)
    r.wait_for("replica_2 readmitted", lambda: _events(lh, "readmitted"), 30)
    r.wait_for("its slowness over", lambda: "injected slowness over" in
               "".join(f.read_text() for f in r.tmp.glob("replica_2.*.log")), 30)
    at = r.step("replica_0")
    # Eight full-quorum steps after its slowness: its straggler window then holds only fast
    # steps (a last slow vote, reported a round late, may still evict it once more first).
    r.wait_for("replica_2 back in full quorums after its slowness",
               lambda: sum(p == 3 and s > at for s, p, _ in r.progress("replica_2")["history"]) >= 8, 60)
    target = max(r.step(f"replica_{i}") for i in range(3)) + 3
    r.finish(target, timeout=60)
    r.assert_identical([f"replica_{i}" for i in range(3)], target)


def test_lighthouse_restart_injection_restarts_in_place_with_its_state(tmp_path: Path) -> None:
    """`rallypoint inject lighthouse-restart` against a `rallypoint lighthouse`: the same
    process comes back on the same port with the same quorum id."""
    from rallypoint.lighthouse.client import LighthouseClient

    state = tmp_path / "lh.db"
    proc = subprocess.Popen([sys.executable, "-m", "rallypoint", "lighthouse", "--min-replicas", "1",
                             "--bind", "127.0.0.1:0", "--http-bind", "off", "--join-timeout-ms", "100",
                             "--state", str(state), "--allow-inject"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    try:
        first = json.loads(lines.get(timeout=30))
        with LighthouseClient(first["lighthouse"]) as c:
            q1 = c.quorum("solo", timeout=10, step=1).quorum_id
        r = _cli("inject", "lighthouse-restart", "--lighthouse", first["lighthouse"])
        assert r.returncode == 0 and "lighthouse-restart into the lighthouse" in r.stdout, r.stderr
        again = json.loads(lines.get(timeout=30))  # the restarted lighthouse's line (same pid)
        assert proc.poll() is None and again["lighthouse"] == first["lighthouse"]
        with LighthouseClient(again["lighthouse"]) as c:
            assert c.quorum("solo", timeout=10, step=2).quorum_id == q1  # state survived
    finally:
        proc.kill()
        proc.wait(10)


def _log_of(r: Any, name: str) -> str:
    return "".join(f.read_text() for f in sorted(r.tmp.glob(f"{name}.*.log")))


def test_corrupt_gradients_fail_the_step_everywhere_and_a_flipped_parameter_heals(lighthouse, replicas_factory) -> None:
    """With the corruption checks on: a NaN and a bit-flipped gradient on one group are
    caught at that step, nothing is committed anywhere, and the group is named; a silently
    flipped parameter is caught at the next parameter check, its group heals from the
    majority, and all three end bit-identical. The lighthouse's event log names each."""
    lh = lighthouse(min_replicas=2, join_timeout_ms=2000, http_bind="127.0.0.1:0")
    r = replicas_factory(lh)
    for i in range(3):
        r.start(f"replica_{i}", seed=1, delay=0.02, sdc=True, sdc_every=4)
    r.wait_for("three replicas at step 3 together",
               lambda: min(r.step(f"replica_{i}") for i in range(3)) >= 3
               and r.progress("replica_0")["history"][-1][1] == 3, 60)
    for kind, mark in (("nan-grad", "nan"), ("bitflip-grad", "(?:inf|outlier)")):
        _inject(lh, kind=kind, replica="replica_1")
        pattern = rf"silent data corruption at step (\d+) \(gradient-norm check\): replica_1\S* \({mark}"
        r.wait_for(f"{kind} caught", lambda: re.search(pattern, _log_of(r, "replica_0")), 30)
        step = int(re.search(pattern, _log_of(r, "replica_0")).group(1))
        # Every group failed that step: nobody committed the corrupt gradient.
        r.wait_for("every replica past it", lambda: min(r.step(f"replica_{i}") for i in range(3)) > step, 30)
        for i in range(3):
            assert step in r.progress(f"replica_{i}")["failed"], (kind, i, r.progress(f"replica_{i}"))
    _inject(lh, kind="bitflip-param", replica="replica_2", bit=3)  # a low mantissa bit: silent
    pattern = r"silent data corruption at step \d+ \(parameter check\): replica_2"
    r.wait_for("the flipped parameter caught", lambda: re.search(pattern, _log_of(r, "replica_0")), 60)
    r.wait_for("replica_2 healed", lambda: "applied healed state" in
               _log_of(r, "replica_2").split("parameter check")[-1], 30)
    target = max(r.step(f"replica_{i}") for i in range(3)) + 2
    r.finish(target, timeout=60)
    r.assert_identical([f"replica_{i}" for i in range(3)], target)
    sdc = [(e["detail"]["check"], e["replica_id"].split(":")[0]) for e in _events(lh, "sdc")]
    assert ("grad", "replica_1") in sdc and ("param", "replica_2") in sdc, sdc


def test_deeply_nested_requests_are_refused_not_crashes() -> None:
    deep = b"[" * 3000 + b"]" * 3000
    with pytest.raises(ValueError, match="not JSON"):
        parse_injections(deep[:4000])
    with pytest.raises(ValueError, match="must be JSON"):
        check_request(b"[" * 1000 + b"]" * 1000)


@pytest.mark.parametrize("argv, bound, want", [
    (["--bind", "[::]:29510", "--http_bind=127.0.0.1:0"], ("[::1]:29510", "http://127.0.0.1:40001"),
     ["--bind", "[::]:29510", "--http_bind=127.0.0.1:40001"]),
    (["--bind=127.0.0.1:0", "--http-bind", "off"], ("127.0.0.1:5555", None), ["--bind=127.0.0.1:5555", "--http-bind", "off"]),
    (["--min-replicas", "1"], ("0.0.0.0:29510", "127.0.0.1:29511"),
     ["--min-replicas", "1", "--bind", "[::]:29510", "--http-bind", "[::]:29511"]),
])
def test_a_restarting_lighthouse_keeps_its_hosts_and_pins_its_ports(argv: list[str], bound: tuple, want: list[str]) -> None:
    from rallypoint.cli import pin_ports

    assert pin_ports(argv, {"--bind": (bound[0], "[::]"), "--http-bind": (bound[1], "[::]")}) == want
