"""A slow replica group: what it costs the others, rallypoint (``--stragglers evict``) vs
torchft 0.2.0, measured in one run.

G replica groups (one process each, ``bench/chaos_worker.py``: a small MLP under the
framework's DDP, gloo on CPU, ``--compute-ms`` of simulated compute per step) train
against the framework's lighthouse, twice per framework:

- fault-free: every group computes ``--compute-ms`` per step;
- slow: group 0 computes ``--factor`` times longer per step (a straggler; the others are
  unchanged).

Reported for the other groups, over the last ``--measure`` seconds of each run (after
``--warmup`` seconds, so eviction has settled): the median and mean time between their
committed steps, and the slow run's ratio to the fault-free one. torchft has no straggler
handling: every step waits for the slow group. rallypoint's lighthouse scores the slow group
a straggler within a few steps and, with ``--stragglers evict``, leaves it out for a
cool-down (10 s, doubling to 30 s); readmitted, it is scored again, so a few slow steps
recur after each cool-down: they show in the mean, not in the median.

Prints a table and one JSON line ``{"bench": "stragglers", ...}``.

    .venv/bin/python bench/stragglers.py            # G=3, about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import _util  # noqa: E402


def lighthouse(fw: str, groups: int) -> Any:
    if fw == "ours":
        from rallypoint.lighthouse.server import LighthouseServer
        from rallypoint.lighthouse.stragglers import Policy

        return LighthouseServer(bind="127.0.0.1:0", min_replicas=groups - 1, join_timeout_ms=2000,
                                heartbeat_timeout_ms=5000, stragglers=Policy(mode="evict"))
    return _util.load_torchft_native().LighthouseServer(bind="127.0.0.1:0", min_replicas=groups - 1,
                                                        join_timeout_ms=2000, heartbeat_timeout_ms=5000)


def run(fw: str, groups: int, slow_factor: float, args: argparse.Namespace) -> dict[str, Any]:
    """One run: G workers for warmup + measure seconds; the other groups' commit intervals."""
    lh = lighthouse(fw, groups)
    addr = f"http://127.0.0.1:{int(lh.address().rsplit(':', 1)[1])}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               RUST_LOG="warn", OMP_NUM_THREADS="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE"):
        env.pop(k, None)
    commits: dict[int, list[float]] = {g: [] for g in range(groups)}
    procs = []
    for gid in range(groups):
        plan = {"framework": fw, "gid": gid, "lighthouse": addr, "standby": False, "op_timeout_s": 10.0,
                "compute_ms": args.compute_ms * (slow_factor if gid == 0 else 1.0)}
        p = subprocess.Popen([sys.executable, str(HERE / "chaos.py"), "--worker", json.dumps(plan)], env=env,
                             cwd=str(REPO), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        procs.append(p)

        def read(p: subprocess.Popen = p, gid: int = gid) -> None:
            for line in p.stdout or ():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("c") and rec.get("p"):
                    commits[gid].append(float(rec["t1"]))

        threading.Thread(target=read, daemon=True).start()
    t_start = time.time()
    time.sleep(args.warmup + args.measure)  # the measured window: workers report on their own
    t_end = time.time()
    for p in procs:
        p.kill()
        p.wait(10)
    lh.shutdown()
    since = t_start + args.warmup
    gaps: list[float] = []
    for gid in range(1, groups):
        times = [t for t in commits[gid] if since <= t <= t_end]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return {"median_ms": round(1000 * statistics.median(gaps), 1) if gaps else None,
            "mean_ms": round(1000 * statistics.fmean(gaps), 1) if gaps else None,
            "commits": len(gaps), "slow_group_commits": len([t for t in commits[0] if since <= t <= t_end])}


def main() -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's in-process lighthouse logs every quorum at info
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--factor", type=float, default=3.0, help="how much slower the slow group computes (3)")
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring (eviction settles)")
    ap.add_argument("--measure", type=float, default=20.0)
    ap.add_argument("--frameworks", default="ours,torchft")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for fw in args.frameworks.split(","):
        results[fw] = {"fault_free": run(fw, args.groups, 1.0, args), "slow": run(fw, args.groups, args.factor, args)}
        for k in ("median_ms", "mean_ms"):
            a, b = results[fw]["fault_free"][k], results[fw]["slow"][k]
            results[fw][f"slow_vs_fault_free_{k[:-3]}"] = round(b / a, 3) if a and b else None
    print(f"G={args.groups}, group 0 {args.factor:g}x slower, compute {args.compute_ms:g} ms/step; the other groups' "
          "time between commits")
    print(f"{'framework':<10}{'fault-free median':>19}{'slow median':>13}{'ratio':>7}{'fault-free mean':>17}"
          f"{'slow mean':>11}{'ratio':>7}")
    for fw, r in results.items():
        ff, sl = r["fault_free"], r["slow"]
        print(f"{fw:<10}{ff['median_ms']:>17} ms{sl['median_ms']:>10} ms{r['slow_vs_fault_free_median']:>7}"
              f"{ff['mean_ms']:>15} ms{sl['mean_ms']:>8} ms{r['slow_vs_fault_free_mean']:>7}")
    ratios = {f"{fw}_slow_vs_fault_free_median": r["slow_vs_fault_free_median"] for fw, r in results.items()}
    if "ours" in results and "torchft" in results:
        a, b = results["ours"]["slow"]["median_ms"], results["torchft"]["slow"]["median_ms"]
        ratios["ours_vs_torchft_slow_median"] = round(a / b, 3) if a and b else None
    print(json.dumps({"bench": "stragglers", "groups": args.groups, "factor": args.factor, "results": results,
                      "ratios": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
