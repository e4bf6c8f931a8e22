"""Goodput under failure: rallypoint vs torchft 0.2.0, measured in one run.

G replica groups (G worker processes, one rank each, gloo on CPU over loopback, free
ports only) train a small MLP wrapped in the framework's ``DistributedDataParallel``,
with a fixed simulated compute of ``--compute-ms`` per step (a sleep between the
quorum start and the forward pass, so the async quorum overlaps it):

- ``ours``: ``rallypoint.Manager`` + ``rallypoint.ProcessGroupGloo`` +
  ``rallypoint.DistributedDataParallel`` against our ``LighthouseServer``.
- ``torchft``: ``torchft.Manager`` + ``torchft.ProcessGroupGloo`` +
  ``torchft.DistributedDataParallel`` against torchft's Rust ``LighthouseServer``.
  No user workaround: a worker whose forward/backward raises exits (rc 5), as a
  user's loop would, and is restarted by the supervisor like a killed one.

Per framework and G, in the same worker processes: warm-up (every group commits with
all G participating), a fault-free calibration phase (``--calib`` seconds: committed
participating replica-steps / (G x seconds) = the fault-free steps/s), then the chaos
phase (``--duration`` seconds): a supervisor SIGKILLs a random group at a random
moment every 7-13 s and restarts it 1 s later: a fresh process that builds the model,
Manager and DDP wrapper and heals from a live peer. By default that process was
started ahead of time and has already imported torch and the framework (a standby
released by a line on stdin; a new standby is started at once for the next failure),
so Python import time on a busy machine is not counted as framework recovery;
``--cold-restart`` starts a brand-new process instead. Then every worker is told to stop at a common step and reports the sha256 of
its parameters.

- goodput = committed participating replica-steps in the chaos window /
  (G x fault-free steps/s x duration)
- survivor stall (per kill) = kill -> the last survivor's first commit of a step it
  started after the kill
  ("stalled" when some survivor did not commit again before the window ended)
- restart -> commit (per kill) = process start -> its first participating commit
- hashes equal: sha256 of every replica's parameters at the common stop step

Both lighthouses: ``min_replicas=1``, ``--heartbeat-timeout-ms`` (default 5000, torchft's
default) and ``--join-timeout-ms`` (default 10000); both managers: ``min_replica_size=1``,
collective/quorum timeout ``--op-timeout`` s, async quorum, init_sync on.
Workers report each step as a JSON line on stdout; the parent waits on them with
deadlines. Prints a table and one JSON line ``{"bench": "chaos", "results": ...,
"ratios": ...}`` (ratios ours/torchft).

    .venv/bin/python bench/chaos.py            # G=2,3, 60 s each per framework, ~5-6 min
    .venv/bin/python bench/chaos.py --quick    # G=2, 30 s per framework
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _util  # noqa: E402
from _util import Child, close_all, fmt_ratio, median, ratio, table  # noqa: E402

FRAMEWORKS = ("ours", "torchft")
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- worker side
# The worker (chaos_worker.py) is shared with chaos_run.py, which runs it under `rallypoint run`.
from chaos_worker import worker as _worker  # noqa: E402


# ---------------------------------------------------------------------- parent side
class _Worker(Child):
    """A worker whose stdout lines go to one shared queue as (time, gid, proc_no, obj)."""

    def __init__(self, sink: "queue.Queue[tuple[float, int, int, Any]]", gid: int, no: int, **kw: Any) -> None:
        self.sink, self.gid, self.no = sink, gid, no
        self.t_start = time.time()
        super().__init__(**kw)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.time()
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = {"raw": line}
            self.sink.put((now, self.gid, self.no, obj))
        self.sink.put((time.time(), self.gid, self.no, None))  # EOF


class _Lighthouse:
    def __init__(self, fw: str, join_ms: int, hb_ms: int) -> None:
        if fw == "ours":
            from rallypoint.lighthouse.server import LighthouseServer

            self.server: Any = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=join_ms,
                                                heartbeat_timeout_ms=hb_ms)
        else:
            self.server = _util.load_torchft_native().LighthouseServer(
                bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=join_ms, heartbeat_timeout_ms=hb_ms)

    def addr(self) -> str:
        return f"http://127.0.0.1:{int(self.server.address().rsplit(':', 1)[1])}"

    def close(self) -> None:
        self.server.shutdown()


def _ledger(run: "_Run") -> dict[str, float] | None:
    """Our lighthouse's goodput ledger totals (bucket seconds), None for torchft's."""
    if run.fw != "ours":
        return None
    return dict(run.lh.server.status()["goodput"]["total"]["buckets"])


def _ledger_goodput(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """The ledger's goodput over the chaos window: productive / all settled group-seconds."""
    if before is None or after is None:
        return None
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "unreported"}
    total = sum(spent.values())
    return round(spent.get("productive", 0.0) / total, 4) if total > 0 else None


class _Run:
    """One framework at one G: the workers, their step records, the supervisor."""

    def __init__(self, fw: str, g: int, plan: dict[str, Any], rng: random.Random) -> None:
        self.fw, self.g, self.plan, self.rng = fw, g, plan, rng
        self.sink: "queue.Queue[tuple[float, int, int, Any]]" = queue.Queue()
        self.workers: dict[int, _Worker] = {}
        self.spares: dict[int, _Worker] = {}  # gid -> pre-imported process waiting for "go"
        self.all_workers: list[_Worker] = []
        self.records: list[tuple[float, int, int, dict[str, Any]]] = []  # (t, gid, proc_no, step record)
        self.events: list[dict[str, Any]] = []  # kills/crashes and restarts
        self.done: dict[int, dict[str, Any]] = {}
        self.timings: dict[int, dict[str, Any]] = {}  # proc_no -> the worker's "timing" marks
        self.errors: list[str] = []
        self.crashes = 0
        self.pending_restart: dict[int, float] = {}  # gid -> time to restart
        self.expected_exit: set[tuple[int, int]] = set()
        self.lh = _Lighthouse(fw, plan["join_timeout_ms"], plan["heartbeat_timeout_ms"])
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p)
        self.env.setdefault("RUST_LOG", "warn")
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "RALLYPOINT_LIGHTHOUSE"):
            self.env.pop(k, None)

    def start(self, gid: int, standby: bool = False) -> _Worker:
        no = len(self.all_workers)
        wplan = dict(self.plan, framework=self.fw, gid=gid, lighthouse=self.lh.addr(), standby=standby)
        w = _Worker(self.sink, gid, no, argv=[sys.executable, __file__, "--worker", json.dumps(wplan)],
                    name=f"chaos-{self.fw}-g{gid}-{no}", env=self.env, cwd=str(REPO))
        self.all_workers.append(w)
        if standby:
            self.spares[gid] = w
        else:
            self.workers[gid] = w
        return w

    def restart(self, gid: int) -> _Worker:
        """A fresh process for ``gid``: the pre-imported spare released now (then a new
        spare is started for the next failure), or with ``--cold-restart`` a new process."""
        w = self.spares.pop(gid, None)
        if w is not None and w.alive():
            w.t_start = time.time()
            w.send({"go": True})
            self.workers[gid] = w
            self.start(gid, standby=True)
            return w
        return self.start(gid)

    def pump(self, until: float) -> None:
        """Take worker lines (and run due restarts) until wall time ``until``."""
        while True:
            now = time.time()
            for gid, t in list(self.pending_restart.items()):
                if now >= t:
                    del self.pending_restart[gid]
                    w = self.restart(gid)
                    self.events.append({"type": "restart", "gid": gid, "t": w.t_start, "no": w.no})
            left = until - now
            if self.pending_restart:
                left = min(left, min(self.pending_restart.values()) - now)
            if left <= 0 and now >= until:
                return
            try:
                t, gid, no, obj = self.sink.get(timeout=max(0.001, min(left, 1.0)))
            except queue.Empty:
                continue
            if obj is None:
                if (gid, no) not in self.expected_exit and gid not in self.done:
                    self.crashes += 1
                    w = self.all_workers[no]
                    self.errors.append(f"{w.name} exited (rc={w.proc.poll()}): {w.log_tail(300)}")
                    self.events.append({"type": "crash", "gid": gid, "t": t, "no": no})
                    if self.workers.get(gid) is w:
                        self.pending_restart[gid] = t + self.plan["restart_after_s"]
                continue
            if "s" in obj:
                self.records.append((t, gid, no, obj))
            elif "ready" in obj:
                self.events.append({"type": "ready", "gid": gid, "t": t, "no": no})
            elif "done" in obj:
                self.done[gid] = obj
            elif "timing" in obj:
                self.timings[no] = obj["timing"]
            elif "error" in obj:
                self.errors.append(f"g{gid}#{no}: {obj['error']}")

    def wait_for(self, cond: Any, timeout: float) -> bool:
        end = time.time() + timeout
        while not cond():
            if time.time() >= end:
                return False
            self.pump(min(end, time.time() + 0.2))
        return True

    def kill(self, gid: int) -> None:
        w = self.workers[gid]
        self.expected_exit.add((gid, w.no))
        t = time.time()
        w.kill()
        self.events.append({"type": "kill", "gid": gid, "t": t, "no": w.no})
        self.pending_restart[gid] = t + self.plan["restart_after_s"]

    def close(self) -> None:
        logs = self.plan.get("logs")
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
            for w in self.all_workers:
                try:
                    Path(logs, f"{w.name}.log").write_bytes(Path(w.log_path).read_bytes())
                except OSError:
                    pass
        try:
            close_all(self.all_workers, grace=2.0)
        finally:
            self.lh.close()


def _count(records: list[tuple[float, int, int, dict[str, Any]]], t0: float, t1: float) -> int:
    return sum(1 for t, _, _, r in records if t0 <= t < t1 and r["c"] and r["p"])


def run_one(fw: str, g: int, plan: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    run = _Run(fw, g, plan, rng)
    res: dict[str, Any] = {"framework": fw, "groups": g}
    try:
        for gid in range(g):
            run.start(gid)
        if plan["standby"]:
            for gid in range(g):
                run.start(gid, standby=True)
        # warm-up: every group has committed 3 steps with all G participating
        def warm() -> bool:
            full = {gid for _, gid, _, r in run.records if r["c"] and r["p"] and r["n"] == g}
            return len(full) == g and sum(1 for _, _, _, r in run.records if r["c"] and r["n"] == g) >= 3 * g
        if not run.wait_for(warm, plan["startup_timeout_s"]):
            ready = sorted({e["gid"] for e in run.events if e["type"] == "ready"})
            raise RuntimeError(f"{fw} G={g}: no fault-free steps within {plan['startup_timeout_s']}s (groups with a "
                               f"Manager: {ready}, step records: {len(run.records)}); {run.errors} "
                               f"{[w.log_tail(400) for w in run.all_workers]}")
        t_cal = time.time()
        run.pump(t_cal + plan["calib_s"])
        cal_steps = _count(run.records, t_cal, t_cal + plan["calib_s"])
        rate = cal_steps / (g * plan["calib_s"])  # per replica, fault-free
        res["fault_free_steps_per_s"] = rate

        # chaos: kill a random group every 7-13 s, restart it 1 s later
        ledger0 = _ledger(run)
        t0 = time.time()
        t_end = t0 + plan["duration_s"]
        next_kill = t0 + rng.uniform(0.7, 1.3) * plan["kill_every_s"]
        while True:
            run.pump(min(next_kill, t_end))  # the supervisor's own kill schedule
            if time.time() >= t_end:
                break
            alive = [gid for gid in range(g) if gid not in run.pending_restart and run.workers[gid].alive()]
            if alive:
                run.kill(rng.choice(alive))
            next_kill = time.time() + rng.uniform(0.7, 1.3) * plan["kill_every_s"]
        good = _count(run.records, t0, t_end)
        res["committed_replica_steps"] = good
        res["goodput"] = good / (g * rate * plan["duration_s"]) if rate > 0 else None
        res["ledger_goodput"] = _ledger_goodput(ledger0, _ledger(run))  # ours: the lighthouse's own figure

        # per kill: survivor stall, restart -> first participating commit
        kills = [e for e in run.events if e["type"] in ("kill", "crash") and t0 <= e["t"] < t_end]
        per_kill = []
        for e in kills:
            survivors = [gid for gid in range(g) if gid != e["gid"]]
            firsts = []
            for gid in survivors:
                # a commit of a step that started after the kill
                ts = [t for t, rg, _, r in run.records if rg == gid and r["t0"] > e["t"] and r["c"] and t < t_end]
                firsts.append(min(ts) if ts else None)
            stall = None if any(f is None for f in firsts) else max(firsts) - e["t"]
            rs = [x for x in run.events if x["type"] == "restart" and x["gid"] == e["gid"] and x["t"] >= e["t"]]
            rc_s = ready_s = kc_s = None
            timing = None
            if rs:
                r0 = rs[0]
                rd = [x["t"] for x in run.events if x["type"] == "ready" and x["no"] == r0["no"]]
                ready_s = (rd[0] - r0["t"]) if rd else None
                ts = [t for t, rg, no, r in run.records if no == r0["no"] and r["c"] and r["p"]]
                rc_s = (min(ts) - r0["t"]) if ts and min(ts) < t_end else None
                # kill -> first participating commit, by the worker's own clock (t1: after should_commit)
                t1s = [r.get("t1", t) for t, rg, no, r in run.records if no == r0["no"] and r["c"] and r["p"]]
                kc_s = (min(t1s) - e["t"]) if t1s and min(t1s) < t_end else None
                timing = run.timings.get(r0["no"])
            per_kill.append({"type": e["type"], "gid": e["gid"], "at_s": round(e["t"] - t0, 2),
                             "survivor_stall_s": stall, "restart_to_commit_s": rc_s,
                             "restart_to_manager_ready_s": ready_s, "kill_to_commit_s": kc_s,
                             "t_kill": e["t"], "t_restart": rs[0]["t"] if rs else None, "timing": timing})
        res["kills"] = per_kill
        res["crashes"] = run.crashes
        stalls = [k["survivor_stall_s"] for k in per_kill if k["survivor_stall_s"] is not None]
        rcs = [k["restart_to_commit_s"] for k in per_kill if k["restart_to_commit_s"] is not None]
        res["median_stall_s"] = median(stalls) if stalls else None
        res["stalled"] = sum(1 for k in per_kill if k["survivor_stall_s"] is None)
        res["median_restart_to_commit_s"] = median(rcs) if rcs else None
        kcs = [k["kill_to_commit_s"] for k in per_kill if k["kill_to_commit_s"] is not None]
        res["median_kill_to_commit_s"] = median(kcs) if kcs else None
        res["restarts_without_commit"] = sum(1 for k in per_kill if k["restart_to_commit_s"] is None)

        # stop at a common step: wait for the last restarted group to take part first
        run.wait_for(lambda: not run.pending_restart, plan["restart_after_s"] + 2)
        def caught_up() -> bool:
            last = {}
            for _, gid, no, r in run.records:
                if run.workers[gid].no == no and r["c"] and r["p"]:
                    last[gid] = r["s"]
            return len(last) == g
        run.wait_for(caught_up, plan["catchup_timeout_s"])
        top = max((r["s"] for _, _, _, r in run.records), default=0)
        stop = top + plan["stop_margin_steps"]
        for w in run.workers.values():
            try:
                w.send({"stop_at": stop})
            except _util.ChildError:
                pass
        run.wait_for(lambda: len(run.done) == g, plan["stop_timeout_s"])
        hashes = {gid: d["hash"] for gid, d in run.done.items() if d["done"] == stop}
        res["stop_step"] = stop
        res["stopped"] = sorted(hashes)
        res["hashes_equal"] = (len(hashes) == g and len(set(hashes.values())) == 1)
        res["hashes"] = {f"g{k}": v[:12] for k, v in hashes.items()}
        res["errors"] = run.errors[:5]
        return res
    finally:
        run.close()


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="G=2, 30 s per framework")
    ap.add_argument("--duration", type=float, help="chaos seconds per framework per G (default 60, quick 30)")
    ap.add_argument("--groups", help="comma-separated G values (default 2,3; quick 2)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--calib", type=float, help="fault-free calibration seconds (default 8, quick 6)")
    ap.add_argument("--kill-every", type=float, default=10.0, help="mean seconds between kills (uniform +-30%%)")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="simulated compute per step")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    ap.add_argument("--join-timeout-ms", type=int, default=10000)
    ap.add_argument("--op-timeout", type=float, default=10.0, help="manager collective/quorum timeout, s")
    ap.add_argument("--cold-restart", action="store_true",
                    help="restart = a new process (imports torch: seconds on a busy machine) instead of "
                         "releasing a pre-imported standby process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON line to this file")
    ap.add_argument("--logs", help="copy every worker's stderr log into this folder")
    args = ap.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    quick = args.quick
    groups = [int(x) for x in (args.groups or ("2" if quick else "2,3")).split(",") if x]
    fws = [f for f in args.frameworks.split(",") if f]
    plan = {
        "duration_s": args.duration or (30.0 if quick else 60.0),
        "calib_s": args.calib or (6.0 if quick else 8.0),
        "kill_every_s": args.kill_every,
        "restart_after_s": 1.0,
        "compute_ms": args.compute_ms,
        "op_timeout_s": args.op_timeout,
        "join_timeout_ms": args.join_timeout_ms,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
        "startup_timeout_s": 90.0,
        "catchup_timeout_s": 10.0,
        "stop_timeout_s": 10.0,
        "stop_margin_steps": 10,
        "logs": args.logs,
        "standby": not args.cold_restart,
    }
    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for g in groups:
        for i, fw in enumerate(fws if g % 2 == 0 else fws[::-1]):
            rng = random.Random(args.seed * 1000 + g)  # the same kill schedule for both frameworks
            try:
                results[f"{fw}_g{g}"] = run_one(fw, g, plan, rng)
            except Exception as e:  # noqa: BLE001 - report and go on to the other runs
                results[f"{fw}_g{g}"] = {"framework": fw, "groups": g, "failed": str(e)[:2000]}
    wall = time.monotonic() - t_start
    load1 = os.getloadavg()[0]

    print(f"chaos: G replica groups x 1 rank, gloo/CPU loopback, torchft {_util.torchft_version()}, "
          f"{plan['compute_ms']:.0f} ms simulated compute/step, a SIGKILL every ~{plan['kill_every_s']:.0f} s, "
          f"restart {plan['restart_after_s']:.0f} s later "
          f"({'pre-imported standby process' if plan['standby'] else 'cold process start'}); lighthouse min_replicas=1, heartbeat timeout "
          f"{plan['heartbeat_timeout_ms']} ms, join timeout {plan['join_timeout_ms']} ms; op timeout "
          f"{plan['op_timeout_s']:.0f} s; {plan['duration_s']:.0f} s chaos + {plan['calib_s']:.0f} s calibration "
          f"per run; load avg {load0:.2f} -> {load1:.2f}; wall {wall:.0f} s")
    rows = []
    for key, r in results.items():
        if "failed" in r:
            rows.append([r["framework"], str(r["groups"]), "FAILED", "-", "-", "-", "-", "-", "-"])
            continue
        nk = len(r["kills"])
        stall = _fmt_s(r["median_stall_s"]) + (f" ({r['stalled']} stalled)" if r["stalled"] else "")
        rc = _fmt_s(r["median_restart_to_commit_s"]) + (
            f" ({r['restarts_without_commit']} never)" if r["restarts_without_commit"] else "")
        rows.append([r["framework"], str(r["groups"]), fmt_ratio(r["goodput"]),
                     "-" if r.get("ledger_goodput") is None else fmt_ratio(r["ledger_goodput"]),
                     f"{r['fault_free_steps_per_s']:.1f}", f"{nk}" + (f" ({r['crashes']} crash)" if r["crashes"] else ""),
                     stall, rc, "yes" if r["hashes_equal"] else f"NO ({len(r['stopped'])}/{r['groups']} stopped)"])
    print(table(["framework", "G", "goodput", "ledger goodput", "ff steps/s", "kills", "median stall", "median restart->commit",
                 "hashes equal"], rows))
    for key, r in results.items():
        if r.get("failed") or r.get("errors"):
            print(f"{key}: {r.get('failed') or r.get('errors')}", file=sys.stderr)

    def get(fw: str, g: int, k: str) -> Any:
        return results.get(f"{fw}_g{g}", {}).get(k)

    ratios: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    for g in groups:
        ratios[f"goodput_g{g}_ours_vs_torchft"] = ratio(get("ours", g, "goodput"), get("torchft", g, "goodput"))
        lg, bg = get("ours", g, "ledger_goodput"), get("ours", g, "goodput")
        if lg is not None and bg is not None:
            goals[f"ledger_goodput_g{g}_within_0.02"] = _util.goal_met(round(lg - bg, 4), abs(lg - bg) <= 0.02)
        ratios[f"stall_g{g}_ours_vs_torchft"] = ratio(get("ours", g, "median_stall_s"),
                                                      get("torchft", g, "median_stall_s"))
        ratios[f"restart_to_commit_g{g}_ours_vs_torchft"] = ratio(get("ours", g, "median_restart_to_commit_s"),
                                                                  get("torchft", g, "median_restart_to_commit_s"))
        target = {2: 0.90, 3: 0.91}.get(g)
        gp = get("ours", g, "goodput")
        if target is not None:
            goals[f"ours_goodput_g{g}>={target}"] = _util.goal_met(gp, gp is not None and gp >= target)
    _util.report_goals("chaos", plan, results, goals, ratios, args.out)
    if any(isinstance(r, dict) and r.get("failed") for r in results.values()):
        sys.exit(1)  # a run that failed is not a measurement


if __name__ == "__main__":
    main()
