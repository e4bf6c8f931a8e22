"""Which thread heals: the cost of a heal served and fetched on the training thread vs on
the quorum thread (``Manager(heal_on_training_thread=...)``), and the per-step cost of the
default (``None``: decided once from the registered state, ``manager/_heal_thread.py``).

Two Managers in one process (threads, one rank each, gloo over loopback, our lighthouse),
a plain state of ``--mb`` MB (one float32 tensor), ``--compute-ms`` of sleep per step as
the compute, one small allreduce per step. The joiner starts once the sender is at step 3
and heals from it; both stop at step 12, and the joiner's state must equal the sender's.
Per mode, medians over ``--reps`` heals (the first, a warm-up, left out):

- ``joiner_start_to_first_participating_commit_s``: the joiner's Manager built -> its
  first committed step that it took part in (the heal and its apply included);
- ``joiner_heal_s`` / ``joiner_heal_quorum_wait_s``: where the joiner's heal round went
  (a quorum-thread fetch shows as quorum wait);
- ``sender_heal_round_s`` vs ``sender_median_round_s``: the sender's step in which it
  served, against its usual step.

Then ``step_us``: the median step (no heal, no compute) of a lone Manager with
``heal_on_training_thread=False`` and with the default ``None``, alternated.

    .venv/bin/python bench/heal_thread.py --mb 256 --reps 6

Prints a JSON object and, last, one line ``{"bench": "heal_thread", "results": ...}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import torch


def _manager(lh: Any, name: str, state: dict[str, torch.Tensor], mode: bool | None) -> tuple[Any, Any]:
    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    m = Manager(pg, lambda sd: state.update(sd), lambda: dict(state), min_replica_size=1, rank=0, world_size=1,
                hostname="127.0.0.1", store_addr="127.0.0.1", lighthouse_addr=lh.address(), replica_id=name,
                timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=30),
                connect_timeout=timedelta(seconds=10), heal_on_training_thread=mode)
    return m, pg


def _loop(m: Any, steps: int, compute_s: float, started: threading.Event | None = None) -> list[float]:
    times = []
    deadline = time.monotonic() + 120
    while m.current_step() < steps and time.monotonic() < deadline:
        if started is not None and m.current_step() >= 3:
            started.set()
        t0 = time.perf_counter()
        m.start_quorum()
        time.sleep(compute_s)
        m.allreduce(torch.ones(1024)).wait()
        m.should_commit()
        times.append(time.perf_counter() - t0)
    if m.current_step() < steps:
        raise RuntimeError(f"stuck at step {m.current_step()}: {m.errored()}")
    return times


def heal_case(mb: int, compute_s: float, mode: bool) -> dict[str, float]:
    """One heal of ``mb`` MB with ``heal_on_training_thread=mode``."""
    from rallypoint.lighthouse.server import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=300)
    n = mb * (1 << 20) // 4
    sa, sb = {"w": torch.randn(n)}, {"w": torch.zeros(n)}
    early = threading.Event()
    out: dict[str, float] = {}

    def sender() -> None:
        m, pg = _manager(lh, "a", sa, mode)
        try:
            _loop(m, 12, compute_s, early)
            recs = m.step_records()
            served = next(r for r in recs if r.served_to)
            out["sender_heal_round_s"] = served.ended - served.started
            out["sender_median_round_s"] = statistics.median(r.ended - r.started for r in recs[1:] if not r.served_to)
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    def joiner() -> None:
        if not early.wait(60):
            raise RuntimeError("the sender never reached step 3")
        m, pg = _manager(lh, "b", sb, mode)
        t0 = time.monotonic()
        try:
            _loop(m, 12, compute_s)
            recs = m.step_records()
            heal = next(r for r in recs if r.healing)
            out["joiner_heal_s"], out["joiner_heal_quorum_wait_s"] = heal.heal_s, heal.quorum_wait_s
            first = next(r for r in recs if r.outcome == "committed" and not r.healing
                         and r.participating_rank is not None)
            out["joiner_start_to_first_participating_commit_s"] = first.ended - t0
        finally:
            m.shutdown(wait=False)
            pg.shutdown()

    try:
        with cf.ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(sender), ex.submit(joiner)]:
                f.result(timeout=300)
    finally:
        lh.shutdown()
    if not torch.equal(sa["w"], sb["w"]):
        raise RuntimeError("the joiner's state differs from the sender's")
    return out


def step_case(mode: bool | None, steps: int = 300) -> float:
    """The median step (microseconds) of a lone Manager, no heal, no compute."""
    from rallypoint.lighthouse.server import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=300)
    m, pg = _manager(lh, "s", {"w": torch.ones(10)}, mode)
    try:
        t = _loop(m, steps, 0.0)
    finally:
        m.shutdown(wait=False)
        pg.shutdown()
        lh.shutdown()
    return statistics.median(t[20:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size, MB")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="sleep per step, ms")
    ap.add_argument("--reps", type=int, default=4, help="heals per mode (the first is a warm-up)")
    a = ap.parse_args()
    os.environ.setdefault("RALLYPOINT_PG_HOST", "127.0.0.1")
    results: dict[str, Any] = {"mb": a.mb, "compute_ms": a.compute_ms}
    for mode in (False, True):
        runs = [heal_case(a.mb, a.compute_ms / 1000, mode) for _ in range(max(2, a.reps))]
        results[f"heal training_thread={mode}"] = {k: round(statistics.median(r[k] for r in runs[1:]), 4)
                                                   for k in runs[0]}
    steps: dict[str, list[float]] = {}
    for auto in (False, True, False, True):
        steps.setdefault(f"step_us training_thread={None if auto else False}", []).append(
            round(step_case(None if auto else False), 1))
    results.update(steps)
    print(json.dumps(results, indent=1))
    print(json.dumps({"bench": "heal_thread", "results": results}))


if __name__ == "__main__":
    main()
