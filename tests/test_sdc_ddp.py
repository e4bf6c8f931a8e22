"""The corruption checks under rallypoint's ``DistributedDataParallel``, as a user runs
them: real replica processes, the checks on, faults injected through the lighthouse.

With DDP the checks' rows ride in the last gradient bucket's own collective
(``Manager.allreduce_last``) instead of an exchange in ``should_commit``; what a user checks is
unchanged: a corrupt gradient fails that step on every group and names the group, a
flipped parameter is caught at the next parameter check and its group heals, and all end
bit-identical."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest



@pytest.fixture(autouse=True)
def _injection_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection is off by default; this drill turns it on for the lighthouse and
    the workers it starts (they inherit the environment)."""
    monkeypatch.setenv("RALLYPOINT_ALLOW_INJECT", "1")


def _inject(lh: Any, **request: Any) -> str:
    from rallypoint.lighthouse.client import LighthouseClient

    with LighthouseClient(lh.address()) as c:
        return c.inject(request)[1]


def _log_of(r: Any, name: str) -> str:
    return "".join(f.read_text() for f in sorted(r.tmp.glob(f"{name}.*.log")))


def _events(lh: Any, kind: str) -> list[dict[str, Any]]:
    addr = lh.http_address()
    http = addr if "://" in addr else f"http://{addr}"
    return [e for e in httpx.get(f"{http}/events", params={"limit": 1000}, timeout=10).json() if e["kind"] == kind]


def _failed_steps(r: Any, name: str) -> set[int]:
    prog = r.progress(name)
    return {s for s, _, c in prog["history"] if not c} if prog else set()


def test_ddp_checks_ride_in_the_gradients_and_catch_corruption(lighthouse: Any, ddp_replicas: Any) -> None:
    names = [f"replica_{i}" for i in range(3)]
    lh = lighthouse(min_replicas=2, join_timeout_ms=2000, http_bind="127.0.0.1:0")
    r = ddp_replicas(lh)
    for n in names:
        r.start(n, seed=1, delay=0.02, sdc=True, sdc_every=4)
    r.wait_for("three DDP replicas at step 3 together",
               lambda: min(r.step(n) for n in names) >= 3 and r.progress("replica_0")["history"][-1][1] == 3, 60)
    _inject(lh, kind="bitflip-grad", replica="replica_1")
    pattern = r"silent data corruption at step (\d+) \(gradient-norm check\): replica_1\S* \((?:inf|outlier)"
    r.wait_for("the flipped gradient caught", lambda: re.search(pattern, _log_of(r, "replica_0")), 30)
    step = int(re.search(pattern, _log_of(r, "replica_0")).group(1))  # type: ignore[union-attr]
    r.wait_for("every replica past it", lambda: min(r.step(n) for n in names) > step, 30)
    for n in names:  # nobody committed the corrupt gradient: that step failed on every group
        assert step in _failed_steps(r, n), (n, r.progress(n)["history"], r.logs())
    _inject(lh, kind="bitflip-param", replica="replica_2", bit=3)  # a low mantissa bit: silent
    r.wait_for("the flipped parameter caught",
               lambda: re.search(r"silent data corruption at step \d+ \(parameter check\): replica_2",
                                 _log_of(r, "replica_0")), 60)
    r.wait_for("replica_2 healed", lambda: "applied healed state" in
               _log_of(r, "replica_2").split("parameter check")[-1], 30)
    target = max(r.step(n) for n in names) + 2
    r.finish(target, timeout=60)
    r.assert_identical(names, target)
    for n in names:
        prog = r.progress(n)
        # should_commit never had to post the exchange itself: the rows rode in the last
        # bucket's collective (float32 CPU buckets: no collective of their own) in every
        # committed round but the first (rounds, not steps: a heal can skip steps; and
        # committed ones: a round whose process group failed exchanges nothing, nor commits).
        rode, rides, history = prog["rode"], prog["rides"], prog["history"]
        missed = [(h, r, d) for i, (h, r, d) in enumerate(zip(history, rode, rides))
                  if i > 0 and h[2] and (r, d) != (1, 1)]
        assert prog["late_exchanges"] == 0 and not missed and len(rode) == len(rides) == len(history), \
            (n, prog["late_exchanges"], missed, list(zip(history, rode, rides)))
        assert "raised" not in prog, prog
    sdc = [(e["detail"]["check"], e["replica_id"].split(":")[0]) for e in _events(lh, "sdc")]
    assert ("grad", "replica_1") in sdc and ("param", "replica_2") in sdc, sdc
