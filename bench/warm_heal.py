"""Warm heals through the Manager: a replica that fails a step and heals again without
restarting, with the heal on the quorum thread (the default for plain state).

Two Managers in one process (threads, one rank each, gloo over loopback, our lighthouse);
the state is a model of ``--mb`` MB (4 float32 tensors) that the user's ``state_dict``
returns and ``load_state_dict`` copies into, as ``nn.Module`` does. Replica ``b`` fails
at every odd step (``report_error``), so the next round it is one step behind and heals
from ``a``: ``--heals`` heals in the same receiver process. Two modes, alternated run by
run:

- ``fresh_copy`` (``RALLYPOINT_HEAL_BUFFERS=0``; what every quorum-thread heal did
  before): the quorum thread receives into fresh memory; the training thread's
  ``load_state_dict`` copies it into the model.
- ``pooled_swap`` (the default now): the quorum thread receives into the buffers the last
  heal left and verifies them; the training thread swaps them into the model's own tensors
  (``wire.Landing``), and ``load_state_dict`` finds its tensors already holding the bytes.

Per healing round of ``b`` (the first heal, with nothing kept yet, left out): the round's
time from ``start_quorum`` to the end of ``should_commit`` and its parts, waiting for the
quorum thread's fetch (``quorum_wait_s``) and the training thread's apply (``heal_s``).
Both replicas must end bit-identical. Ratio: pooled_swap / fresh_copy (lower is better).

    .venv/bin/python bench/warm_heal.py --mb 512 --heals 6 --runs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import emit_line, median, ratio, table  # noqa: E402

MODES = {"fresh_copy": "0", "pooled_swap": "1"}
TIMEOUT = timedelta(seconds=60)


def _replica(lh_addr: str, name: str, mb: int, fails: bool, target: int, start: threading.Barrier) -> dict[str, Any]:
    import torch

    from rallypoint.manager import Manager
    from rallypoint.process_groups import ProcessGroupGloo

    n = mb * 2**20 // 4 // 4
    own = {f"w{i}": torch.full((n,), float(i)) for i in range(4)}

    def load(sd: dict[str, Any]) -> None:
        for k, t in own.items():
            t.copy_(sd[k])  # what nn.Module.load_state_dict does (a no-op once swapped in)

    pg = ProcessGroupGloo(timeout=TIMEOUT)
    m = Manager(pg, load, lambda: dict(own), min_replica_size=2, rank=0, world_size=1, hostname="127.0.0.1",
                store_addr="127.0.0.1", lighthouse_addr=lh_addr, replica_id=name, timeout=TIMEOUT,
                quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT)
    one = torch.ones(1)
    rounds: list[dict[str, Any]] = []
    try:
        start.wait()
        deadline = time.monotonic() + 600
        while m.current_step() < target and time.monotonic() < deadline:
            t0 = time.perf_counter()
            m.start_quorum()
            m.allreduce(one).wait()
            step = m.current_step()
            if fails and step % 2 == 1 and step < target - 2 and m.errored() is None:
                m.report_error(RuntimeError("bench: a transient failure"))
            ok = m.should_commit()
            if ok:
                for t in own.values():
                    t.add_(1.0)  # the "optimizer step": the sender's state moves on between heals
            rec = m.step_records()[-1]
            rounds.append({"s": time.perf_counter() - t0, "healing": rec.healing, "wait": rec.quorum_wait_s,
                           "apply": rec.heal_s, "ok": ok})
        digest = [float(t[:: max(1, n // 1024)].sum()) for t in own.values()]
        return {"step": m.current_step(), "rounds": rounds, "digest": digest}
    finally:
        m.shutdown(wait=False)
        pg.shutdown()


def run_mode(mode: str, mb: int, heals: int) -> dict[str, Any]:
    """One run: a lighthouse and two replicas in this process, ``b`` healing ``heals`` times."""
    from rallypoint.lighthouse.server import LighthouseServer

    os.environ["RALLYPOINT_HEAL_BUFFERS"] = MODES[mode]  # read when each Manager builds its transport
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000)
    start = threading.Barrier(2, timeout=120)
    target = 2 * heals + 4
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            fa = ex.submit(_replica, lh.address(), "a", mb, False, target, start)
            fb = ex.submit(_replica, lh.address(), "b", mb, True, target, start)
            a, b = fa.result(timeout=900), fb.result(timeout=900)
    finally:
        lh.shutdown()
    healed = [r for r in b["rounds"] if r["healing"]][1:]  # the first heal had nothing kept: left out
    return {"mode": mode, "equal": a["digest"] == b["digest"] and a["step"] == b["step"], "heals": len(healed),
            "round_s": median([r["s"] for r in healed]) if healed else None,
            "fetch_wait_s": median([r["wait"] for r in healed]) if healed else None,
            "apply_s": median([r["apply"] for r in healed]) if healed else None,
            "normal_round_s": median([r["s"] for r in a["rounds"] if not r["healing"]] or [0.0])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="state size in MB (default 512)")
    ap.add_argument("--heals", type=int, default=6, help="heals per run (default 6; the first is left out)")
    ap.add_argument("--runs", type=int, default=2, help="runs per mode, alternated (default 2)")
    ap.add_argument("--quick", action="store_true", help="64 MB, 3 heals, 1 run")
    ap.add_argument("--out", help="also write the JSON line here")
    args = ap.parse_args()
    mb, heals, runs = (64, 3, 1) if args.quick else (args.mb, args.heals, args.runs)
    import logging

    logging.basicConfig(level=logging.ERROR)  # b fails on purpose: its warnings are the plan
    res: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(runs):
        for mode in (list(MODES) if i % 2 == 0 else list(reversed(MODES))):
            res[mode].append(run_mode(mode, mb, heals))
    summary = {m: {k: median([r[k] for r in rs if r[k] is not None]) if k.endswith("_s") else None
                   for k in ("round_s", "fetch_wait_s", "apply_s", "normal_round_s")} for m, rs in res.items()}
    for m, rs in res.items():
        summary[m]["heals"] = sum(r["heals"] for r in rs)
        summary[m]["all_equal"] = all(r["equal"] for r in rs)
    rows = [[m, f"{s['round_s']:.3f} s", f"{s['fetch_wait_s']:.3f} s", f"{s['apply_s']:.3f} s",
             f"{s['normal_round_s'] * 1e3:.1f} ms", str(s["heals"]), "yes" if s["all_equal"] else "NO"]
            for m, s in summary.items()]
    print(f"warm heals on the quorum thread: {mb} MB state, {heals} heals per run (first left out), {runs} run(s) "
          f"per mode, 2 Managers in one process, {os.cpu_count()} CPUs")
    print(table(["mode", "healing round", "fetch wait", "apply", "normal round", "heals", "equal"], rows))
    ratios = {k: ratio(summary["pooled_swap"][k], summary["fresh_copy"][k]) for k in ("round_s", "apply_s")}
    print("pooled_swap / fresh_copy: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    emit_line(json.dumps({"bench": "warm_heal", "mb": mb, "heals": heals, "runs": runs, "results": res,
                          "summary": summary, "ratios": ratios}), args.out)
    return 0 if all(s["all_equal"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
