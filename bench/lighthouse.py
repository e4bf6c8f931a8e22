#!/usr/bin/env python
"""Lighthouse benchmark: torchft 0.2.0's Rust lighthouse vs rallypoint's, in one run,
both driven by the SAME client (torchft's Rust ``LighthouseClient``).

    .venv/bin/python bench/lighthouse.py            # full run (a few minutes)
    .venv/bin/python bench/lighthouse.py --quick    # smoke run (under a minute)
    .venv/bin/python bench/lighthouse.py --out bench-lighthouse.json

What it measures (each lighthouse runs in its OWN process, as in production, so our
Python server never shares a GIL with the client threads; both are measured interleaved,
so background load on the machine falls on both alike):

1. Fast-path round latency. N replicas (threads, each with its own LighthouseClient,
   spread over worker processes of <= 128 threads) are released at one instant T; the
   round time is T -> the last answer. A warm-up round forms the first quorum (not the
   fast path), then R measured rounds. ``min_replicas=N`` and a 10-minute join timeout,
   so after warm-up only the fast path forms quorums. Per N we also report:
   - the release skew (T -> the last thread entering ``quorum()``): client-side cost;
   - a client baseline: the same round made of ``heartbeat()`` calls (trivial server
     work, empty answers); against torchft's Rust server it is a floor for
     client + transport + release;
   - the lighthouse process's CPU time per round.
2. Post-kill quorum: 3 replica processes loop on quorum() (2 ms "step" between rounds)
   and heartbeat every 100 ms; one is SIGKILLed; time from the kill to both survivors
   holding a quorum without it. Variants: torchft, ours without the liveness stream (both
   wait for heartbeat expiry), ours with ``LivenessStream`` (crash seen when the
   connection drops; its replicas use rallypoint's client, since a replica id is bound to
   the session that registered it and torchft's client sends none). Median of several
   repetitions.
3. Heartbeats/s: K threads (own clients) calling heartbeat() back to back for a while.

Output: a table, then ONE JSON line {"bench": "lighthouse", "results": ..., "ratios": ...}
(ratios are ours/torchft from this run; < 1 is better for latencies; the heartbeat
ratio's key says higher is better).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _util  # noqa: E402
from _util import Child, close_all, fmt_ms, fmt_num, fmt_ratio, median, percentile, ratio  # noqa: E402

IMPLS = ("torchft", "rallypoint")
THREADS_PER_PROC = 128


# =============================================================================== children
def _child_argv(mode: str, cfg: dict) -> list[str]:
    """A child process of this benchmark (bench/_lighthouse_children.py: a lighthouse, a
    client worker, a replica) told its mode and settings."""
    return [sys.executable, os.path.join(HERE, "_lighthouse_children.py"), mode,
            json.dumps({**cfg, "parent": os.getpid()})]


# =============================================================================== parent
class Server:
    def __init__(self, impl: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> None:
        self.impl = impl
        self.child = Child(
            _child_argv(
                "--_serve",
                dict(
                    impl=impl,
                    min_replicas=min_replicas,
                    join_timeout_ms=join_timeout_ms,
                    heartbeat_timeout_ms=heartbeat_timeout_ms,
                ),
            ),
            name=f"lighthouse-{impl}",
        )
        try:
            hello = self.child.recv(timeout=60)
        except Exception:
            self.child.close()
            raise
        self.addr: str = hello["addr"]
        self.pid: int = hello["pid"]

    def cpu(self) -> float:
        self.child.send({"cmd": "cpu"})
        return self.child.recv(timeout=30)["cpu"]

    def close(self) -> None:
        self.child.close(grace=10)


class Workers:
    """Client threads spread over worker processes; one ``round`` = release all at T."""

    def __init__(self, addr: str, ids: list[str], timeout_s: float, env: dict[str, str] | None = None) -> None:
        self.children: list[Child] = []
        self.n = len(ids)
        self._cpu = 0.0  # client processes' CPU seconds at the end of the last round
        try:
            for k in range(0, len(ids), THREADS_PER_PROC):
                part = ids[k : k + THREADS_PER_PROC]
                self.children.append(
                    Child(
                        _child_argv("--_clients", dict(addr=addr, ids=part, timeout_s=timeout_s)),
                        name=f"clients{k // THREADS_PER_PROC}",
                        env=env,
                    )
                )
            for c in self.children:
                hello = c.recv(timeout=120)
                if hello.get("n_errors"):
                    raise RuntimeError(f"{c.name}: {hello['n_errors']} clients failed to connect: {hello['errors']}")
        except Exception:
            self.close()
            raise

    def _margin(self) -> float:
        # Time for every process to read the command and park its threads before T.
        return 0.02 + 0.0003 * self.n

    def round(self, op: str, step: int, timeout: float) -> dict:
        t0 = time.monotonic() + self._margin()
        for c in self.children:
            c.send({"cmd": "round", "op": op, "t0": t0, "step": step})
        parts = [c.recv(timeout=timeout + self._margin()) for c in self.children]
        errors = [e for p in parts for e in p["errors"]]
        cpu = sum(p["cpu"] for p in parts)
        cpu_delta, self._cpu = cpu - self._cpu, cpu
        return {
            "client_cpu_ms": cpu_delta * 1000,
            "ms": (max(p["max_end"] for p in parts) - t0) * 1000,
            "first_ms": (min(p["min_end"] for p in parts) - t0) * 1000,
            "skew_ms": (max(p["max_start"] for p in parts) - t0) * 1000,
            "after_last_ask_ms": (max(p["max_end"] for p in parts) - max(p["max_start"] for p in parts)) * 1000,
            "qids": sorted({q for p in parts for q in p["qids"]}),
            "sizes": sorted({s for p in parts for s in p["sizes"]}),
            "n_errors": sum(p["n_errors"] for p in parts),
            "errors": errors[:3],
        }

    def hammer(self, duration: float) -> dict:
        t0 = time.monotonic() + self._margin()
        for c in self.children:
            c.send({"cmd": "hammer", "t0": t0, "duration": duration})
        parts = [c.recv(timeout=duration + 60) for c in self.children]
        return {
            "count": sum(p["count"] for p in parts),
            "n_errors": sum(p["n_errors"] for p in parts),
            "errors": [e for p in parts for e in p["errors"]][:3],
        }

    def close(self) -> None:
        for c in self.children:
            try:
                c.send({"cmd": "quit"})
            except Exception:
                pass
        close_all(self.children, grace=5)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Side:
    """One lighthouse under test in the fast-path scenario, with its clients and tallies."""

    def __init__(self, impl: str, n: int) -> None:
        self.impl = impl
        self.n = n
        self.server: Server | None = None
        self.workers: Workers | None = None
        self.res: dict[str, Any] = {"n": n, "rounds": 0}
        self.series: dict[str, list[float]] = {k: [] for k in ("ms", "skew_ms", "first_ms", "client_cpu_ms", "after_last_ask_ms", "hb_ms")}
        self.bad: list[dict] = []
        self.qids: set[int] = set()
        self.cpu0 = 0.0

    @property
    def ok(self) -> bool:
        return self.workers is not None and "error" not in self.res and len(self.bad) < 3

    def fail(self, e: BaseException | str) -> None:
        self.res["error"] = (e if isinstance(e, str) else f"{type(e).__name__}: {e}")[:2000]

    def start(self, round_timeout: float) -> None:
        try:
            self.server = Server(self.impl, min_replicas=self.n, join_timeout_ms=600_000, heartbeat_timeout_ms=600_000)
            ids = [f"replica_{i:05d}" for i in range(self.n)]
            self.workers = Workers(self.server.addr, ids, timeout_s=round_timeout)
        except Exception as e:
            self.fail(e)

    def warm_up(self, round_timeout: float) -> None:
        """The first quorum (formed by 'every healthy replica is asking', not the fast path)."""
        try:
            assert self.workers is not None and self.server is not None
            warm = self.workers.round("quorum", step=0, timeout=round_timeout)
            self.res["warmup_ms"] = warm["ms"]
            if warm["n_errors"] or warm["sizes"] != [self.n]:
                self.fail(f"warm-up round failed: {warm['n_errors']} errors {warm['errors']}, quorum sizes {warm['sizes']}")
            self.cpu0 = self.server.cpu()
        except Exception as e:
            self.fail(e)

    def quorum_round(self, step: int, round_timeout: float) -> None:
        assert self.workers is not None
        try:
            rr = self.workers.round("quorum", step=step, timeout=round_timeout)
        except Exception as e:
            self.fail(e)
            return
        if rr["n_errors"] or rr["sizes"] != [self.n] or len(rr["qids"]) != 1:
            self.bad.append({"round": step, **{k: rr[k] for k in ("n_errors", "errors", "sizes", "qids", "ms")}})
            return
        for k in ("ms", "skew_ms", "first_ms", "client_cpu_ms", "after_last_ask_ms"):
            self.series[k].append(rr[k])
        self.qids.update(rr["qids"])

    def end_quorum_rounds(self) -> None:
        s = self.series
        times = s["ms"]
        cpu_ms = None
        try:
            if self.server is not None and self.workers is not None:
                cpu_ms = (self.server.cpu() - self.cpu0) * 1000 / max(1, len(times) + len(self.bad))
        except Exception:
            pass
        self.res.update(
            rounds=len(times),
            median_ms=median(times) if times else None,
            p99_ms=percentile(times, 99) if times else None,
            min_ms=min(times) if times else None,
            first_answer_median_ms=median(s["first_ms"]),
            release_skew_median_ms=median(s["skew_ms"]),
            last_ask_to_last_answer_median_ms=median(s["after_last_ask_ms"]),
            server_cpu_ms_per_round=cpu_ms,
            client_cpu_ms_per_round=median(s["client_cpu_ms"]),
            quorum_ids=sorted(self.qids),
        )
        if self.bad:
            self.res["failed_rounds"] = self.bad
            if "error" not in self.res:
                self.fail(f"{len(self.bad)} round(s) failed, first: {self.bad[0]}")

    def heartbeat_round(self, round_timeout: float) -> None:
        assert self.workers is not None
        try:
            rr = self.workers.round("heartbeat", step=0, timeout=round_timeout)
            if not rr["n_errors"]:
                self.series["hb_ms"].append(rr["ms"])
        except Exception as e:
            self.res["heartbeat_round_error"] = f"{type(e).__name__}: {e}"[:500]

    def close(self) -> None:
        if self.series["hb_ms"]:
            self.res["heartbeat_round_median_ms"] = median(self.series["hb_ms"])
        if self.workers is not None:
            self.workers.close()
        if self.server is not None:
            self.server.close()


def bench_fast_path(impls: list[str], n: int, rounds: int, hb_rounds: int, round_timeout: float) -> dict[str, dict]:
    """Fast-path round latency at N replicas, both lighthouses up at once and measured
    in alternating rounds (ABBA...), so that load from anything else on the machine falls
    on both alike."""
    sides = [_Side(impl, n) for impl in impls]
    t_start = time.monotonic()
    try:
        for side in sides:
            side.start(round_timeout)
        for side in sides:
            if side.ok:
                side.warm_up(round_timeout)
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                if side.ok:
                    side.quorum_round(r + 1, round_timeout)
        for side in sides:
            if side.workers is not None:
                side.end_quorum_rounds()
        for r in range(hb_rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                if side.ok:
                    side.heartbeat_round(round_timeout)
    finally:
        for side in sides:
            try:
                side.close()
            except Exception as e:
                side.res.setdefault("error", f"cleanup: {e}")
    wall = round(time.monotonic() - t_start, 2)
    out = {}
    for side in sides:
        side.res["wall_s_both"] = wall
        out[side.impl] = side.res
    return out


def bench_post_kill(impl: str, stream: bool, heartbeat_timeout_ms: int, warm_quorums: int = 10) -> dict:
    """SIGKILL one of 3 looping replicas; ms from the kill until both survivors hold a
    quorum without it."""
    server = None
    reps: list[Child] = []
    ids = ["r0", "r1", "r2"]
    try:
        server = Server(impl, min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=heartbeat_timeout_ms)
        for rid in ids:
            reps.append(
                Child(_child_argv("--_replica", dict(addr=server.addr, replica_id=rid, stream=stream)), name=f"replica-{rid}")
            )
        got: dict[str, list[dict]] = {rid: [] for rid in ids}

        def drain() -> None:
            for rid, c in zip(ids, reps):
                while True:
                    try:
                        _, obj = c.lines.get_nowait()
                    except Exception:
                        break
                    if obj is None:
                        continue
                    got[rid].append(obj)

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            drain()
            if all(sum(1 for o in got[r] if len(o.get("members", ())) == 3) >= warm_quorums for r in ids):
                break
            time.sleep(0.005)
        else:
            raise RuntimeError(
                f"replicas never reached {warm_quorums} full quorums: "
                + "; ".join(f"{r}: {got[r][-1:] } log {c.log_tail(400)}" for r, c in zip(ids, reps))
            )
        victim, survivors = ids[2], ids[:2]
        t_kill = time.time()
        os.kill(reps[2].pid, signal.SIGKILL)
        marks = {r: len(got[r]) for r in survivors}
        first: dict[str, float] = {}
        deadline = time.monotonic() + heartbeat_timeout_ms / 1000 * 3 + 15
        while time.monotonic() < deadline and len(first) < len(survivors):
            drain()
            for r in survivors:
                if r in first:
                    continue
                for o in got[r][marks[r] :]:
                    if "members" in o and victim not in o["members"] and o["t"] > t_kill:
                        first[r] = o["t"]
                        break
            time.sleep(0.002)
        if len(first) < len(survivors):
            errs = [o for r in survivors for o in got[r][marks[r] :] if "error" in o][:3]
            raise RuntimeError(f"survivors got no quorum without {victim} in time; errors: {errs}")
        return {"ms": (max(first.values()) - t_kill) * 1000}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        close_all(reps, grace=0.1)
        if server is not None:
            server.close()


def bench_heartbeats(impls: list[str], threads: int, duration: float, segments: int = 3) -> dict[str, dict]:
    """K threads (own clients) calling heartbeat() back to back; both lighthouses up at
    once and hammered in alternating segments, so background load falls on both alike."""
    servers: dict[str, Server] = {}
    workers: dict[str, Workers] = {}
    out: dict[str, dict] = {impl: {"threads": threads, "duration_s": duration} for impl in impls}
    count = {impl: 0 for impl in impls}
    cpu = {impl: 0.0 for impl in impls}
    errors: dict[str, list[str]] = {impl: [] for impl in impls}
    try:
        for impl in impls:
            try:
                servers[impl] = Server(impl, min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
                workers[impl] = Workers(servers[impl].addr, [f"hb_{i}" for i in range(threads)], timeout_s=10)
                workers[impl].hammer(0.3)  # warm-up
            except Exception as e:
                out[impl]["error"] = f"{type(e).__name__}: {e}"[:2000]
        live = [i for i in impls if "error" not in out[i]]
        for seg in range(segments):
            for impl in live if seg % 2 == 0 else live[::-1]:
                c0 = servers[impl].cpu()
                r = workers[impl].hammer(duration / segments)
                cpu[impl] += servers[impl].cpu() - c0
                count[impl] += r["count"]
                if r["n_errors"]:
                    errors[impl] += r["errors"]
        for impl in live:
            out[impl].update(per_s=count[impl] / duration, server_cpu_fraction=cpu[impl] / duration)
            if errors[impl]:
                out[impl]["error"] = f"{len(errors[impl])}+ errors: {errors[impl][:3]}"
        return out
    except Exception as e:
        for impl in impls:
            out[impl].setdefault("error", f"{type(e).__name__}: {e}"[:2000])
        return out
    finally:
        for w in workers.values():
            w.close()
        for srv in servers.values():
            srv.close()


# =============================================================================== report
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small N set, few rounds: a smoke run under ~60 s")
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--ns", help="comma-separated N for the fast-path rounds (default 2,8,32,128,1024)")
    ap.add_argument("--torchft-max-n", type=int, default=1024, help="largest N to try against torchft")
    ap.add_argument("--kill-reps", type=int, default=None, help="repetitions of each kill variant (default 3)")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="heartbeat timeout for the kill scenario")
    args = ap.parse_args()

    quick = args.quick
    ns = [int(x) for x in args.ns.split(",")] if args.ns else ([2, 8, 32] if quick else [2, 8, 32, 128, 1024])
    kill_reps = args.kill_reps or (1 if quick else 3)
    hb_timeout = args.heartbeat_timeout_ms if not (quick and args.heartbeat_timeout_ms == 2000) else 1000
    hb_threads, hb_duration = 8, (1.0 if quick else 3.0)

    def rounds_for(n: int) -> int:
        if quick:
            return 5
        return 30 if n <= 32 else 20 if n <= 128 else 10

    env = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torchft": _util.torchft_version(),
        "threads_per_client_process": THREADS_PER_PROC,
        "quick": quick,
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    results: dict[str, Any] = {"env": env, "fast_path": {}, "post_kill": {}, "heartbeats": {}}
    t_all = time.monotonic()

    # 1. fast path (both lighthouses up together, rounds alternating between them)
    for n in ns:
        rounds = rounds_for(n)
        impls = [i for i in IMPLS if not (i == "torchft" and n > args.torchft_max_n)]
        log(f"fast path: N={n}, {rounds} rounds on each of {', '.join(impls)} (alternating)")
        fp = bench_fast_path(impls, n, rounds, hb_rounds=min(rounds, 10), round_timeout=60 if n <= 128 else 120)
        if "torchft" not in fp:
            fp["torchft"] = {"n": n, "skipped": f"N > --torchft-max-n {args.torchft_max_n}"}
        for impl in IMPLS:
            r = fp[impl]
            if r.get("skipped"):
                continue
            if r.get("median_ms") is not None:
                log(f"  {impl}: median {r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms")
            if "error" in r:
                log(f"  {impl}: {r['error'][:300]}")
        results["fast_path"][str(n)] = {impl: fp[impl] for impl in IMPLS}

    # 2. post-kill quorum
    variants = [("torchft", "torchft", False), ("rallypoint_no_stream", "rallypoint", False), ("rallypoint_stream", "rallypoint", True)]
    runs: dict[str, list[float]] = {key: [] for key, _, _ in variants}
    errors: dict[str, list[str]] = {key: [] for key, _, _ in variants}
    for i in range(kill_reps):  # variants interleaved, so background load falls on all alike
        for key, impl, stream in variants:
            log(f"post-kill: {key} #{i + 1}")
            r = bench_post_kill(impl, stream, hb_timeout)
            if "error" in r:
                errors[key].append(r["error"])
                log(f"  {r['error'][:300]}")
            else:
                runs[key].append(r["ms"])
                log(f"  {r['ms']:.1f} ms")
    for key, impl, stream in variants:
        results["post_kill"][key] = {
            "median_ms": median(runs[key]) if runs[key] else None,
            "runs_ms": [round(x, 2) for x in runs[key]],
            "heartbeat_timeout_ms": hb_timeout,
            "stream": stream,
            **({"errors": errors[key]} if errors[key] else {}),
        }

    # 3. heartbeats/s
    log(f"heartbeats/s: {hb_threads} threads, {hb_duration:.0f}s on each (alternating segments)")
    results["heartbeats"] = bench_heartbeats(list(IMPLS), hb_threads, hb_duration)
    for impl in IMPLS:
        if results["heartbeats"][impl].get("per_s") is not None:
            log(f"  {impl}: {results['heartbeats'][impl]['per_s']:,.0f}/s")
    results["wall_s"] = round(time.monotonic() - t_all, 1)
    env["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)

    # ------------------------------------------------------------------ ratios + table
    ratios: dict[str, float | None] = {}
    rows: list[list[str]] = []
    for n in ns:
        fp = results["fast_path"][str(n)]
        t, o = fp.get("torchft", {}), fp.get("rallypoint", {})
        for metric, key in (("median", "median_ms"), ("p99", "p99_ms")):
            rt = ratio(o.get(key), t.get(key))
            if t.get(key) is not None or o.get(key) is not None:
                ratios[f"fast_path_{metric}_N{n}"] = None if rt is None else round(rt, 3)
            rows.append([f"fast-path round {metric}", str(n), _cell(t, key), _cell(o, key), fmt_ratio(rt)])
        rows.append(["  last ask -> last answer, median", str(n), fmt_ms(t.get("last_ask_to_last_answer_median_ms")), fmt_ms(o.get("last_ask_to_last_answer_median_ms")), fmt_ratio(ratio(o.get("last_ask_to_last_answer_median_ms"), t.get("last_ask_to_last_answer_median_ms")))])
        rows.append(["  release skew (client) median", str(n), fmt_ms(t.get("release_skew_median_ms")), fmt_ms(o.get("release_skew_median_ms")), ""])
        rows.append(["  heartbeat round (client baseline)", str(n), fmt_ms(t.get("heartbeat_round_median_ms")), fmt_ms(o.get("heartbeat_round_median_ms")), ""])
        rows.append(["  client processes' CPU per round", str(n), fmt_ms(t.get("client_cpu_ms_per_round")), fmt_ms(o.get("client_cpu_ms_per_round")), ""])
        rows.append(["  lighthouse CPU per round", str(n), fmt_ms(t.get("server_cpu_ms_per_round")), fmt_ms(o.get("server_cpu_ms_per_round")), fmt_ratio(ratio(o.get("server_cpu_ms_per_round"), t.get("server_cpu_ms_per_round")))])
    pk = results["post_kill"]
    tft = pk["torchft"].get("median_ms")
    for key, label in (("torchft", "torchft"), ("rallypoint_no_stream", "ours, no stream"), ("rallypoint_stream", "ours, with stream")):
        v = pk[key].get("median_ms")
        if key == "torchft":
            continue
        rt = ratio(v, tft)
        ratios[f"post_kill_{key.removeprefix('rallypoint_')}"] = None if rt is None else round(rt, 3)
        rows.append([f"post-kill quorum, {label} (hb timeout {hb_timeout} ms)", "3", fmt_ms(tft), fmt_ms(v), fmt_ratio(rt)])
    hbt, hbo = results["heartbeats"]["torchft"].get("per_s"), results["heartbeats"]["rallypoint"].get("per_s")
    rt = ratio(hbo, hbt)
    ratios["heartbeats_per_s_higher_is_better"] = None if rt is None else round(rt, 3)
    rows.append([f"heartbeats/s ({hb_threads} threads), higher is better", "-", fmt_num(hbt, "/s"), fmt_num(hbo, "/s"), fmt_ratio(rt)])
    rows.append(["  lighthouse CPU (cores busy)", "-", _frac(results["heartbeats"]["torchft"]), _frac(results["heartbeats"]["rallypoint"]), ""])

    print()
    print(f"lighthouse benchmark: torchft {env['torchft']} vs rallypoint; client: torchft's Rust LighthouseClient; "
          f"{env['cpus']} CPUs; python {env['python']}; wall {results['wall_s']} s; "
          f"load average {env['loadavg_1m_at_start']} -> {env['loadavg_1m_at_end']}")
    print(_util.table(["metric", "N", "torchft", "rallypoint", "ours/torchft"], rows))
    goals = _goals(results, ratios, ns)
    results["goals"] = goals
    print()
    for g, ok in goals.items():
        print(f"goal {g}: {'met' if ok else 'NOT met' if ok is not None else 'not measured'}")
    for n in ns:
        for impl in IMPLS:
            e = results["fast_path"][str(n)].get(impl, {}).get("error")
            if e:
                print(f"note: {impl} N={n}: {e[:400]}")
    for key, v in pk.items():
        for e in v.get("errors", []):
            print(f"note: post-kill {key}: {e[:400]}")
    for impl in IMPLS:
        e = results["heartbeats"][impl].get("error")
        if e:
            print(f"note: heartbeats {impl}: {e[:400]}")
    line = json.dumps(_clean({"bench": "lighthouse", "results": results, "ratios": ratios}), allow_nan=False)
    _util.emit_line(line, args.out)
    return 0


def _cell(r: dict, key: str) -> str:
    if r.get("skipped"):
        return "skipped"
    if r.get(key) is None:
        return "FAILED" if r.get("error") else "-"
    s = fmt_ms(r[key])
    return s + ("*" if r.get("error") else "")


def _frac(r: dict) -> str:
    v = r.get("server_cpu_fraction")
    return "-" if v is None else f"{v:.2f}"


def _goals(results: dict, ratios: dict, ns: list[int]) -> dict[str, bool | None]:
    fast = [v for k, v in ratios.items() if k.startswith("fast_path_")]
    goals: dict[str, bool | None] = {
        "fast-path ratio <= 1.0 at every N (median and p99)": (all(v <= 1.0 for v in fast) if fast and None not in fast else None),
    }
    if 1024 in ns:
        m = results["fast_path"]["1024"].get("rallypoint", {}).get("median_ms")
        goals["N=1024 round < 100 ms (ours, median)"] = None if m is None else m < 100
    s = results["post_kill"]["rallypoint_stream"].get("median_ms")
    goals["post-kill quorum with stream <= 250 ms"] = None if s is None else s <= 250
    return goals


def _clean(o: Any) -> Any:
    """JSON-safe: NaN/inf become null, floats are rounded to 0.01."""
    if isinstance(o, float):
        return round(o, 3) if o == o and abs(o) != float("inf") else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so every finally: block kills what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
