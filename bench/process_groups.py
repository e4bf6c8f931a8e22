"""Process groups: rallypoint vs torchft 0.2.0, measured in one run.

Two rank processes (spawned once) hold every group side by side and run the same
scenarios in lockstep against a TCPStore hosted here; measurements of the
implementations are interleaved round by round, so a busy machine slows all columns
alike; rank 0 reports medians. Rows:

- allreduce latency (median over interleaved rounds of the mean of N back-to-back
  allreduce+wait) and algorithm bandwidth
  at 4 KB, 1 MB, 64 MB for plain torch gloo (the floor), rallypoint ProcessGroupGloo,
  torchft ProcessGroupGloo, rallypoint ProcessGroupBabyGloo, torchft ProcessGroupBabyGloo;
- configure (reconfigure) time: median of K configures with a fresh quorum each;
- 4096 one-element tensors through the Baby groups: issue all, then wait all.

Prints a table and one JSON line ``{"bench": "process_groups", "results": ...,
"ratios": ...}``; ratios are ours / torchft's (and ours / plain gloo for Gloo).

    .venv/bin/python bench/process_groups.py            # full run, a few minutes
    .venv/bin/python bench/process_groups.py --quick    # smoke run, about a minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import emit_line, fmt_ratio, ratio, table  # noqa: E402

SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
T = datetime.timedelta


def _make(impl: str, timeout_s: float) -> Any:
    t = T(seconds=timeout_s)
    if impl == "ours-gloo":
        from rallypoint.process_groups import ProcessGroupGloo

        return ProcessGroupGloo(timeout=t)
    if impl == "torchft-gloo":
        from torchft.process_group import ProcessGroupGloo

        return ProcessGroupGloo(timeout=t)
    if impl == "ours-baby":
        from rallypoint.process_groups import ProcessGroupBabyGloo

        return ProcessGroupBabyGloo(timeout=t)
    if impl == "torchft-baby":
        from torchft.process_group import ProcessGroupBabyGloo

        return ProcessGroupBabyGloo(timeout=t)
    raise ValueError(impl)


class _Plain:
    """torch's gloo backend used directly: the floor for the wrappers."""

    def __init__(self) -> None:
        self.b: Any = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None) -> None:
        import torch.distributed as dist

        hostport, _, prefix = store_addr.partition("/")
        host, _, port = hostport.rpartition(":")
        store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=T(seconds=60)))
        self.b = None
        self.b = dist.ProcessGroupGloo(store, rank, world_size, T(seconds=60))

    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        return self.b.allreduce(tensors, opts)

    def shutdown(self) -> None:
        self.b = None


def _allreduce_opts() -> Any:
    from torch.distributed.distributed_c10d import AllreduceOptions

    return AllreduceOptions()


def _rank_main(rank: int, port: int, plan: dict[str, Any], conn: Any) -> None:
    """One rank: all groups configured side by side, measurements interleaved.

    Interleaving (round r measures every implementation once before round r+1)
    spreads the noise of a shared machine evenly over the columns; each number is
    the median over rounds. Rank 0 sends the results.
    """
    import torch

    torch.set_num_threads(1)
    world = 2
    n = [0]

    def addr() -> str:
        # the same fresh prefix on both ranks: both run the same sequence of configures
        n[0] += 1
        return f"127.0.0.1:{port}/{plan['run_id']}/{n[0]}"

    groups: dict[str, Any] = {}
    quorum = {impl: 0 for impl in plan["impls"]}

    def configure(impl: str) -> float:
        quorum[impl] += 1
        t0 = time.perf_counter()
        groups[impl].configure(addr(), f"replica{rank}", rank, world, quorum_id=quorum[impl])
        return time.perf_counter() - t0

    for impl in plan["impls"]:
        groups[impl] = _Plain() if impl == "plain-gloo" else _make(impl, 120)
        configure(impl)
    samples: dict[str, dict[str, list[float]]] = {impl: {} for impl in plan["impls"]}
    for label, nbytes in SIZES.items():
        if label not in plan["sizes"]:
            continue
        iters = plan["iters"][label]
        tensors = {impl: torch.ones(nbytes // 4) for impl in plan["impls"]}
        for impl, t in tensors.items():
            for _ in range(2):  # warm-up (and, for the Baby groups, first-use sharing)
                groups[impl].allreduce([t], _allreduce_opts()).wait()
        for _ in range(plan["rounds"]):
            for impl, t in tensors.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    groups[impl].allreduce([t], _allreduce_opts()).wait()
                samples[impl].setdefault(label, []).append((time.perf_counter() - t0) / iters)
    for _ in range(plan["tiny_reps"]):
        for impl in plan["impls"]:
            if "baby" not in impl:
                continue
            ts = [torch.ones(1) for _ in range(4096)]
            t0 = time.perf_counter()
            works = [groups[impl].allreduce([x], _allreduce_opts()) for x in ts]
            for w in works:
                w.wait()
            samples[impl].setdefault("tiny4k", []).append(time.perf_counter() - t0)
            assert all(float(x) == world for x in ts), "wrong tiny-tensor result"
    for rep in range(plan["reconfigures"]):
        for impl in plan["impls"]:
            if impl == "plain-gloo" or ("baby" in impl and rep >= plan["reconfigures_baby"]):
                continue
            samples[impl].setdefault("reconfigure", []).append(configure(impl))
    results: dict[str, Any] = {}
    for impl, per in samples.items():
        row: dict[str, Any] = {}
        for label, vals in per.items():
            med = statistics.median(vals)
            if label in SIZES:
                row[label] = {"latency_ms": med * 1e3, "algbw_GBps": SIZES[label] / med / 1e9, "rounds": len(vals)}
            else:
                row[f"{label}_ms"] = med * 1e3
        results[impl] = row
    for g in groups.values():
        try:
            g.shutdown()
        except Exception:  # noqa: BLE001
            pass
    if rank == 0:
        conn.send(results)
    conn.close()


def run(plan: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T(seconds=120))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_main, args=(r, store.port, plan, child), name=f"bench-rank{r}") for r in range(2)]
    for p in procs:
        p.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"benchmark ranks gave no result within {timeout_s:.0f}s")
        return parent.recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--impls", default="plain-gloo,ours-gloo,torchft-gloo,ours-baby,torchft-baby",
                    help="comma-separated subset of the columns")
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of 4KB,1MB,64MB")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per size (default 9, quick 3)")
    args = ap.parse_args()
    quick = args.quick
    plan = {
        "run_id": uuid.uuid4().hex[:8],
        "impls": args.impls.split(","),
        "sizes": args.sizes.split(","),
        "iters": {"4KB": 50 if quick else 100, "1MB": 10 if quick else 20, "64MB": 1 if quick else 2},
        "rounds": args.rounds or (3 if quick else 9),
        "reconfigures": 3 if quick else 9,
        "reconfigures_baby": 2 if quick else 3,
        "tiny_reps": 1 if quick else 3,
    }
    res = run(plan, args.timeout)

    def get(impl: str, *keys: str) -> float | None:
        v: Any = res.get(impl, {})
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    rows = []
    ratios: dict[str, Any] = {}
    for label in SIZES:
        for kind in ("gloo", "baby"):
            ours, theirs = get(f"ours-{kind}", label, "latency_ms"), get(f"torchft-{kind}", label, "latency_ms")
            plain = get("plain-gloo", label, "latency_ms")
            r = ratio(ours, theirs)
            ratios[f"{kind}_allreduce_{label}"] = r
            if kind == "gloo":
                ratios[f"gloo_vs_plain_{label}"] = ratio(ours, plain)
            rows.append([
                f"allreduce {label} {kind} latency ms", _f(ours), _f(theirs), fmt_ratio(r),
                _f(plain) if kind == "gloo" else "",
                f"{get(f'ours-{kind}', label, 'algbw_GBps') or 0:.3f} / {get(f'torchft-{kind}', label, 'algbw_GBps') or 0:.3f}",
            ])
    for kind in ("gloo", "baby"):
        ours, theirs = get(f"ours-{kind}", "reconfigure_ms"), get(f"torchft-{kind}", "reconfigure_ms")
        ratios[f"{kind}_reconfigure"] = ratio(ours, theirs)
        rows.append([f"reconfigure {kind} ms", _f(ours), _f(theirs), fmt_ratio(ratio(ours, theirs)), "", ""])
    ours, theirs = get("ours-baby", "tiny4k_ms"), get("torchft-baby", "tiny4k_ms")
    ratios["baby_tiny4k"] = ratio(ours, theirs)
    rows.append(["4096 tiny tensors baby ms", _f(ours), _f(theirs), fmt_ratio(ratio(ours, theirs)), "", ""])
    print(table(["metric (2 ranks, localhost)", "rallypoint", "torchft 0.2.0", "ratio", "plain gloo", "GB/s ours/torchft"], rows))
    line = json.dumps({"bench": "process_groups", "quick": quick, "results": res, "ratios": ratios})
    emit_line(line, args.out)


def _f(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


if __name__ == "__main__":
    main()
