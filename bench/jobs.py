#!/usr/bin/env python
"""Many jobs on one lighthouse: does one job's flood delay another job's quorums?

    .venv/bin/python bench/jobs.py                 # 400 quorums per case (~1 minute)
    .venv/bin/python bench/jobs.py --quorums 100 --flooders 1

Job ``b`` (one replica group) asks for ``--quorums`` quorums in a row, each answered on
arrival (the fast path): its quorum latency, median and p99, is what a job feels. It is
measured alone, then while job ``a`` floods: ``--flooders`` child processes, each with four
threads sending, as fast as they go, either heartbeats for 50 replicas of job ``a`` or
malformed Quorum requests (INVALID_ARGUMENT).

- ours: both jobs on one rallypoint lighthouse (``RALLYPOINT_JOB``), in this process.
- torchft 0.2.0 has no jobs: two jobs need two lighthouses, so job ``a`` floods a second
  torchft lighthouse in this process while ``b`` uses the first. That is the isolation a
  torchft user gets today, in the same run on the same cores.

Output: a table, then ONE JSON line {"bench": "jobs", "results", "ratios"}; the ratios are
each side's flood median over its alone median (1.0: the flood cost job ``b`` nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _util import median, percentile, ratio  # noqa: E402

log = logging.getLogger("bench.jobs")

FLOOD = r"""
import sys, threading, time
from rallypoint.lighthouse.client import LighthouseClient
addr, job, seconds, mode = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
job = None if job == "-" else job
end = time.monotonic() + seconds
counts = []
def run(k):
    n = 0
    with LighthouseClient(addr, job=job, connect_timeout=10) as c:
        while time.monotonic() < end:
            if mode == "heartbeats":
                c.heartbeat(f"a-{k}-{n % 50}")
            else:  # malformed: an empty replica id is INVALID_ARGUMENT
                try:
                    c.quorum(replica_id="", timeout=1)
                except ValueError:
                    pass
            n += 1
    counts.append(n)
ts = [threading.Thread(target=run, args=(k,)) for k in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
print(sum(counts))
"""


def _latencies(addr: str, job: str | None, n: int) -> list[float]:
    from rallypoint.lighthouse.client import LighthouseClient

    out = []
    with LighthouseClient(addr, job=job, connect_timeout=10) as c:
        c.quorum(replica_id="b-0", timeout=timedelta(seconds=10), step=0)  # forms the quorum: later ones are fast path
        for i in range(1, n + 1):
            t0 = time.perf_counter()
            c.quorum(replica_id="b-0", timeout=timedelta(seconds=10), step=i)
            out.append(time.perf_counter() - t0)
    return out


def _flood(addr: str, job: str | None, flooders: int, seconds: float, mode: str) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RALLYPOINT_JOB", None)
    return [subprocess.Popen([sys.executable, "-c", FLOOD, addr, job or "-", str(seconds), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env, text=True) for _ in range(flooders)]


def _case(name: str, addr_b: str, job_b: str | None, flood_addr: str | None, flood_job: str | None,
          args: argparse.Namespace, mode: str = "heartbeats") -> dict[str, Any]:
    procs = _flood(flood_addr, flood_job, args.flooders, args.flood_s, mode) if flood_addr else []
    try:
        if procs:
            time.sleep(2.0)  # the flooders connect and reach full speed (not a wait for an event: a warm-up)
        t0 = time.monotonic()
        lat = _latencies(addr_b, job_b, args.quorums)
        wall = time.monotonic() - t0
    finally:
        calls = 0
        for p in procs:
            try:
                out, _ = p.communicate(timeout=args.flood_s + 30)
                calls += int(out.strip() or 0)
            except (subprocess.TimeoutExpired, ValueError):
                p.kill()
                p.wait(10)
    flood_rate = calls / args.flood_s if procs else 0.0
    return {"case": name, "median_ms": 1e3 * median(lat), "p99_ms": 1e3 * percentile(lat, 99),
            "max_ms": 1e3 * max(lat), "quorums": len(lat), "wall_s": wall, "flood_calls_per_s": flood_rate}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quorums", type=int, default=400)
    ap.add_argument("--flooders", type=int, default=2, help="child processes flooding job a (4 threads each)")
    ap.add_argument("--flood-s", type=float, default=20.0, help="how long each flooder runs")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)

    from torchft._torchft import LighthouseServer as TorchftLighthouseServer

    from rallypoint.lighthouse.server import LighthouseServer

    results = []
    ours = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        addr = ours.local_address()
        results.append(_case("ours, job b alone", addr, "b", None, None, args))
        results.append(_case("ours, job a: heartbeat flood, same lighthouse", addr, "b", addr, "a", args))
        results.append(_case("ours, job a: malformed-request flood", addr, "b", addr, "a", args, "malformed"))
    finally:
        ours.shutdown()
    tf_b = TorchftLighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    tf_a = TorchftLighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(devnull, 2)  # torchft logs every request on fd 2: as shipped, but not on the console
    try:
        results.append(_case("torchft, job b alone", tf_b.address(), None, None, None, args))
        results.append(_case("torchft, job a: heartbeat flood, 2nd lighthouse", tf_b.address(), None, tf_a.address(), None, args))
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        tf_b.shutdown()
        tf_a.shutdown()

    print(f"{'case':48} {'median ms':>10} {'p99 ms':>8} {'max ms':>8} {'flood calls/s':>14}")
    for r in results:
        print(f"{r['case']:48} {r['median_ms']:10.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f} {r['flood_calls_per_s']:14.0f}")
    ratios = {"ours_heartbeat_flood_over_alone": ratio(results[1]["median_ms"], results[0]["median_ms"]),
              "ours_malformed_flood_over_alone": ratio(results[2]["median_ms"], results[0]["median_ms"]),
              "torchft_heartbeat_flood_over_alone": ratio(results[4]["median_ms"], results[3]["median_ms"]),
              "ours_p99_heartbeat_flood_over_alone": ratio(results[1]["p99_ms"], results[0]["p99_ms"]),
              "torchft_p99_heartbeat_flood_over_alone": ratio(results[4]["p99_ms"], results[3]["p99_ms"])}
    print(json.dumps({"bench": "jobs", "results": results, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
